"""Flash-attention backward: the stages of one (query tile, key tile) pair.

Used by ``flash_attention_bwd.flash_attention_bwd_kernel`` (plain NKI helpers, inlined at trace time), which runs each
stage of pair j at pipeline step j + lag (``flash_attention_bwd_pipeline.STAGES``); the loop structure, budget and engine
balance are described there. Per pair of a query tile (qn <= 128 rows on partitions) and a key
tile (kn <= 512 keys on the free axis; diagonal tiles stop at the last visible 128-key block),
a :class:`Pair` carries the tiles from one stage to the next:

    scores_stage:  S = Q K^T, dP = dO V^T       TensorE -> PSUM fp32 (D contracted in <= 128
                                                chunks; Q^T / dO^T of the group are stationary)
    probs_stage:   P = exp(scale * S - lse)     ScalarE, bias = -lse (0 for rows with lse = -inf)
                   (softcap: t = tanh(scale * S / softcap), P = exp(softcap * t - lse))
                   masks (partial tiles only)   documents: VectorE range_select before exp, with
                                                the per-row bounds; otherwise GpSimd affine_select
                                                of 0 into P (causal / sliding window)
                   dP - delta                   ScalarE PSUM eviction (copy with bias -delta), fp32
    dscores_stage: dS = (dP - delta) * P        GpSimd (both inputs in SBUF), [* (1 - t^2) under
                                                softcap: VectorE]
    dv_stage:      dV += P^T dO                 TensorE, per visible 128-key block
    dk_stage:      dK += dS^T Q, dS^T           TensorE, per visible block (transpose to PSUM);
                                                a :class:`DsCouple`'s pairs skip the transposes:
                                                its last pair issues one DMA transpose of both dS
    evict_stage:   dS^T PSUM -> SBUF            VectorE (not for a couple's pairs)
    dq_stage:      dQ_part = dS K               TensorE -> PSUM fp32
    acc_stage:     acc (+)= dQ_part             the fp32 group accumulator (ScalarE copy on the
                                                tile's first key tile, else VectorE add); the
                                                softmax scale is applied when dq leaves

Shapes: S, dP (qn, kn) fp32 PSUM; dP - delta (qn, kn) fp32 SBUF; P, dS (qn, kn) in the input
dtype (SBUF); dS^T (128, nblocks, qn) PSUM -> SBUF; dQ_part (qn, D) fp32 PSUM; dK/dV accumulators
(128, nblocks, stride >= D) fp32 PSUM; stats (128, NT, NSTAT) fp32 (``flash_attention_bwd_prep``).
Dimension legend: qn/kn rows/keys of the tile, D head dim, NT query tiles, NSTAT statistics.
Limits: D <= 256; masked scores (documents, no softcap) need scale > 0 (checked by the
launcher); P and dS are rounded to the input dtype before their matmuls (as flash-attn does).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels import tiles
from nki_lib.attention.kernels.flash_attention_bwd_prep import HI, LO, NEG_DELTA, NEG_LSE

__all__ = ["Config", "Pair", "DsCouple", "seen_blocks", "scores_stage", "probs_stage", "dscores_stage", "dv_stage",
           "dk_stage", "evict_stage", "dq_stage", "acc_stage"]


class Config(nl.NKIObject):
    """Compile-time settings shared by the helpers of one kernel launch."""

    def __init__(self, mask, scale: float, softcap: float, head_dim: int, num_stats: int):
        self.mask = mask
        self.scale = scale
        self.softcap = softcap
        self.head_dim = head_dim
        self.num_stats = num_stats


def _probs(s_psum, stat, q0, k0, qn, kn, tile_masked, cfg, mm_dtype):
    """P (qn, kn) in the matmul dtype; under softcap also tanh^2 (fp32, for the chain rule).

    Masks of partial tiles: with documents, the per-row bounds (documents, causal and window
    together) by a VectorE ``range_select`` on the scores before exp; otherwise causal/window
    (affine in row and key) by GpSimd ``affine_select`` on P after exp, selecting 0 (a select,
    so whatever exp produced at masked positions is discarded)."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    neg_lse = stat[:qn, NEG_LSE]
    doc_masked = tile_masked and cfg.mask.has_docs
    p_sb = nl.ndarray((pmax, kw), dtype=mm_dtype, buffer=nl.sbuf)
    tsq_sb = None
    if cfg.softcap > 0:
        t_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t_sb[:qn, :kn], op=nl.tanh, data=s_psum[:qn, :kn], scale=cfg.scale / cfg.softcap)
        tsq_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=tsq_sb[:qn, :kn], op=nl.square, data=t_sb[:qn, :kn])
        if doc_masked:
            _doc_mask(t_sb[:qn, :kn], t_sb[:qn, :kn], stat, k0, qn)
        nisa.activation(dst=p_sb[:qn, :kn], op=nl.exp, data=t_sb[:qn, :kn], scale=cfg.softcap, bias=neg_lse)
    else:
        src = s_psum[:qn, :kn]
        if doc_masked:
            sm_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
            _doc_mask(sm_sb[:qn, :kn], src, stat, k0, qn)
            src = sm_sb[:qn, :kn]
        nisa.activation(dst=p_sb[:qn, :kn], op=nl.exp, data=src, scale=cfg.scale, bias=neg_lse)
    if tile_masked and not doc_masked:  # (document bounds already include causal/window)
        for offset, row_step, key_step in _affine_conditions(cfg.mask, q0, qn, k0, kn):
            nisa.affine_select(dst=p_sb[:qn, :kn], pattern=[[key_step, kn]], channel_multiplier=row_step,
                               on_true_tile=p_sb[:qn, :kn], on_false_value=0.0, cmp_op=nl.greater_equal,
                               offset=offset)
    return p_sb, tsq_sb


