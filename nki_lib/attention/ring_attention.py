"""Context-parallel (ring) attention on torch.distributed: ``ring_attention``.

Each of the P ranks of ``group`` holds L tokens of one sequence (placement: ``ring_attention_plan``);
q (B, Hq, L, D), k/v (B, Hkv, L, D) are that rank's shards. The result on every rank is its rows
of ``flash_attention`` over the full sequence (S = P L, self-attention) with the same flags.

Forward (P steps). At step t the rank holds the K/V block of rank ``r - t``; it first posts that
block to rank r + 1 (``RingTransfer``, one tensor holding K and V), then runs ``flash_attention``
(``return_lse=True``) on every visible (query segment, key segment) sub-rectangle with the mask
of its global positions (``ring_attention_plan.plan_block``), and merges the partial ``(out, lse)`` exactly:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)`` (float32
accumulators). Sinks join once, after the last block: ``lse' = logaddexp(lse, sink)``,
``out *= e^(lse - lse')``.

Backward (P steps, no backward kernel of its own). With the final ``out`` O and ``lse`` L (sinks
included), ``flash_attention``'s backward op on a block with ``out=O, lse=L, dlse=dL`` returns that
block's exact share of dq, dk, dv (P = exp(S - L) is the global probability, and
``delta = rowsum(dO O) - dL`` carries the gradient through lse). dq accumulates locally; each
block's dk/dv (float32) travel with it round the ring: the K/V for the next step is posted before
the block's compute, the dk/dv partial sums after it and awaited one step later, so both
transfers overlap compute; after P steps every rank holds its own block's dk/dv. ``dsinks`` is
``-sum(e^(sink - L) delta)`` over this rank's rows: the rank-local share, summed over the group by
the usual gradient all-reduce of a replicated parameter.

Communication per rank and step: one K/V block forward (2 B Hkv L D elements); backward one K/V
block and one float32 dk/dv block. Not compiled (eager collectives); float64 runs on the
reference path like ``flash_attention``.
"""

from __future__ import annotations

import math

import torch

from nki_lib.attention import flash_attention_op as flash_ops
from nki_lib.attention import flash_attention_reference as reference
from nki_lib.attention.ring_attention_plan import SPLITS, plan_block, segments
from nki_lib.collectives import RingTransfer, as_group, group_info

_TAG_KV, _TAG_DKV = 71, 72


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                   causal: bool = False, scale: float | None = None,
                   window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   sinks: torch.Tensor | None = None, split: str = "contiguous",
                   return_lse: bool = False):
    """Attention of this rank's queries over the whole sequence held by ``group`` (see module doc).

    q (B, Hq, L, D), k/v (B, Hkv, L, D): this rank's shard (same shapes on every rank); ``split``
    ``"contiguous"`` or ``"zigzag"`` (L even). ``group``: a ProcessGroup, a 1-D DeviceMesh or
    None (the default process group).
    Returns ``out`` (B, Hq, L, D), or ``(out, lse)`` with ``lse`` float32 (B, Hq, L).
    """
    group = as_group(group)
    size, rank = group_info(group)
    _validate(q, k, v, sinks, causal=causal, scale=scale, window=window, softcap=softcap, split=split)
    config = _Config(group, size, rank, segments(split, size, rank, q.shape[2]), causal,
                     reference.resolve_scale(scale, q.shape[-1]), (window[0], window[1]), float(softcap))
    out, lse = _RingAttention.apply(q, k, v, sinks, config)
    return (out, lse) if return_lse else out


def _validate(q, k, v, sinks, *, causal, scale, window, softcap, split):
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        raise TypeError(f"window must hold two ints (-1 for unbounded), got {window!r}")
    flash_ops.validate(q, k, v, sinks, cu_seqlens=None, cu_seqlens_k=None, attn_mask=None,
                       causal=causal, scale=scale, window_left=window[0], window_right=window[1],
                       softcap=softcap)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention is self-attention: k must hold the {q.shape[2]} positions of q, "
                         f"got {k.shape[2]}")
    if split == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"split='zigzag' needs an even local sequence length, got {q.shape[2]}")


