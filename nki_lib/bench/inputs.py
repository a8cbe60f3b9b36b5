"""Inputs for a benchmark call and the natural PyTorch baseline of each op.

``make_call(op, dims, dtype, requires_grad)`` returns ``(args, kwargs)`` for
``torch.ops.nki.<op>`` (signatures of docs/contract.md) built from a fixed seed. Routing for
``moe_experts`` is balanced (assignment ``a`` goes to expert ``a mod E``) so the executed work
matches ``flops.moe_experts_fwd``. A decode case with ``block_size`` takes paged caches with a
randomly permuted block table. ``baseline(op, args, kwargs)`` runs what a PyTorch user would
write instead: SDPA for attention, ``x @ W.T`` + softmax/sigmoid + ``topk`` for the router, and a
per-expert loop for the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nki_lib.attention.decode_attention_reference import dense_kv
from nki_lib.sizes import ceil_div

__all__ = ["make_call", "baseline", "SEED"]

SEED = 0


def _rand(gen, *shape, dtype, requires_grad=False, scale=1.0):
    t = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _plan(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """docs/contract.md §4.2 moe_plan, through the registered op (reference path: it is metadata)."""
    import nki_lib

    with nki_lib.use_backend("reference"):
        return torch.ops.nki.moe_plan(topk_ids, num_experts=num_experts, block_size=block_size)


def _decode_cache(gen, dims: dict, dtype: torch.dtype):
    """Contiguous (B, Hkv, C, D) caches, or, with ``block_size``, paged (NB, Hkv, block_size, D)
    caches whose blocks a sequence owns in a random order (a pool after many allocations). ``C``
    (default ``L``) is the capacity: a static cache's ``max_cache_len``, or a block table ``C /
    block_size`` columns wide whose columns past ``L`` are unused (0, as a serving engine leaves
    them). ``layout="NHD"``: token-major memory, (B, C, Hkv, D) or (NB, block_size, Hkv, D), passed as
    its ``transpose(1, 2)`` (the tensors of vLLM, flash-attn and Hugging Face's continuous batching)."""
    b, hkv, length, d = (dims[k] for k in ("B", "Hkv", "L", "D"))
    cap = dims.get("C", length)
    if cap < length:
        raise ValueError(f"dims: capacity C={cap} below the length L={length}")
    bs = dims.get("block_size")
    token_major = dims.get("layout", "HND") == "NHD"

    def cache(n, keys):
        if token_major:
            return _rand(gen, n, keys, hkv, d, dtype=dtype).transpose(1, 2)
        return _rand(gen, n, hkv, keys, d, dtype=dtype)

    if bs is None:
        return cache(b, cap), cache(b, cap), None
    per_seq = ceil_div(length, bs)
    k_cache, v_cache = cache(b * per_seq, bs), cache(b * per_seq, bs)
    block_table = torch.randperm(b * per_seq, generator=gen).to(torch.int32).reshape(b, per_seq)
    unused = ceil_div(cap, bs) - per_seq
    return k_cache, v_cache, torch.nn.functional.pad(block_table, (0, unused)) if unused else block_table


def make_call(op: str, dims: dict, dtype: torch.dtype, requires_grad: bool = False) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(SEED)
    rg = requires_grad
    if op == "flash_attention":
        b, hq, hkv, sq, sk, d = (dims[k] for k in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))
        q = _rand(gen, b, hq, sq, d, dtype=dtype, requires_grad=rg)
        k = _rand(gen, b, hkv, sk, d, dtype=dtype, requires_grad=rg)
        v = _rand(gen, b, hkv, sk, d, dtype=dtype, requires_grad=rg)
        sinks = _rand(gen, hq, dtype=torch.float32, requires_grad=rg) if dims.get("sinks") else None
        kwargs = {"causal": bool(dims.get("causal", False)), "window_left": int(dims.get("window_left", -1))}
        return (q, k, v, sinks, None), kwargs
    if op == "decode_attention":
        b, hq, hkv, sq, length, d = (dims[k] for k in ("B", "Hq", "Hkv", "Sq", "L", "D"))
        q = _rand(gen, b, hq, sq, d, dtype=dtype)
        k_cache, v_cache, block_table = _decode_cache(gen, dims, dtype)
        seqlens = torch.full((b,), length, dtype=torch.int32)
        sinks = _rand(gen, hq, dtype=torch.float32) if dims.get("sinks") else None
        return (q, k_cache, v_cache, seqlens, block_table, sinks), {}
    if op == "moe_router":
        t, h, e, k = (dims[x] for x in ("T", "H", "E", "k"))
        x = _rand(gen, t, h, dtype=dtype, requires_grad=rg)
        w = _rand(gen, e, h, dtype=dtype, requires_grad=rg, scale=h ** -0.5)
        kwargs = {"top_k": k, "score_func": dims.get("score_func", "softmax"),
                  "num_groups": dims.get("num_groups", 1), "topk_groups": dims.get("topk_groups", 1)}
        return (x, w, None), kwargs
    if op == "moe_experts":
        t, h, i, e, k, bs = (dims[x] for x in ("T", "H", "I", "E", "k", "block_size"))
        x = _rand(gen, t, h, dtype=dtype, requires_grad=rg)
        topk_ids = (torch.arange(t * k, dtype=torch.int32) % e).reshape(t, k)
        weights = torch.softmax(torch.randn(t, k, generator=gen), -1).requires_grad_(rg)
        block_expert, slots, _ = _plan(topk_ids, e, bs)
        w_gate_up = _rand(gen, e, 2 * i, h, dtype=dtype, requires_grad=rg, scale=h ** -0.5)
        w_down = _rand(gen, e, h, i, dtype=dtype, requires_grad=rg, scale=i ** -0.5)
        layout = dims.get("weight_layout", "out_in")
        if layout == "out_in":
            return (x, weights, block_expert, slots, w_gate_up, w_down), {"activation": "silu"}
        # the layout a deployment chooses once at load: the same weights stored transposed
        w_gate_up, w_down = (w.detach().transpose(1, 2).contiguous().requires_grad_(rg) for w in (w_gate_up, w_down))
        return (x, weights, block_expert, slots, w_gate_up, w_down), {"activation": "silu", "weight_layout": layout}
    raise ValueError(f"op: no benchmark inputs for {op!r}")