def _affine_conditions(mask, q0, qn, k0, kn):
    """The causal/window rules on a tile as ``offset + row_step * r + key_step * c >= 0`` (r, c: row
    and key within the tile), keeping only those some element of the tile violates."""
    diag = q0 + mask.offset - k0          # the key (tile-relative) aligned with row 0
    upper = ([0] if mask.causal else []) + ([mask.window_right] if mask.window_right >= 0 else [])
    conds = []
    if upper:
        conds.append((diag + min(upper), 1, -1))        # c <= r + diag + min(shifts)
    if mask.window_left >= 0:
        conds.append((mask.window_left - diag, -1, 1))  # c >= r + diag - window_left
    return [(off, rs, ks) for off, rs, ks in conds if off + min(0, rs * (qn - 1)) + min(0, ks * (kn - 1)) < 0]


def _doc_mask(dst, scores, stat, k0, qn):
    """dst = scores where lo <= key <= hi (the row's visible interval), else MASK_FILL."""
    nisa.range_select(dst=dst, on_true_tile=scores, comp_op0=nl.greater_equal, comp_op1=nl.less_equal,
                      bound0=stat[:qn, LO], bound1=stat[:qn, HI], range_start=k0,
                      on_false_value=tiles.MASK_FILL)


def seen_blocks(cfg, t, qn, k0, kn):
    """Indices of the 128-key blocks some query of tile t sees (never empty for a planned tile: the
    visible keys of consecutive rows form one interval); the others skip the dV/dK/dQ matmuls."""
    pmax = nl.tile_size.pmax
    blocks = tiles.key_blocks(kn)
    seen = [c for c, (s0, sn) in enumerate(blocks) if cfg.mask.tile_visible(t * pmax, qn, k0 + s0, sn)]
    return seen or list(range(len(blocks)))


class Pair(nl.NKIObject):
    """One (query tile, key tile) pair in flight: where its rows live and the tiles its stages
    pass on (each PSUM tile is dropped by the stage that consumes it, freeing its bank)."""

    def __init__(self, loaded, slot: int, t: int, qn: int, tile_masked: bool, first: bool):
        self.loaded = loaded
        self.slot = slot
        self.t = t
        self.qn = qn
        self.tile_masked = tile_masked
        self.first = first
        self.couple = None
        self.couple_slot = 0
        self.tiles = {}