class _Config:
    """What forward and backward share (not a tensor, so autograd passes it through)."""

    def __init__(self, group, size, rank, segs, causal, scale, window, softcap):
        self.group, self.size, self.rank, self.segs = group, size, rank, segs
        self.causal, self.scale, self.window, self.softcap = causal, scale, window, softcap

    def blocks(self, step: int):
        """``(q segment, k segment, Block)`` of every visible pair at ring ``step``."""
        src = (self.rank - step) % self.size
        k_segs = segments_like(self.segs, self.size, src)
        for q_seg in self.segs:
            for k_seg in k_segs:
                block = plan_block(q_seg, k_seg, causal=self.causal, window=self.window)
                if block is not None:
                    yield q_seg, k_seg, block

    def flags(self, block) -> dict:
        return {"causal": False, "scale": self.scale, "window_left": block.window_left,
                "window_right": block.window_right, "softcap": self.softcap}


def segments_like(segs, size, src):
    """The segments of rank ``src`` under the split that produced ``segs``."""
    split = "contiguous" if len(segs) == 1 else "zigzag"
    return segments(split, size, src, sum(s.length for s in segs))


def _rows(t, seg, block):
    start = seg.local_start + block.rows.start
    return t[:, :, start:seg.local_start + block.rows.stop]


def _cols(t, seg, block):
    start = seg.local_start + block.cols.start
    return t[..., start:seg.local_start + block.cols.stop, :]


def _exp_diff(a, b):
    """exp(a - b), 0 where a = -inf (also when b = -inf: an empty row stays empty)."""
    return torch.where(a == -math.inf, torch.zeros_like(a), torch.exp(a - b))


def merge(out_acc, lse_acc, out_part, lse_part):
    """Exact merge of two partial softmax results over disjoint key sets (in place, float32)."""
    lse_new = torch.logaddexp(lse_acc, lse_part)
    out_acc.mul_(_exp_diff(lse_acc, lse_new)[..., None]).add_(
        out_part.to(out_acc.dtype) * _exp_diff(lse_part, lse_new)[..., None])
    lse_acc.copy_(lse_new)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, config):
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(config.size):
            pending = RingTransfer(kv, config.group, tag=_TAG_KV) if step + 1 < config.size else None
            for q_seg, k_seg, block in config.blocks(step):
                out_b, lse_b = torch.ops.nki.flash_attention(
                    _rows(q, q_seg, block), _cols(kv[0], k_seg, block), _cols(kv[1], k_seg, block),
                    **config.flags(block))
                merge(_rows(out, q_seg, block), _rows(lse, q_seg, block), out_b, lse_b)
            if pending is not None:
                kv = pending.wait()
        if sinks is not None:
            with_sink = torch.logaddexp(lse, sinks.to(acc)[None, :, None].expand_as(lse))
            out.mul_(_exp_diff(lse, with_sink)[..., None])
            lse = with_sink
        out = out.to(q.dtype)
        lse = lse.to(_acc_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.config = config
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        config = ctx.config
        acc = _acc_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = None
        for step in range(config.size):
            kv_pending = RingTransfer(kv, config.group, tag=_TAG_KV) if step + 1 < config.size else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            for q_seg, k_seg, block in config.blocks(step):
                dq_b, dk_b, dv_b, _ = torch.ops.nki.flash_attention_backward(
                    _rows(dout, q_seg, block), _rows(dlse, q_seg, block),
                    _rows(q, q_seg, block), _cols(kv[0], k_seg, block), _cols(kv[1], k_seg, block),
                    _rows(out, q_seg, block), _rows(lse, q_seg, block),
                    **config.flags(block))
                _rows(dq, q_seg, block).add_(dq_b)
                _cols(dkv[0], k_seg, block).add_(dk_b)
                _cols(dkv[1], k_seg, block).add_(dv_b)
            if dkv_pending is not None:
                dkv.add_(dkv_pending.wait())
            if config.size > 1:
                dkv_pending = RingTransfer(dkv, config.group, tag=_TAG_DKV)
            if kv_pending is not None:
                kv = kv_pending.wait()
        if dkv_pending is not None:
            dkv = dkv_pending.wait()
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            delta = (dout.to(acc) * out.to(acc)).sum(-1) - dlse.to(acc)
            p_sink = _exp_diff(sinks.to(acc)[None, :, None].expand_as(lse), lse.to(acc))
            dsinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None
