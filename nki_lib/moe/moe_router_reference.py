"""PyTorch reference of the MoE router (docs/contract.md §4.1), plain and clear.

Same argument names as the ops. What CPU/CUDA users run by default (the ``reference`` path) and
the formulas the NKI kernels are judged against.

Shapes: T tokens, H hidden, E experts, k = top_k, G = num_groups.

* ``moe_router``: logits in float32 (float64 stays float64), scores softmax/sigmoid, selection key
  ``scores + expert_bias``, DeepSeek-V3 group limit, top-k with ties to the lower id (stable sort),
  ``topk_weights`` = scores at the ids (renormalized when asked).
* ``moe_router_backward``: gradients of ``(logits, topk_weights)`` to ``(x, weight)``.
* ``naive``: the router in the inputs' dtype, differentiable by autograd (fp64 oracle / baseline).
"""

from __future__ import annotations

import torch

SCORE_FUNCS = ("softmax", "sigmoid")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def scores_from_logits(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router scores (T, E) from logits (T, E), in the logits' dtype."""
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


def select_experts(scores: torch.Tensor, expert_bias: torch.Tensor | None, *, top_k: int,
                   num_groups: int, topk_groups: int) -> torch.Tensor:
    """Ids (T, k) int64 of the k largest keys ``scores + expert_bias``, descending, ties to the
    lower id; with ``num_groups > 1`` only the ``topk_groups`` groups with the largest sum of their
    two largest keys stay eligible (ties to the lower group). No gradient flows through ids."""
    key = scores.detach()
    if expert_bias is not None:
        key = key + expert_bias.to(key.dtype)
    t, e = key.shape
    if num_groups > 1:
        group_size = e // num_groups
        grouped = key.reshape(t, num_groups, group_size)
        best_two = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_score = best_two.sum(dim=-1)                                   # (T, G)
        kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        group_mask = torch.zeros(t, num_groups, dtype=torch.bool, device=key.device)
        group_mask.scatter_(1, kept, True)
        eligible = group_mask.repeat_interleave(group_size, dim=1)          # (T, E)
        key = key.masked_fill(~eligible, -torch.inf)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]


def _topk_weights(scores, ids, renormalize):
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def moe_router(x, weight, expert_bias=None, *, top_k, score_func="softmax", renormalize=True,
               num_groups=1, topk_groups=1):
    """Returns ``(logits (T, E) float32, topk_weights (T, k) float32, topk_ids (T, k) int32)``
    (float64 logits/weights for float64 inputs)."""
    cdt = _compute_dtype(x.dtype)
    logits = x.to(cdt) @ weight.to(cdt).T
    scores = scores_from_logits(logits, score_func)
    ids = select_experts(scores, expert_bias, top_k=top_k, num_groups=num_groups,
                         topk_groups=topk_groups)
    weights = _topk_weights(scores, ids, renormalize)
    return logits, weights, ids.to(torch.int32)


def moe_router_backward(dlogits, dtopk_weights, x, weight, logits, topk_ids, *, score_func="softmax",
                        renormalize=True):
    """Gradients ``(dx (T, H) x.dtype, dweight (E, H) weight.dtype)``.

    ``d_scores = scatter(topk grad through renormalization)``; ``dlogits_total = dlogits +
    J_score^T d_scores``; ``dx = dlogits_total @ weight``, ``dweight = dlogits_total^T @ x``."""
    cdt = _compute_dtype(x.dtype)
    logits = logits.to(cdt)
    scores = scores_from_logits(logits, score_func)
    ids = topk_ids.long()
    g = dtopk_weights.to(cdt)
    if renormalize:
        selected = scores.gather(1, ids)
        total = selected.sum(dim=-1, keepdim=True)
        g = (g - (g * selected).sum(dim=-1, keepdim=True) / total) / total
    d_scores = torch.zeros_like(scores).scatter_add_(1, ids, g)
    if score_func == "softmax":
        d_logits = scores * (d_scores - (d_scores * scores).sum(dim=-1, keepdim=True))
    else:
        d_logits = d_scores * scores * (1.0 - scores)
    d_total = d_logits + dlogits.to(cdt)
    dx = d_total @ weight.to(cdt)
    dweight = d_total.T @ x.to(cdt)
    return dx.to(x.dtype), dweight.to(weight.dtype)


def naive(x, weight, expert_bias=None, *, top_k, score_func="softmax", renormalize=True,
          num_groups=1, topk_groups=1):
    """The router in the inputs' dtype (logits rounded to it), autograd-differentiable: the fp64
    oracle and the low-precision baseline. Outputs in the op's dtypes."""
    out_dtype = _compute_dtype(x.dtype)
    logits = (x @ weight.T).to(out_dtype)
    scores = scores_from_logits(logits, score_func)
    ids = select_experts(scores, expert_bias, top_k=top_k, num_groups=num_groups,
                         topk_groups=topk_groups)
    return logits, _topk_weights(scores, ids, renormalize), ids.to(torch.int32)
