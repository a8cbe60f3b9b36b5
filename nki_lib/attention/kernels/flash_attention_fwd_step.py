"""Per-step tile work of the flash-attention forward kernel (``flash_attention_fwd.py``): scores, softmax,
P transposes and P @ V of one step (group, key section, query head). Each function emits the
NKI instructions of one stage; :mod:`fwd_pipeline` orders them across steps. P^T comes from
TensorE transposes and PSUM evictions, or for some long sections from one SBUF -> SBUF DMA
transpose (:func:`dma_transpose_p`).

Shapes: q^T tiles (dc, qn), K^T section tiles (dc, slen), V of a section as per-block pairs
(``flash_attention_fwd_values``: (bn, D) tile and P's matching columns), scores S (qn, slen)
fp32, P (qn, slen) in the V dtype, P^T PSUM tiles
(128, blocks per bank, qn), O (qn, D) fp32 PSUM.
Dimension legend: dc head-dim chunk (<= 128), qn query rows (<= 128), kn keys of a score tile
(<= 512), slen keys of a section, s0 its first key, D head dim.
Limits: those of ``flash_attention_fwd.py`` (bf16/fp16/fp32, D <= 256).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.tiles import key_blocks, key_tile_width, mask_scores
from nki_lib.sizes import FP32_BYTES, HALF_BYTES

__all__ = ["PT_DVE_SHARE", "PT_DVE_SHARE_DMA_PT", "PT_DVE_SHARE_EARLY", "PT_EARLY_UNTIL", "PT_DVE_SHARE_SOFTCAP", "warm_table", "section_scores", "softmax_step", "transpose_p", "evict_pt",
           "natural_suffix", "dma_transpose_p", "p_times_v"]

EVICT_RUN_TILES = 1  # unmasked score tiles evicted together (fp32 PSUM banks; an engine operand
                     # may read 4K PSUM elements per partition, docs/nki-semantics.md §3.5). Runs
                     # of 2 paid tensor_scalar_reduce's 64-cycle extra once per 1024 keys; the
                     # range_select eviction (evict_unmasked) has none, so one bank per eviction
                     # (less PSUM held: 4096 causal 109.3 / 106.7 -> 108.7 / 106.4 us, §16.3)
PT_DVE_SHARE = 0.42  # share of a section's P^T blocks evicted by VectorE, the rest by ScalarE.
                      # Per 2048-key bf16 section (trn2 rates) ScalarE has ~1.9 us fixed work
                      # (exp, the first section's acc copy) and VectorE ~2.4 us (score evicts +
                      # max, acc; less with EVICT_RUN_TILES), and a P^T block costs ScalarE 0.107 us, VectorE 0.067 us
                      # (16-bit PSUM at 2x): 0.42 balances them at 4096 causal with the last
                      # steps' blocks all on VectorE (flash_attention_fwd.DRAIN_STEPS;
                      # docs/perf-log.md §12.4)
PT_DVE_SHARE_DMA_PT = 0.42  # the same when some long sections' P^T go by DMA transpose
                            # (flash_attention_fwd_plan.dma_transposed_steps) and the first V run is
                            # padded (the rows 0-6 blocks), for the steps after PT_EARLY_UNTIL:
                            # 0.43 with tensor_scalar_reduce evictions (docs/perf-log.md §14.4);
                            # 0.47 for every step once the range_select evictions took 4.3 us off
                            # VectorE, then 0.55 / 0.42 before / after PT_EARLY_UNTIL (§16.3)
PT_DVE_SHARE_EARLY = 0.55   # ... and for the steps of the first PT_EARLY_UNTIL of the program: in
PT_EARLY_UNTIL = 0.5        # causal order those are mostly the single-section rows, whose steps
                            # all carry a first-section acc = O copy on ScalarE and no acc add on
                            # VectorE, so there VectorE waited on ScalarE's exps (4096 causal:
                            # 108.7 / 106.4 -> 107.5 / 105.3 us; 0.5 / 0.6 early, 0.40 / 0.44
                            # late, 0.4 / 0.6 of the program: 108.2, 107.7, 108.4, 107.6, 108.0,
                            # 107.7 in order, §16.3)
PT_DVE_SHARE_SOFTCAP = 1.0  # softcap adds a tanh pass (1.7 us per section) on ScalarE, which then
                            # stays the busier engine with every P^T block on VectorE


def warm_table(func, seed_sb=None):
    """One tiny ``func`` activation on ScalarE, on a constant: the activation table of ``func``
    is loaded on first use, so issued while ScalarE would otherwise wait (the kernel start under
    the first loads; the exp -> log switch of the last lse batch, under the last P @ V and acc
    chain), its load is off the path to the first softmax / the last lse. Returns the (1, 1)
    constant it read (``seed_sb``, made on the first call), to be passed to later calls so that
    they wait for nothing."""
    if seed_sb is None:
        seed_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=seed_sb, value=1.0, engine=nisa.engine.gpsimd)
    warm_sb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=warm_sb, op=func, data=seed_sb)
    return seed_sb


def qk(q_tiles, k_tiles, qn, kn):
    """Raw scores (qn, kn) fp32 PSUM = q @ k^T, accumulated over the head-dim chunks [PE]; a
    run wider than one score tile spans several PSUM banks, one matmul per bank and chunk."""
    s_psum = nl.ndarray((qn, kn), dtype=nl.float32, buffer=nl.psum)
    kw = key_tile_width()
    for c0 in range(0, kn, kw):
        c1 = min(kn, c0 + kw)
        for c in range(len(q_tiles)):
            nisa.nc_matmul(dst=s_psum[:, c0:c1], stationary=q_tiles[c],
                           moving=k_tiles[c][:, c0:c1], accumulate=c > 0)
    return s_psum


def evict_runs(sub_tiles):
    """The score tiles ``((k0, kn, masked), ...)`` with consecutive unmasked tiles merged into
    runs of up to ``EVICT_RUN_TILES`` tiles, each evicted (and max-reduced) by one instruction."""
    width = EVICT_RUN_TILES * key_tile_width()
    runs = []
    for k0, kn, masked in sub_tiles:
        if (runs and not masked and not runs[-1][2] and runs[-1][0] + runs[-1][1] == k0
                and runs[-1][1] + kn <= width):
            runs[-1] = (runs[-1][0], runs[-1][1] + kn, False)
        else:
            runs.append((k0, kn, masked))
    return tuple(runs)


def evict_unmasked(s_tile, s_psum, k0, all_keys, rowmax, reduce_cmd):
    """Unmasked raw scores (qn, kn) from PSUM to SBUF with their row max chained in the VectorE
    accumulator: one ``range_select`` with bounds every key passes (``tiles.all_key_bounds``),
    the instruction AWS documents for this attention step (max(64, N) cycles, without
    ``tensor_scalar_reduce``'s 64-cycle extra, docs/cost-model.md §2.2)."""
    qn = s_tile.shape[0]
    mask_scores(s_tile, all_keys[0][:qn], all_keys[1][:qn], k0, rowmax, reduce_cmd=reduce_cmd,
                src=s_psum)


def section_scores(q_tiles, k_tiles, sub_tiles, s0, scale, softcap, bounds, all_keys=None):
    """Final scores (qn, slen) fp32 in SBUF of a key section and their row max (qn, 1).

    Per score tile (``sub_tiles`` = ``((k0, kn, masked), ...)``; without softcap, runs of
    consecutive unmasked tiles, :func:`evict_runs`): QK^T into one PSUM bank per tile, then one
    evict: scaled, capped, masked on partial tiles only; unmasked tiles (runs) take one VectorE
    range_select with ``all_keys`` bounds (:func:`evict_unmasked`) when the scores need no
    scale (``scale == 1``, no softcap), else one tensor_scalar_reduce (evict + scale + max). The row max is chained over the section's tiles
    in the VectorE accumulator (``reset_reduce`` on the first tile, ``reduce`` after it; no other
    accumulator instruction runs on VectorE in between) and read out once, by the last tile."""
    qn = q_tiles[0].shape[1]
    slen = sub_tiles[-1][0] + sub_tiles[-1][1] - s0
    s_sb = nl.ndarray((qn, slen), dtype=nl.float32, buffer=nl.sbuf)
    rowmax = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if softcap == 0:
        sub_tiles = evict_runs(sub_tiles)
    last = len(sub_tiles) - 1
    for i, (k0, kn, masked) in enumerate(sub_tiles):
        s_tile = s_sb[:, k0 - s0:k0 - s0 + kn]
        cmd = nisa.reduce_cmd.reset_reduce if i == 0 else nisa.reduce_cmd.reduce
        res = rowmax if i == last else None
        s_psum = qk(q_tiles, [k_sb[:, k0 - s0:k0 - s0 + kn] for k_sb in k_tiles], qn, kn)
        src, factor = s_psum, scale
        if softcap > 0:
            nisa.activation(dst=s_tile, op=nl.tanh, data=src, scale=scale / softcap)
            src, factor = s_tile, softcap
        if masked and softcap == 0 and factor == 1.0:    # select straight from PSUM
            mask_scores(s_tile, bounds[0], bounds[1], k0, res, reduce_cmd=cmd, src=src)
        elif masked:
            if softcap > 0:
                nisa.tensor_scalar(dst=s_tile, data=src, op0=nl.multiply, operand0=factor)
            else:
                nisa.activation(dst=s_tile, op=nl.copy, data=src, scale=factor)
            mask_scores(s_tile, bounds[0], bounds[1], k0, res, reduce_cmd=cmd)
        elif softcap == 0 and factor == 1.0 and all_keys is not None:
            evict_unmasked(s_tile, src, k0, all_keys, res, cmd)
        else:
            nisa.tensor_scalar_reduce(dst=s_tile, data=src, op0=nl.multiply, operand0=factor,
                                      reduce_op=nl.maximum, reduce_res=res, reduce_cmd=cmd)
    return s_sb, rowmax


def softmax_step(state, s_sb, rowmax, p_dtype, exp_scale, p_width=None):
    """Update neg_m = min(neg_m, -exp_scale * rowmax) with the section (GpSimd; ``exp_scale`` is
    the softmax scale when the scores are kept unscaled, see ``flash_attention_fwd.RAW_SCALE_MIN``, else 1);
    returns
    P = exp(s - m_new) (qn, slen), alpha = exp(m - m_new) (None for a fresh state: its first
    section sets l and acc instead of rescaling them) and the row sum of P (qn, 1) (l is updated
    later, with acc, by ``flash_attention_fwd_pipeline.stage_acc``)."""
    qn, slen = s_sb.shape
    neg_m_new = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m_new, data=rowmax, op0=nl.multiply, operand0=-exp_scale,
                       op1=nl.minimum, operand1=state.neg_m, engine=nisa.engine.gpsimd)
    alpha = None        # a fresh state (l = 0, acc unset) needs no rescale
    if not state.fresh:
        alpha = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha, op=nl.exp, data=state.neg_m, scale=-1.0, bias=neg_m_new)
    width = slen if p_width is None else p_width
    p_sb = nl.ndarray((qn, width), dtype=p_dtype, buffer=nl.sbuf)
    if width > slen:    # columns of a padded V run past the section: P = 0 there
        nisa.memset(dst=p_sb[:, slen:width], value=0.0, engine=nisa.engine.gpsimd)
    rowsum = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb[:, 0:slen], op=nl.exp, data=s_sb, scale=exp_scale, bias=neg_m_new,
                    reduce_op=nl.add,
                    reduce_res=rowsum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    state.neg_m = neg_m_new
    state.fresh = False
    return p_sb, alpha, rowsum


