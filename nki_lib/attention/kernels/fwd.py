"""Flash-attention forward NKI kernel (online softmax) and its launcher ``flash_fwd``.

Algorithm (FlashAttention-2 forward, api-contract §3 semantics). For every query tile the kernel
streams the visible key tiles once and keeps, per query row, the running max ``m`` (stored
negated, ``neg_m``), the running denominator ``l`` and the unnormalised output ``acc`` in fp32::

    s      = scale * q @ k^T                 (softcap: s = softcap * tanh(s / softcap); then mask)
    m_new  = max(m, rowmax(s));   alpha = exp(m - m_new)
    p      = exp(s - m_new);      l = alpha * l + rowsum(p)
    acc    = alpha * acc + p @ v
    out    = acc / l;             lse = m + log(l)

Sinks join the denominator as a virtual key with no value: the state starts at
``m = max(sink, STAT_INIT)``, ``l = exp(sink - m)``, ``acc = 0``. Masked scores are
``MASK_FILL`` and the running max starts at the finite ``STAT_INIT``, so masked keys contribute
exactly 0 and a row that sees no key (and no sink) ends with ``l = 0``: ``out = 0`` and
``lse = -inf`` (set by a predicated copy), never NaN.

Loop structure (all loops unrolled at trace time)::

    for b, kv head hk:                                   (batch, K/V head)
      for query tile [q0, q0 + qn), qn <= 128:           (queries on partitions)
        bounds lo/hi (qn, 1) of the visible keys          (only if some tile needs a mask)
        for pass over the GQA group (heads_per_pass heads share each K/V load):
          load q^T tiles and init state of these heads
          for visible key tile [k0, k0 + kn), kn <= 512:  (fully masked tiles are skipped)
            load k^T chunks (D, kn) and V blocks (128, kn/128, D)   (fresh tiles: double buffers)
            for each query head h of the pass:
              S  (qn, kn) PSUM   = sum over D chunks of matmul(q^T (dc, qn), k^T (dc, kn))   [PE]
              scale/softcap + evict to SBUF fp32 + mask (partial tiles only) + row max        [DVE/ACT]
              neg_m, alpha (tiny), P = exp(S - m) with the row sum fused                      [DVE/ACT]
              P^T in 128-key blocks through TensorE transposes, evicted by ScalarE            [PE/ACT]
              O  (qn, D) PSUM    = sum over key blocks of matmul(P^T (bn, qn), V (bn, D))     [PE]
              acc = alpha * acc + O                                                           [DVE]
          finalize: out = acc * (1 / max(l, 1)), lse = log(max(l, 1)) - neg_m, empty rows -> -inf

Shapes (HBM, prepared by the launcher; transposes are layout glue): q_t (B, Hq, D, Sq),
k_t (B, Hkv, D, Sk), v (B, Hkv, Sk, D), sinks (Hq,) float32, doc (2, S) float32 with the first
and last position of each position's document (cu_seqlens). Outputs: out (B, Hq, Sq, D) in q's
dtype, lse (B, Hq, Sq) float32.
Dimension legend: B batch, Hq/Hkv query/kv heads, G = Hq / Hkv, Sq/Sk lengths, D head dim,
dc head-dim chunk (<= 128), qn query rows of a tile (<= 128), kn keys of a tile (<= 512),
bn keys of a block (<= 128).

Working set per partition (bf16, D = 128, one head per pass): q^T 256 B, K^T 1 KiB, V 1 KiB,
S fp32 2 KiB, P 1 KiB, P^T 1 KiB, acc 512 B (x2 for the double-buffered streamed tiles), about
13 KiB, independent of Sq and Sk. PSUM: S, P^T and O take one 2 KiB bank each (6 of 8 banks with
two generations live). See DESIGN.md for the budget at D = 64/128/256.

Limits: dtypes bf16/fp16/fp32 (bf16/fp16 P in the input dtype for P @ V; fp32 stays fp32);
D <= 256 (two head-dim chunks above 128); Sq, Sk < 2**24 (float32 key indices in the masks).
"""

from __future__ import annotations

import torch

from nki_lib._nki import nisa, nki, nl
from nki_lib.attention import masks
from nki_lib.attention.kernels.tiles import (MAX_INDEX, STAT_INIT, MaskSpec, head_dim_chunks,
                                             heads_per_pass, key_blocks, mask_scores, plan_row,
                                             query_tiles, row_bounds)