class DsCouple(nl.NKIObject):
    """Interior pairs of one (key tile, query group) unit (every query row sees every key of the
    full key tile) whose dS tiles share one SBUF tile ``(pmax, n, kw)``, transposed by ONE DMA
    transpose into ``dsT_sb`` ``(pmax, n, nblocks, pmax)`` (keys on partitions) instead of
    TensorE transposes and VectorE evictions: each partition of the DMA moves one run of
    ``n * kw`` 2-byte elements (2 KiB for a couple), so the per-chunk DMA floor is paid once per
    run (docs/cost-model.md §2.6). The last member's dscores stage issues it."""

    def __init__(self, pairs, dtype):
        pmax, kw = nl.tile_size.pmax, tiles.key_tile_width()
        self.pairs = pairs
        self.ds_sb = nl.ndarray((pmax, len(pairs), kw), dtype=dtype, buffer=nl.sbuf)
        self.dsT_sb = nl.ndarray((pmax, len(pairs), kw // pmax, pmax), dtype=dtype, buffer=nl.sbuf)
        for slot, member in enumerate(pairs):
            member.couple, member.couple_slot = self, slot

    def transpose(self):
        pmax, n = nl.tile_size.pmax, len(self.pairs)
        nb = self.dsT_sb.shape[2]
        nisa.dma_transpose(dst=self.dsT_sb, src=self.ds_sb.reshape((pmax, n, nb, pmax)))
        for slot, member in enumerate(self.pairs):
            member.tiles["dsT"] = self.dsT_sb[:, slot, :, :]


def scores_stage(pair, kv, k0, kn, cfg):
    """TensorE: S = Q K^T and dP = dO V^T into fp32 PSUM (D contracted in <= 128 chunks)."""
    qdoT_sb = pair.loaded[0]
    kT_sb, vT_sb = kv.kT_sb, kv.vT_sb
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    cols, qn = pair.slot * pmax, pair.qn
    s_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    dp_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    for ch, (d0, dc) in enumerate(tiles.head_dim_chunks(cfg.head_dim)):
        nisa.nc_matmul(dst=s_psum[:qn, :kn], stationary=qdoT_sb[:dc, ch, 0, cols:cols + qn],
                       moving=kT_sb[:dc, ch, :kn], accumulate=ch > 0)
    for ch, (d0, dc) in enumerate(tiles.head_dim_chunks(cfg.head_dim)):
        nisa.nc_matmul(dst=dp_psum[:qn, :kn], stationary=qdoT_sb[:dc, ch, 1, cols:cols + qn],
                       moving=vT_sb[:dc, ch, :kn], accumulate=ch > 0)
    pair.tiles["s"], pair.tiles["dp"] = s_psum, dp_psum


def probs_stage(pair, stats_sb, k0, kn, cfg):
    """ScalarE: P = exp(scale * S - lse) (masks of partial tiles on GpSimd / VectorE) and the
    eviction dP - delta (fp32, the bias of a copy); frees both PSUM tiles."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    qn = pair.qn
    stat = stats_sb[:, pair.t, :]
    mm_dtype = pair.loaded[0].dtype
    p_sb, tsq_sb = _probs(pair.tiles.pop("s"), stat, pair.t * pmax, k0, qn, kn, pair.tile_masked, cfg, mm_dtype)
    dpm_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=dpm_sb[:qn, :kn], op=nl.copy, data=pair.tiles.pop("dp")[:qn, :kn],
                    bias=stat[:qn, NEG_DELTA])
    pair.tiles["p"], pair.tiles["tsq"], pair.tiles["dpm"] = p_sb, tsq_sb, dpm_sb


def dscores_stage(pair, kn):
    """GpSimd: dS = (dP - delta) * P [* (1 - tanh^2) under softcap, on VectorE], in the matmul dtype
    (one plain product of two SBUF tiles: GpSimd streams it at its rate whatever the dtype, where
    VectorE's fp32 rate is a low-confidence constant; docs/perf-log.md §12.5)."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    qn = pair.qn
    p_sb, tsq_sb, dpm_sb = pair.tiles["p"], pair.tiles.pop("tsq"), pair.tiles.pop("dpm")
    factor = p_sb[:qn, :kn]
    if tsq_sb is not None:
        g_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=g_sb[:qn, :kn], data=tsq_sb[:qn, :kn], op0=nl.subtract, operand0=1.0,
                                  reverse0=True, op1=nl.multiply, operand1=factor)
        factor = g_sb[:qn, :kn]
    couple = pair.couple
    if couple is None:
        ds_sb = nl.ndarray((pmax, kw), dtype=p_sb.dtype, buffer=nl.sbuf)
    else:
        ds_sb = couple.ds_sb[:, pair.couple_slot, :]
    nisa.tensor_tensor(dst=ds_sb[:qn, :kn], data1=dpm_sb[:qn, :kn], data2=factor, op=nl.multiply,
                       engine=nisa.engine.gpsimd)
    pair.tiles["ds"] = ds_sb


def dv_stage(pair, kv, k0, kn, cfg):
    """TensorE: dV += P^T dO per seen block (queries are the contraction dim: no transpose)."""
    p_sb = pair.tiles.pop("p")
    qdo_sb = pair.loaded[1]
    dv_psum, dv_started = kv.dv_psum, kv.dv_started
    qn, d = pair.qn, cfg.head_dim
    blocks = tiles.key_blocks(kn)
    for c in seen_blocks(cfg, pair.t, qn, k0, kn):
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dv_psum[:sn, c, :d], stationary=p_sb[:qn, s0:s0 + sn],
                       moving=qdo_sb[:qn, 1, pair.slot, :], accumulate=dv_started[c])
        dv_started[c] = True


def dk_stage(pair, kv, k0, kn, cfg):
    """TensorE: dK += dS^T Q per seen block, and the dS^T transposes into one PSUM tile (a
    couple's pairs: none; the couple's last pair issues its DMA transpose)."""
    ds_sb = pair.tiles.pop("ds")
    qdo_sb = pair.loaded[1]
    dk_psum, dk_started = kv.dk_psum, kv.dk_started
    pmax = nl.tile_size.pmax
    qn, d = pair.qn, cfg.head_dim
    blocks = tiles.key_blocks(kn)
    on_pe = pair.couple is None   # else the couple's DMA transpose makes dS^T
    dsT_psum = nl.ndarray((pmax, len(blocks), pmax), dtype=ds_sb.dtype, buffer=nl.psum) if on_pe else None
    for c in seen_blocks(cfg, pair.t, qn, k0, kn):
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dk_psum[:sn, c, :d], stationary=ds_sb[:qn, s0:s0 + sn],
                       moving=qdo_sb[:qn, 0, pair.slot, :], accumulate=dk_started[c])
        dk_started[c] = True
        if on_pe:
            nisa.nc_transpose(dst=dsT_psum[:sn, c, :qn], data=ds_sb[:qn, s0:s0 + sn], engine=nisa.engine.tensor)
    if on_pe:
        pair.tiles["dsT_psum"] = dsT_psum
    elif pair.couple_slot == len(pair.couple.pairs) - 1:
        pair.couple.transpose()