def transpose_p(p_sb, v_blocks):
    """P^T in PSUM: one TensorE transpose per 128-key block of P (qn, slen), taking the block's
    key columns in the order its V block holds them (``v_blocks``, see
    ``flash_attention_fwd_values``); blocks are grouped into PSUM tiles of one bank each.
    Returns ``((first block, pt_psum (128, blocks, qn)), ...)``."""
    qn = p_sb.shape[0]
    pmax = nl.tile_size.pmax
    p_bytes = FP32_BYTES if p_sb.dtype == nl.float32 else HALF_BYTES
    per_bank = max(1, nl.tile_size.psum_fmax * FP32_BYTES // (pmax * p_bytes))
    pt_tiles = []
    for j0 in range(0, len(v_blocks), per_bank):
        nb = min(per_bank, len(v_blocks) - j0)
        pt_psum = nl.ndarray((pmax, nb, qn), dtype=p_sb.dtype, buffer=nl.psum)
        for j in range(j0, j0 + nb):
            c0, c1, step = v_blocks[j][1]
            nisa.nc_transpose(dst=pt_psum[0:v_blocks[j][0].shape[0], j - j0, :],
                              data=p_sb[:, c0:c1:step], engine=nisa.engine.tensor)
        pt_tiles.append((j0, pt_psum))
    return pt_tiles


def natural_suffix(p_dtype, v_blocks, width):
    """First block of the section's trailing run of whole natural V blocks whose P columns end at
    ``width`` (P's columns for them are then contiguous and in key order, so one SBUF -> SBUF DMA
    transpose gives their P^T); ``len(v_blocks)`` when there is none or P is fp32."""
    pmax = nl.tile_size.pmax
    j = len(v_blocks)
    if p_dtype == nl.float32:
        return j
    end = width
    while j > 0:
        v_blk, (c0, c1, step) = v_blocks[j - 1]
        if step != 1 or v_blk.shape[0] != pmax or c1 != end or c1 - c0 != pmax:
            break
        end = c0
        j -= 1
    return j


def dma_transpose_p(p_sb, j0):
    """P^T (128, blocks, qn) in SBUF with its blocks ``j0..`` by one DMA transpose of P's columns
    ``[128 j0, width)`` (whole natural blocks, :func:`natural_suffix`): each partition moves one
    contiguous run of ``2 * (width - 128 j0)`` bytes (4 KiB for 2048 keys), no TensorE transpose
    and no PSUM eviction (docs/cost-model.md §2.6: 50 % of DMA throughput SBUF -> SBUF); blocks
    ``< j0`` are left to :func:`transpose_p` and :func:`evict_pt`."""
    qn, width = p_sb.shape
    pmax = nl.tile_size.pmax
    nb = width // pmax
    pt4_sb = nl.ndarray((pmax, 1, nb, qn), dtype=p_sb.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=pt4_sb[:, :, j0:nb, :],
                       src=p_sb.reshape((qn, 1, nb, pmax))[:, :, j0:nb, :])
    return pt4_sb[:, 0, :, :]


def evict_pt(pt_tiles, slen, dve_share, pt_sb=None):
    """P^T to SBUF (128, blocks, qn), one instruction per PSUM tile and engine: the first full
    blocks of the section on ScalarE, the last ``round(dve_share * blocks)`` on VectorE (the
    remainder block, only its rows, on ScalarE). ``slen``: P columns transposed on TensorE;
    ``pt_sb``: the tile to fill (its later blocks came by DMA, :func:`dma_transpose_p`)."""
    pmax = nl.tile_size.pmax
    n_blocks = len(key_blocks(slen))
    n_full = slen // pmax
    cut = n_full - min(n_full, int(dve_share * n_blocks + 0.5))   # first block on VectorE
    qn = pt_tiles[0][1].shape[2]
    if pt_sb is None:
        pt_sb = nl.ndarray((pmax, n_blocks, qn), dtype=pt_tiles[0][1].dtype, buffer=nl.sbuf)
    for j0, pt_psum in pt_tiles:
        full_end = min(n_full, j0 + pt_psum.shape[1])
        act_end = max(j0, min(cut, full_end))
        if act_end > j0:
            nisa.activation(dst=pt_sb[:, j0:act_end, :], op=nl.copy,
                            data=pt_psum[:, 0:act_end - j0, :])
        if full_end > act_end:
            nisa.tensor_copy(dst=pt_sb[:, act_end:full_end, :],
                             src=pt_psum[:, act_end - j0:full_end - j0, :],
                             engine=nisa.engine.vector)
        if full_end < j0 + pt_psum.shape[1]:
            bn = slen - n_full * pmax
            nisa.activation(dst=pt_sb[0:bn, n_full, :], op=nl.copy,
                            data=pt_psum[0:bn, n_full - j0, :])
    return pt_sb


def p_times_v(pt_sb, v_blocks):
    """O (qn, D) fp32 PSUM = P @ V, contracting the 128-key blocks of P^T with the section's V
    blocks (``v_blocks``) on TensorE."""
    qn = pt_sb.shape[2]
    o_psum = nl.ndarray((qn, v_blocks[0][0].shape[1]), dtype=nl.float32, buffer=nl.psum)
    for j, (v_blk, _) in enumerate(v_blocks):
        bn = v_blk.shape[0]
        nisa.nc_matmul(dst=o_psum, stationary=pt_sb[0:bn, j, :], moving=v_blk, accumulate=j > 0)
    return o_psum
