"""Router losses of the MoE module: load balancing (two scales) and the router z-loss.

Shapes: T tokens (all leading dims flattened), E experts, k = top_k.

``load_balancing_loss(logits, topk_ids, num_experts, *, convention, token_mask)`` computes
``E * sum_e f_e * P_e`` with ``P_e`` the (masked) mean over tokens of softmax(logits)_e and
``f_e`` the routed share of expert e, which the two conventions scale differently:

* ``"switch"`` (default; Switch Transformer eq. 4-6 with top-k): ``f_e`` = assignments to e over
  all T * k assignments (sum_e f_e = 1), so perfectly uniform routing gives exactly 1;
* ``"hf"``: transformers' ``load_balancing_loss_func``: ``f_e`` = assignments to e over the T
  tokens (sum_e f_e = k), i.e. k times ``"switch"`` (uniform routing gives k). Several layers are
  one call on their concatenated logits and ids (transformers pools the layers the same way).

``token_mask`` (T,) or the leading shape of the logits (transformers' ``attention_mask``: 1 =
real token) weights every token's assignments and probabilities; None counts every token.
Only ``P_e`` carries gradient (``f_e`` comes from the integer ids).
"""

from __future__ import annotations

import torch

CONVENTIONS = ("switch", "hf")


def check_positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_logits(logits, num_experts=None):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., E), got {tuple(logits.shape)}")
    if num_experts is not None and logits.shape[-1] != num_experts:
        raise ValueError(f"logits must have last dim num_experts={num_experts}, got {tuple(logits.shape)}")


def loss_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _token_weights(token_mask, leading_shape, dtype, device):
    """(T,) per-token weights from ``token_mask`` (None: all ones)."""
    n_tokens = 1
    for size in leading_shape:
        n_tokens *= size
    if token_mask is None:
        return torch.ones(n_tokens, dtype=dtype, device=device)
    if not isinstance(token_mask, torch.Tensor):
        raise TypeError(f"token_mask must be a torch.Tensor or None, got {type(token_mask).__name__}")
    if token_mask.numel() != n_tokens or (token_mask.dim() > 1 and tuple(token_mask.shape) != tuple(leading_shape)):
        raise ValueError(f"token_mask must have {n_tokens} entries (shape (T,) or {tuple(leading_shape)}), "
                         f"got shape {tuple(token_mask.shape)}")
    return token_mask.reshape(-1).to(device=device, dtype=dtype)


def load_balancing_loss(logits: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *,
                        convention: str = "switch", token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Auxiliary load-balancing loss ``E * sum_e f_e * P_e`` (see the module docstring for the
    two conventions). ``logits`` (..., E), ``topk_ids`` (..., k) int32/int64."""
    check_positive_int("num_experts", num_experts)
    check_logits(logits, num_experts)
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("topk_ids must be an int32/int64 torch.Tensor")
    if topk_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"topk_ids must have the leading shape of logits {tuple(logits.shape[:-1])}, "
                         f"got {tuple(topk_ids.shape)}")
    dtype = loss_dtype(logits)
    probs = torch.softmax(logits.reshape(-1, num_experts).to(dtype), dim=-1)
    weights = _token_weights(token_mask, logits.shape[:-1], dtype, logits.device)
    if probs.shape[0] == 0:
        return probs.sum()
    top_k = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=dtype, device=probs.device)
    counts.scatter_add_(0, ids, weights.repeat_interleave(top_k))
    rows = weights.sum()
    fraction = counts / (rows * top_k if convention == "switch" else rows)
    mean_probs = (probs * weights[:, None]).sum(dim=0) / rows
    return num_experts * (fraction * mean_probs).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean over tokens of logsumexp(logits)^2``; ``logits`` (..., E)."""
    check_logits(logits)
    lse = torch.logsumexp(logits.to(loss_dtype(logits)), dim=-1)
    return lse.square().mean() if lse.numel() else lse.sum()