from nki_lib.dispatch import Unsupported, call_kernel

__all__ = ["flash_fwd", "flash_fwd_kernel", "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_SBUF_SHARE = 4   # per-head resident state may use 1/4 of SBUF; the rest streams K/V/S/P
_FP32_BYTES = 4
_HALF_BYTES = 2        # bfloat16 / float16


# --------------------------------------------------------------------------- kernel helpers

class _RowState(nl.NKIObject):
    """Online-softmax state of one query head over one query tile (all fp32 SBUF)."""
    neg_m: object   # (qn, 1) -running max
    l: object       # (qn, 1) running denominator  # noqa: E741
    acc: object     # (qn, D) unnormalised output


def _load_q(q_t, b, h, q0, qn, chunks):
    """q^T tiles (dc, qn) of head h, one per head-dim chunk."""
    q_tiles = []
    for c0, dc in chunks:
        q_sb = nl.ndarray((dc, qn), dtype=q_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_sb, src=q_t[b, h, c0:c0 + dc, q0:q0 + qn])
        q_tiles.append(q_sb)
    return q_tiles


def _load_kv(k_t, v, b, hk, k0, kn, chunks):
    """k^T tiles (dc, kn) per head-dim chunk and V as (128, blocks, D): v_sb[p, j] = key k0+128j+p."""
    _, hkv, _, sk = k_t.shape
    d = v.shape[3]
    pmax = nl.tile_size.pmax
    k_tiles = []
    for c0, dc in chunks:
        k_sb = nl.ndarray((dc, kn), dtype=k_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=k_sb, src=k_t[b, hk, c0:c0 + dc, k0:k0 + kn])
        k_tiles.append(k_sb)
    blocks = key_blocks(kn)
    v_sb = nl.ndarray((pmax, len(blocks), d), dtype=v.dtype, buffer=nl.sbuf)
    n_full = kn // pmax
    if n_full > 0:
        first = ((b * hkv + hk) * sk + k0) * d
        nisa.dma_copy(dst=v_sb[:, 0:n_full, :],
                      src=v.ap(pattern=[[d, pmax], [pmax * d, n_full], [1, d]], offset=first))
    if n_full < len(blocks):
        j0, bn = blocks[n_full]
        nisa.dma_copy(dst=v_sb[0:bn, n_full, :], src=v[b, hk, k0 + j0:k0 + j0 + bn, :])
    return k_tiles, v_sb


def _init_state(sinks, h, qn, d, has_sinks):
    neg_m = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    l_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if has_sinks:
        sink_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sink_sb, src=sinks.ap(pattern=[[0, qn], [1, 1]], offset=h))
        nisa.tensor_scalar(dst=neg_m, data=sink_sb, op0=nl.maximum, operand0=STAT_INIT,
                           op1=nl.multiply, operand1=-1.0)
        nisa.activation(dst=l_sb, op=nl.exp, data=sink_sb, bias=neg_m)
    else:
        nisa.memset(dst=neg_m, value=-STAT_INIT)
        nisa.memset(dst=l_sb, value=0.0)
    acc = nl.ndarray((qn, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    return _RowState(neg_m=neg_m, l=l_sb, acc=acc)


def _scores(q_tiles, k_tiles, qn, kn, scale, softcap, bounds, k0, masked):
    """Final scores (qn, kn) fp32 in SBUF (scaled, capped, masked) and their row max (qn, 1)."""
    s_psum = nl.ndarray((qn, kn), dtype=nl.float32, buffer=nl.psum)
    for c in range(len(q_tiles)):
        nisa.nc_matmul(dst=s_psum, stationary=q_tiles[c], moving=k_tiles[c], accumulate=c > 0)
    s_sb = nl.ndarray((qn, kn), dtype=nl.float32, buffer=nl.sbuf)
    rowmax = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if softcap > 0:
        nisa.activation(dst=s_sb, op=nl.tanh, data=s_psum, scale=scale / softcap)
        src, factor = s_sb, softcap
    else:
        src, factor = s_psum, scale
    if masked:
        if softcap > 0:
            nisa.tensor_scalar(dst=s_sb, data=src, op0=nl.multiply, operand0=factor)
        else:
            nisa.activation(dst=s_sb, op=nl.copy, data=src, scale=factor)
        mask_scores(s_sb, bounds[0], bounds[1], k0, rowmax)
    else:
        nisa.tensor_scalar_reduce(dst=s_sb, data=src, op0=nl.multiply, operand0=factor,
                                  reduce_op=nl.maximum, reduce_res=rowmax)
    return s_sb, rowmax


def _softmax_step(state, s_sb, rowmax, p_dtype):
    """Update neg_m and l with the tile; returns P = exp(s - m_new) (qn, kn) and alpha (qn, 1)."""
    qn, kn = s_sb.shape
    neg_m_new = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m_new, data=rowmax, op0=nl.multiply, operand0=-1.0,
                       op1=nl.minimum, operand1=state.neg_m)
    alpha = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=state.neg_m, scale=-1.0, bias=neg_m_new)
    p_sb = nl.ndarray((qn, kn), dtype=p_dtype, buffer=nl.sbuf)
    rowsum = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p_sb, op=nl.exp, data=s_sb, bias=neg_m_new, reduce_op=nl.add,
                    reduce_res=rowsum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.scalar_tensor_tensor(dst=state.l, data=state.l, op0=nl.multiply, operand0=alpha,
                              op1=nl.add, operand1=rowsum)
    state.neg_m = neg_m_new
    return p_sb, alpha