def _window_mask(sq: int, sk: int, causal: bool, window_left: int) -> torch.Tensor | None:
    if window_left < 0:
        return None
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    mask = j >= i - window_left
    if causal:
        mask &= j <= i
    return mask


def baseline(op: str, args: tuple, kwargs: dict):
    """The natural PyTorch implementation of ``op`` on the same inputs (sinks are not modelled)."""
    if op == "flash_attention":
        q, k, v = args[:3]
        causal, wl = kwargs["causal"], kwargs["window_left"]
        mask = _window_mask(q.shape[2], k.shape[2], causal, wl)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if op == "decode_attention":   # every sequence at the full length (the benchmark's caches)
        q, k_cache, v_cache, seqlens, block_table = args[:5]
        sq, length = q.shape[2], int(seqlens.max())
        k, v = (torch.stack(kv) for kv in zip(*(dense_kv(k_cache, v_cache, block_table, b, length)
                                                 for b in range(q.shape[0]))))
        i = torch.arange(sq)[:, None] + (length - sq)
        mask = torch.arange(length)[None, :] <= i
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if op == "moe_router":
        x, w = args[:2]
        logits = x.float() @ w.float().T
        scores = torch.softmax(logits, -1) if kwargs["score_func"] == "softmax" else torch.sigmoid(logits)
        weights, ids = torch.topk(scores, kwargs["top_k"], dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), ids
    if op == "moe_experts":
        x, weights, block_expert, slots, w_gate_up, w_down = args
        if kwargs.get("weight_layout", "out_in") == "in_out":   # x @ W with W (H, 2I) / (I, H) is x @ W^T.T
            w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
        t, k = weights.shape
        inter = w_gate_up.shape[1] // 2
        slots_2d = slots.reshape(block_expert.shape[0], -1)
        y = torch.zeros(t, x.shape[1], dtype=torch.float32)
        for expert in range(w_gate_up.shape[0]):  # the per-expert loop
            a = slots_2d[block_expert == expert].flatten()
            a = a[a >= 0].long()
            if a.numel() == 0:
                continue
            tok, j = a // k, a % k
            xe = x[tok]
            gate, up = xe @ w_gate_up[expert, :inter].T, xe @ w_gate_up[expert, inter:].T
            out = (F.silu(gate) * up) @ w_down[expert].T
            y = y.index_add(0, tok, weights[tok, j, None] * out.float())
        return y.to(x.dtype)
    raise ValueError(f"op: no baseline for {op!r}")
