"""Minimum-work formulas (:class:`~nki_lib.simulator.profile.OpCost`) for the library's ops.

Each function takes the op's argument shapes (and flags) and returns the useful FLOPs, the HBM
bytes that must move at least once, and the ScalarE/VectorE element work, following
``docs/cost-model.md`` §7.6 and the protocol in ``nki_lib.simulator.profile.roofline``.
``cost_of(op_name, sample)`` maps a registry ``Sample`` of an op to its cost. Op authors may
move a formula beside their op; keep the signature ``(<shapes>, *, <flags>) -> OpCost``.

Dimension legend: B batch, Hq query heads, Hkv kv heads, Sq/Sk query/key length, D head dim,
T tokens, H hidden, I expert intermediate, E experts, k top-k, NB blocks, bs block size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from nki_lib.simulator.profile import ElementWork, OpCost
from nki_lib.sizes import FP32_BYTES, ceil_div, dtype_bytes

__all__ = ["visible_pairs", "flash_attention_fwd", "flash_attention_bwd", "decode_attention", "moe_router",
           "moe_experts_fwd", "moe_experts_bwd", "moe_plan", "cost_of", "dtype_bytes", "pe_dtype"]

FP32 = FP32_BYTES
INT32 = 4


def pe_dtype(dtype) -> str:
    """The TensorE rate class of a matmul input dtype."""
    name = str(dtype).replace("torch.", "")
    return "float8" if name.startswith("float8") else name


def visible_pairs(sq: int, sk: int, *, causal: bool = False, window_left: int = -1, window_right: int = -1,
                  cu_seqlens: Sequence[int] | None = None) -> int:
    """Number of visible (query, key) pairs under the mask of docs/contract.md §3.1 (exact count)."""
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens]
        return sum(visible_pairs(b - a, b - a, causal=causal, window_left=window_left, window_right=window_right)
                   for a, b in zip(bounds[:-1], bounds[1:]))
    if sq <= 0 or sk <= 0:
        return 0
    i = np.arange(sq, dtype=np.int64) + (sk - sq)
    lo = np.zeros(sq, dtype=np.int64) if window_left < 0 else np.maximum(0, i - window_left)
    hi = np.full(sq, sk - 1, dtype=np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window_right >= 0:
        hi = np.minimum(hi, i + window_right)
    return int(np.maximum(0, hi - lo + 1).sum())


def _attention_work(scores: float) -> tuple[ElementWork, ...]:
    """Forward softmax work per visible score (docs/cost-model.md §7.6 N_exp and N_vec, c_v = 2).

    One exp (ScalarE; VectorE ``exponential`` on trn3), one row-max read of the fp32 scores in
    PSUM (VectorE only: ScalarE reduces only with add) and one PSUM eviction of P^T after its
    TensorE transpose (16-bit PSUM, either engine).
    """
    return (ElementWork(scores, ("scalar", "vector"), "exp"),
            ElementWork(scores, ("vector",), "psum_fp32"),
            ElementWork(scores, ("scalar", "vector"), "psum_16bit"))


def flash_attention_fwd(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, *, dtype="bfloat16",
                        causal: bool = False, window_left: int = -1, window_right: int = -1,
                        cu_seqlens: Sequence[int] | None = None) -> OpCost:
    """Forward: F = 4 * B * Hq * visible * D; bytes = Q, K, V read, O written, fp32 LSE written."""
    s = dtype_bytes(dtype)
    vis = visible_pairs(sq, sk, causal=causal, window_left=window_left, window_right=window_right,
                        cu_seqlens=cu_seqlens)
    scores = b * hq * vis
    flops = 4.0 * scores * d
    nbytes = s * (2 * b * hq * sq * d + 2 * b * hkv * sk * d) + FP32 * b * hq * sq
    return OpCost(flops, nbytes, pe_dtype(dtype), _attention_work(scores), label="flash_attention fwd")


def flash_attention_bwd(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, *, dtype="bfloat16",
                        causal: bool = False, window_left: int = -1, window_right: int = -1,
                        cu_seqlens: Sequence[int] | None = None) -> OpCost:
    """Backward (docs/cost-model.md §7.6): F = 2.5 x forward (recompute S, dV, dP, dQ, dK).

    Bytes: Q, K, V, O, dO read, dQ, dK, dV written, LSE and D = rowsum(dO * O) (fp32). Element
    work per visible score: the exp that recomputes P, dS = P * (dP - D) (the subtraction can be
    fused into ScalarE's PSUM eviction of dP, the product is a VectorE tensor_tensor) and the
    PSUM evictions of the transposes of P and dS.
    """
    s = dtype_bytes(dtype)
    vis = visible_pairs(sq, sk, causal=causal, window_left=window_left, window_right=window_right,
                        cu_seqlens=cu_seqlens)
    scores = b * hq * vis
    flops = 2.5 * 4.0 * scores * d
    nbytes = s * (4 * b * hq * sq * d + 4 * b * hkv * sk * d) + 2 * FP32 * b * hq * sq
    work = (ElementWork(scores, ("scalar", "vector"), "exp"),
            ElementWork(scores, ("scalar", "vector"), "psum_fp32"),
            ElementWork(scores, ("vector",), "sbuf_16bit"),
            ElementWork(2 * scores, ("scalar", "vector"), "psum_16bit"))
    return OpCost(flops, nbytes, pe_dtype(dtype), work, label="flash_attention bwd")


def decode_attention(b: int, hq: int, hkv: int, sq: int, seqlens: Sequence[int], d: int, *, dtype="bfloat16",
                     kv_dtype=None, window_left: int = -1, block_size: int | None = None) -> OpCost:
    """Decode (docs/cost-model.md §7.6): bytes ~ s_kv * 2 * Hkv * D * sum(L_b) (the cache) + q, out, lse.

    FLOPs and element work count the visible cached positions of each new query token. A paged
    cache (``block_size``) also reads the block-table entries of the blocks that hold those keys.
    """
    if len(seqlens) != b:
        raise ValueError(f"seqlens: expected {b} lengths, got {len(seqlens)}")
    s, s_kv = dtype_bytes(dtype), dtype_bytes(kv_dtype or dtype)
    vis = sum(visible_pairs(sq, int(length), causal=True, window_left=window_left) for length in seqlens)
    reads = [_read_keys(int(length), sq, window_left) for length in seqlens]
    read = sum(reads)
    scores = hq * vis
    flops = 4.0 * scores * d
    nbytes = s_kv * 2 * hkv * d * read + s * 2 * b * hq * sq * d + FP32 * b * hq * sq + INT32 * b
    if block_size is not None:
        nbytes += INT32 * sum(ceil_div(r, block_size) for r in reads)
    return OpCost(flops, nbytes, pe_dtype(dtype), _attention_work(scores), label="decode_attention")


def _read_keys(length: int, sq: int, window_left: int) -> int:
    """The cached keys some new token of a length-``length`` sequence can see."""
    return min(length, sq + window_left) if window_left >= 0 else length


def moe_router(t: int, h: int, e: int, k: int, *, dtype="bfloat16") -> OpCost:
    """Router: logits = x @ W^T (F = 2*T*H*E), softmax/sigmoid (one exp per logit), top-k.

    Top-k on VectorE: ``max8`` finds 8 maxima per pass over the E scores of a token.
    """
    s = dtype_bytes(dtype)
    flops = 2.0 * t * h * e
    nbytes = s * (t * h + e * h) + FP32 * t * e + (FP32 + INT32) * t * k
    work = (ElementWork(t * e, ("scalar", "vector"), "exp"),
            ElementWork(t * e * math.ceil(k / 8), ("vector",), "sbuf_fp32"))
    return OpCost(flops, nbytes, pe_dtype(dtype), work, label="moe_router")


def _expert_blocks(t: int, e: int, k: int, block_size: int) -> int:
    """Blocks executed with balanced routing: each expert gets T*k/E assignments, padded per block."""
    per_expert, extra = divmod(t * k, e)
    return sum(math.ceil((per_expert + (1 if i < extra else 0)) / block_size) for i in range(e))


def moe_experts_fwd(t: int, h: int, i: int, e: int, k: int, *, block_size: int = 128, dtype="bfloat16") -> OpCost:
    """Gated expert MLP (docs/cost-model.md §7.6): F_useful = 2 * 3 * T*k * H * I.

    ``executed_flops`` counts the padded blocks of a balanced routing. Bytes: every touched
    expert's three matrices once, plus a gather read and a scatter write of H per assignment,
    plus the routing weights. Element work per assignment: act(gate) on ScalarE (I elements),
    the gate*up product on VectorE (I) and the weighted accumulation of the down projection
    (H, either engine).
    """
    s = dtype_bytes(dtype)
    assignments = t * k
    flops = 6.0 * assignments * h * i
    executed = 6.0 * _expert_blocks(t, e, k, block_size) * block_size * h * i
    touched = min(e, assignments)
    nbytes = s * 3 * h * i * touched + s * 2 * assignments * h + FP32 * assignments
    work = (ElementWork(assignments * i, ("scalar",), "psum_fp32"),
            ElementWork(assignments * i, ("vector",), "psum_fp32"),
            ElementWork(assignments * h, ("scalar", "vector"), "psum_fp32"))
    return OpCost(flops, nbytes, pe_dtype(dtype), work, executed, label="moe_experts fwd")


def moe_experts_bwd(t: int, h: int, i: int, e: int, k: int, *, block_size: int = 128, dtype="bfloat16") -> OpCost:
    """Backward of the expert MLP: input and weight gradients of the three matmuls (2 x forward FLOPs).

    Bytes: the forward's plus the weight gradients written and dY read.
    """
    fwd = moe_experts_fwd(t, h, i, e, k, block_size=block_size, dtype=dtype)
    s = dtype_bytes(dtype)
    touched = min(e, t * k)
    nbytes = fwd.hbm_bytes + s * 3 * h * i * touched + s * t * h
    work = tuple(ElementWork(w.elems * 2, w.engines, w.kind) for w in fwd.work)
    return OpCost(2 * fwd.flops, nbytes, fwd.pe_dtype, work, 2 * fwd.executed_flops, label="moe_experts bwd")


def moe_plan(t: int, k: int, e: int, *, block_size: int) -> OpCost:
    """Routing metadata: integer work only (no matmul); one compare per (assignment, expert)."""
    nb = math.ceil(t * k / block_size) + e - 1
    nbytes = INT32 * (t * k + nb + nb * block_size + e)
    return OpCost(0.0, nbytes, "bfloat16", (ElementWork(t * k * e, ("vector",), "sbuf_fp32"),), label="moe_plan")


# ------------------------------------------------------------------ registry samples -> costs

def _flash_from_sample(sample) -> OpCost:
    q, k = sample.args[0], sample.args[1]
    cu = sample.args[4] if len(sample.args) > 4 else sample.kwargs.get("cu_seqlens")
    kw = sample.kwargs
    b, hq, sq, d = q.shape
    return flash_attention_fwd(b, hq, k.shape[1], sq, k.shape[2], d, dtype=q.dtype, causal=kw.get("causal", False),
                               window_left=kw.get("window_left", -1), window_right=kw.get("window_right", -1),
                               cu_seqlens=None if cu is None else cu.tolist())


def _decode_from_sample(sample) -> OpCost:
    q, k_cache, seqlens, block_table = sample.args[0], sample.args[1], sample.args[3], sample.args[4]
    b, hq, sq, d = q.shape
    return decode_attention(b, hq, k_cache.shape[1], sq, seqlens.tolist(), d, dtype=q.dtype, kv_dtype=k_cache.dtype,
                            window_left=sample.kwargs.get("window_left", -1),
                            block_size=None if block_table is None else k_cache.shape[2])


def _router_from_sample(sample) -> OpCost:
    x, w = sample.args[0], sample.args[1]
    return moe_router(x.shape[0], x.shape[1], w.shape[0], sample.kwargs["top_k"], dtype=x.dtype)


def _experts_from_sample(sample) -> OpCost:
    x, weights, block_expert, slots, w_gate_up, w_down = sample.args[:6]
    block_size = slots.shape[0] // block_expert.shape[0]
    inter = w_down.shape[1] if sample.kwargs.get("weight_layout") == "in_out" else w_down.shape[2]
    return moe_experts_fwd(x.shape[0], x.shape[1], inter, w_gate_up.shape[0], weights.shape[1],
                           block_size=block_size, dtype=x.dtype)


def _plan_from_sample(sample) -> OpCost:
    ids = sample.args[0]
    return moe_plan(ids.shape[0], ids.shape[1], sample.kwargs["num_experts"], block_size=sample.kwargs["block_size"])


_FROM_SAMPLE = {
    "moe_plan": _plan_from_sample,
    "flash_attention": _flash_from_sample,
    "decode_attention": _decode_from_sample,
    "moe_router": _router_from_sample,
    "moe_experts": _experts_from_sample,
}


def cost_of(op_name: str, sample) -> OpCost | None:
    """The forward cost of one registry ``Sample`` of ``op_name`` (None if no formula yet)."""
    fn = _FROM_SAMPLE.get(op_name)
    return None if fn is None else fn(sample)