def _p_times_v(p_sb, v_sb):
    """O (qn, D) fp32 PSUM = P @ V, contracting 128-key blocks of P^T (TensorE transposes)."""
    qn, kn = p_sb.shape
    pmax = nl.tile_size.pmax
    blocks = key_blocks(kn)
    n_full = kn // pmax
    pt_psum = nl.ndarray((pmax, len(blocks), qn), dtype=p_sb.dtype, buffer=nl.psum)
    for j, (j0, bn) in enumerate(blocks):
        nisa.nc_transpose(dst=pt_psum[0:bn, j, :], data=p_sb[:, j0:j0 + bn], engine=nisa.engine.tensor)
    pt_sb = nl.ndarray((pmax, len(blocks), qn), dtype=p_sb.dtype, buffer=nl.sbuf)
    if n_full > 0:
        nisa.activation(dst=pt_sb[:, 0:n_full, :], op=nl.copy, data=pt_psum[:, 0:n_full, :])
    if n_full < len(blocks):
        bn = blocks[n_full][1]
        nisa.activation(dst=pt_sb[0:bn, n_full, :], op=nl.copy, data=pt_psum[0:bn, n_full, :])
    o_psum = nl.ndarray((qn, v_sb.shape[2]), dtype=nl.float32, buffer=nl.psum)
    for j, (_, bn) in enumerate(blocks):
        nisa.nc_matmul(dst=o_psum, stationary=pt_sb[0:bn, j, :], moving=v_sb[0:bn, j, :],
                       accumulate=j > 0)
    return o_psum


def _finalize(state, out, lse, b, h, q0):
    """out = acc / l and lse = m + log(l) of one head's query tile; rows with l = 0 get
    out = 0 (acc is 0 there) and lse = -inf."""
    qn, d = state.acc.shape
    l_safe = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=state.l, op0=nl.maximum, operand0=1.0)
    recip = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=recip, data=l_safe)
    out_sb = nl.ndarray((qn, d), dtype=out.dtype, buffer=nl.sbuf)
    nisa.activation(dst=out_sb, op=nl.copy, data=state.acc, scale=recip)
    nisa.dma_copy(dst=out[b, h, q0:q0 + qn, :], src=out_sb)
    lse_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_sb, op=nl.log, data=l_safe)
    nisa.tensor_tensor(dst=lse_sb, data1=lse_sb, data2=state.neg_m, op=nl.subtract)
    empty = nl.ndarray((qn, 1), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty, data=state.l, op0=nl.equal, operand0=0.0)
    neg_inf = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=neg_inf, value=float("-inf"))
    nisa.tensor_copy_predicated(dst=lse_sb, src=neg_inf, predicate=empty)
    nisa.dma_copy(dst=lse[b, h, q0:q0 + qn], src=lse_sb)