def evict_stage(pair, k0, kn, cfg):
    """VectorE: dS^T PSUM -> SBUF (16-bit, one copy per seen block); nothing for a couple's pair."""
    if pair.couple is not None:
        return
    pmax = nl.tile_size.pmax
    qn = pair.qn
    blocks = tiles.key_blocks(kn)
    dsT_psum = pair.tiles.pop("dsT_psum")
    dsT_sb = nl.ndarray((pmax, len(blocks), pmax), dtype=dsT_psum.dtype, buffer=nl.sbuf)
    for c in seen_blocks(cfg, pair.t, qn, k0, kn):
        sn = blocks[c][1]
        nisa.tensor_copy(dst=dsT_sb[:sn, c, :qn], src=dsT_psum[:sn, c, :qn], engine=nisa.engine.vector)
    pair.tiles["dsT"] = dsT_sb


def dq_stage(pair, kv, k0, kn, cfg):
    """TensorE: dQ_part = dS K, accumulated over the seen blocks in one fp32 PSUM tile."""
    dsT_sb = pair.tiles.pop("dsT")
    k_sb = kv.k_sb
    pmax = nl.tile_size.pmax
    qn = pair.qn
    blocks = tiles.key_blocks(kn)
    dq_psum = nl.ndarray((pmax, cfg.head_dim), dtype=nl.float32, buffer=nl.psum)
    for n, c in enumerate(seen_blocks(cfg, pair.t, qn, k0, kn)):
        sn = blocks[c][1]
        nisa.nc_matmul(dst=dq_psum[:qn, :], stationary=dsT_sb[:sn, c, :qn], moving=k_sb[:sn, c, :],
                       accumulate=n > 0)
    pair.tiles["dq"] = dq_psum


def acc_stage(pair):
    """dQ_part into the group accumulator slot: copied on the tile's first key tile (ScalarE), added
    otherwise (VectorE); the softmax scale is applied once when dq leaves."""
    dq_psum = pair.tiles.pop("dq")
    qn = pair.qn
    acc = pair.loaded[2][:qn, pair.slot, :]
    if pair.first:
        nisa.tensor_copy(dst=acc, src=dq_psum[:qn, :], engine=nisa.engine.scalar)
    else:
        nisa.tensor_tensor(dst=acc, data1=dq_psum[:qn, :], data2=acc, op=nl.add)
