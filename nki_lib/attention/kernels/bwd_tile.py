"""Flash-attention backward: the work of one (query tile, key tile) pair, in two halves.

Used by ``bwd.flash_bwd_kernel`` (plain NKI helpers, inlined at trace time); the loop structure,
budget and engine balance are described there. Per pair of a query tile (qn <= 128 rows on
partitions) and a key tile (kn <= 512 keys on the free axis):

    scores_step:  Q, dO rows-on-partitions     TensorE transposes of the group's Q^T / dO^T
                  S = Q K^T, dP = dO V^T       TensorE -> PSUM fp32 (D contracted in <= 128 chunks)
                  P = exp(scale * S - lse)     ScalarE, bias = -lse (0 for rows with lse = -inf)
                  (softcap: t = tanh(scale * S / softcap), P = exp(softcap * t - lse))
                  masks (partial tiles only)   documents: VectorE range_select before exp, with
                                               the per-row bounds; otherwise GpSimd affine_select
                                               of 0 into P (causal / sliding window)
                  dS = (dP - delta) * P        VectorE, [* (1 - t^2) under softcap]
    grads_step:   per visible 128-key block: dV += P^T dO, dK += dS^T Q (TensorE, PSUM fp32
                  accumulators of the key tile), dS^T (TensorE transpose, ScalarE eviction);
                  dQ_part = dS K (TensorE), acc = scale * dQ_part (+ acc) in the fp32 group
                  accumulator (ScalarE on the tile's first key tile, else VectorE).

Shapes: S, dP (qn, kn) fp32 PSUM; P, dS (qn, kn) in the input dtype (SBUF); dS^T
(128, nblocks, qn) PSUM -> SBUF; dQ_part (qn, D) fp32 PSUM; dK/dV accumulators
(128, nblocks, stride >= D) fp32 PSUM; stats (128, NT, NSTAT) fp32 (``bwd_prep``).
Dimension legend: qn/kn rows/keys of the tile, D head dim, NT query tiles.
Limits: D <= 256; masked scores (documents, no softcap) need scale > 0 (checked by the
launcher); P and dS are rounded to the input dtype before their matmuls (as flash-attn does).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels import tiles
from nki_lib.attention.kernels.bwd_prep import DELTA, HI, LO, NEG_LSE

__all__ = ["Config", "natural_rows", "scores_step", "grads_step"]


class Config(nl.NKIObject):
    """Compile-time settings shared by the helpers of one kernel launch."""

    def __init__(self, mask, scale: float, softcap: float, head_dim: int, num_stats: int):
        self.mask = mask
        self.scale = scale
        self.softcap = softcap
        self.head_dim = head_dim
        self.num_stats = num_stats


def natural_rows(xT_sb, cols, qn, head_dim, engine):
    """(pmax, D) rows-on-partitions copy of the (D, qn) columns ``cols`` of a transposed tile
    (TensorE transposes, bit-exact, evicted on ``engine``)."""
    pmax = nl.tile_size.pmax
    t_psum = nl.ndarray((pmax, head_dim), dtype=xT_sb.dtype, buffer=nl.psum)
    for ch, (d0, dc) in enumerate(tiles.head_dim_chunks(head_dim)):
        nisa.nc_transpose(dst=t_psum[:qn, d0:d0 + dc], data=xT_sb[:dc, ch, cols:cols + qn],
                          engine=nisa.engine.tensor)
    x_sb = nl.ndarray((pmax, head_dim), dtype=xT_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=x_sb[:qn, :], src=t_psum[:qn, :], engine=engine)
    return x_sb


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


def _dscores(dp_psum, p_sb, tsq_sb, stat, qn, kn, mm_dtype):
    """dS = (dP - delta) * P, times (1 - tanh^2) under softcap (VectorE)."""
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    factor = p_sb[:qn, :kn]
    if tsq_sb is not None:
        g_sb = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=g_sb[:qn, :kn], data=tsq_sb[:qn, :kn], op0=nl.subtract, operand0=1.0,
                                  reverse0=True, op1=nl.multiply, operand1=factor)
        factor = g_sb[:qn, :kn]
    ds_sb = nl.ndarray((pmax, kw), dtype=mm_dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ds_sb[:qn, :kn], data=dp_psum[:qn, :kn], op0=nl.subtract,
                              operand0=stat[:qn, DELTA], op1=nl.multiply, operand1=factor)
    return ds_sb


def scores_step(loaded, kv, stats_sb, slot, t, qn, tile_masked, k0, kn, cfg):
    """First half of a (query tile, key tile) pair: Q, dO rows, S, dP, P and dS.
    Returns what :func:`grads_step` needs."""
    qT_sb, doT_sb, _ = loaded
    _, kT_sb, vT_sb, _, _, _ = kv
    pmax = nl.tile_size.pmax
    kw = tiles.key_tile_width()
    d = cfg.head_dim
    cols = slot * pmax
    stat = stats_sb[:, t, :]
    q_sb = natural_rows(qT_sb, cols, qn, d, nisa.engine.scalar)
    do_sb = natural_rows(doT_sb, cols, qn, d, nisa.engine.scalar)
    s_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    dp_psum = nl.ndarray((pmax, kw), dtype=nl.float32, buffer=nl.psum)
    for ch, (d0, dc) in enumerate(tiles.head_dim_chunks(d)):
        nisa.nc_matmul(dst=s_psum[:qn, :kn], stationary=qT_sb[:dc, ch, cols:cols + qn],
                       moving=kT_sb[:dc, ch, :kn], accumulate=ch > 0)
    for ch, (d0, dc) in enumerate(tiles.head_dim_chunks(d)):
        nisa.nc_matmul(dst=dp_psum[:qn, :kn], stationary=doT_sb[:dc, ch, cols:cols + qn],
                       moving=vT_sb[:dc, ch, :kn], accumulate=ch > 0)
    p_sb, tsq_sb = _probs(s_psum, stat, t * pmax, k0, qn, kn, tile_masked, cfg, q_sb.dtype)
    ds_sb = _dscores(dp_psum, p_sb, tsq_sb, stat, qn, kn, q_sb.dtype)
    return q_sb, do_sb, p_sb, ds_sb


def grads_step(scores, loaded, kv, slot, t, qn, k0, kn, first, cfg):
    """Second half: dV += P^T dO, dK += dS^T Q, dS^T, dQ_part = dS K; ``scale * dQ_part`` lands in
    the dQ group accumulator slot (stored on the tile's first key tile, added otherwise)."""
    q_sb, do_sb, p_sb, ds_sb = scores
    dq_grp = loaded[2]
    k_sb, _, _, dk_psum, dv_psum, started = kv
    pmax = nl.tile_size.pmax
    d = cfg.head_dim
    blocks = tiles.key_blocks(kn)
    mm_dtype = q_sb.dtype
    # 128-key blocks some query of the tile sees (never empty for a planned tile: the visible keys
    # of consecutive rows form one interval); the others skip the dV/dK/dQ matmuls
    seen = [c for c, (s0, sn) in enumerate(blocks) if cfg.mask.tile_visible(t * pmax, qn, k0 + s0, sn)]
    seen = seen or list(range(len(blocks)))
    dsT_psum = nl.ndarray((pmax, len(blocks), pmax), dtype=mm_dtype, buffer=nl.psum)
    dsT_sb = nl.ndarray((pmax, len(blocks), pmax), dtype=mm_dtype, buffer=nl.sbuf)
    for c in seen:
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dv_psum[:sn, c, :d], stationary=p_sb[:qn, s0:s0 + sn], moving=do_sb[:qn, :],
                       accumulate=started[c])
        nisa.nc_matmul(dst=dk_psum[:sn, c, :d], stationary=ds_sb[:qn, s0:s0 + sn], moving=q_sb[:qn, :],
                       accumulate=started[c])
        started[c] = True
        nisa.nc_transpose(dst=dsT_psum[:sn, c, :qn], data=ds_sb[:qn, s0:s0 + sn], engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=dsT_sb[:sn, c, :qn], src=dsT_psum[:sn, c, :qn], engine=nisa.engine.scalar)
    dq_psum = nl.ndarray((pmax, d), dtype=nl.float32, buffer=nl.psum)
    for n, c in enumerate(seen):
        s0, sn = blocks[c]
        nisa.nc_matmul(dst=dq_psum[:qn, :], stationary=dsT_sb[:sn, c, :qn], moving=k_sb[:sn, c, :],
                       accumulate=n > 0)
    acc = dq_grp[:qn, slot, :]
    if first:
        nisa.activation(dst=acc, op=nl.copy, data=dq_psum[:qn, :], scale=cfg.scale)
    else:
        nisa.scalar_tensor_tensor(dst=acc, data=dq_psum[:qn, :], op0=nl.multiply, operand0=cfg.scale,
                                  op1=nl.add, operand1=acc)