# --------------------------------------------------------------------------- kernel

@nki.jit
def flash_fwd_kernel(q_t, k_t, v, sinks, doc, has_sinks, has_docs, causal, scale, window_left,
                     window_right, softcap):
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32); see the module docstring."""
    n_batch, n_q_heads, d, sq = q_t.shape
    n_kv_heads, sk = k_t.shape[1], k_t.shape[3]
    group = n_q_heads // n_kv_heads
    out = nl.ndarray((n_batch, n_q_heads, sq, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((n_batch, n_q_heads, sq), dtype=nl.float32, buffer=nl.shared_hbm)

    mask = MaskSpec(sq=sq, sk=sk, causal=causal, window_left=window_left,
                    window_right=window_right, has_docs=has_docs)
    chunks = head_dim_chunks(d)
    pmax = nl.tile_size.pmax
    q_bytes = _FP32_BYTES if q_t.dtype == nl.float32 else _HALF_BYTES
    state_bytes = len(chunks) * pmax * q_bytes + (d + 2) * _FP32_BYTES
    n_pass = heads_per_pass(group, state_bytes,
                            nl.tile_size.total_available_sbuf_size // STATE_SBUF_SHARE)
    doc_lo = doc[0] if has_docs else None
    doc_hi = doc[1] if has_docs else None

    for b in nl.affine_range(n_batch):
        for hk in nl.affine_range(n_kv_heads):
            for q0, qn in query_tiles(sq):
                plan = plan_row(mask, q0, qn)
                bounds = None
                if any(masked for _, _, masked in plan):
                    bounds = row_bounds(mask, q0, qn, doc_lo, doc_hi)
                for g0 in range(0, group, n_pass):
                    heads = tuple(hk * group + g for g in range(g0, min(group, g0 + n_pass)))
                    q_tiles = [_load_q(q_t, b, h, q0, qn, chunks) for h in heads]
                    states = [_init_state(sinks, h, qn, d, has_sinks) for h in heads]
                    for t in nl.sequential_range(len(plan)):
                        k0, kn, masked = plan[t]
                        k_tiles, v_sb = _load_kv(k_t, v, b, hk, k0, kn, chunks)
                        for i in range(len(heads)):
                            s_sb, rowmax = _scores(q_tiles[i], k_tiles, qn, kn, scale, softcap,
                                                   bounds, k0, masked)
                            p_sb, alpha = _softmax_step(states[i], s_sb, rowmax, v.dtype)
                            o_psum = _p_times_v(p_sb, v_sb)
                            acc = states[i].acc
                            nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply,
                                                      operand0=alpha, op1=nl.add, operand1=o_psum)
                    for i in range(len(heads)):
                        _finalize(states[i], out, lse, b, heads[i], q0)
    return out, lse


# --------------------------------------------------------------------------- launcher

def _document_bounds(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(2, S) float32: first and last position of the document of every position."""
    cu = cu_seqlens.to(torch.int64)
    seg = masks.segment_ids(cu, length)
    return torch.stack([cu[seg], cu[seg + 1] - 1]).to(torch.float32).contiguous()


def flash_fwd(q, k, v, sinks, cu_seqlens, *, causal, scale, window_left, window_right, softcap):
    """Launch :func:`flash_fwd_kernel` for ``nki::flash_attention`` (arguments already validated,
    ``scale`` resolved). Returns ``(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32)``."""
    if q.dtype not in KERNEL_DTYPES:
        raise Unsupported(f"dtype {q.dtype} (the kernel handles bfloat16, float16, float32)")
    sq, sk = q.shape[2], k.shape[2]
    if sq + sk >= MAX_INDEX:
        raise Unsupported(f"Sq + Sk = {sq + sk} >= 2**24 (key indices are float32 in the kernel)")
    q_t = q.transpose(2, 3).contiguous()
    k_t = k.transpose(2, 3).contiguous()
    sinks_c = None if sinks is None else sinks.contiguous()
    doc = None if cu_seqlens is None else _document_bounds(cu_seqlens, sq)
    return call_kernel(flash_fwd_kernel, q_t, k_t, v.contiguous(), sinks_c, doc,
                       sinks is not None, cu_seqlens is not None, bool(causal), float(scale),
                       int(window_left), int(window_right), float(softcap))
