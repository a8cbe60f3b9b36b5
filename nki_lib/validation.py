"""Argument checks shared by every op: errors name the argument and what was expected
(docs/contract.md §5). They read only metadata, so they are safe inside fake (meta) kernels, and they
accept symbolic ints (``torch.SymInt``), which is what int arguments become under
``torch.compile(dynamic=True)``. The data checks of real tensors (and host-side launch choices that
read index data) run on host copies made by :func:`on_host`."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch

# Set by the whole-op estimate while it records (nki_lib.bench.whole_op.record_host_ops): called
# with the tensors :func:`on_host` copies, to charge them; None otherwise.
HOST_COPY_HOOK: ContextVar = ContextVar("host_copy_hook", default=None)
ON_HOST: ContextVar = ContextVar("on_host", default=False)    # inside on_host: torch ops run on the host

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, rank: int, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        bound = (f"[{low}, {high}]" if low is not None and high is not None
                 else f">= {low}" if low is not None else f"<= {high}")
        raise ValueError(f"{name} must be in {bound}, got {value}")


def check_same_dtype(name: str, t, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` must have the dtype of the reference argument ``ref_name``."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def check_same_device(ref_name: str, ref: torch.Tensor, **tensors) -> None:
    """Every given (non-None) tensor must be on the device of ``ref_name``."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


INDEX_DTYPES = (torch.int32, torch.int64)


def layout_hint(q: torch.Tensor, k: torch.Tensor) -> str:
    """A hint for errors of the (B, H, S, D) layout rule: if reading q and k as (B, S, H, D)
    (``transpose(1, 2)`` forgotten) would give a consistent head count, say so."""
    if q.dim() != 4 or k.dim() != 4:
        return ""
    heads_q, heads_k = q.shape[2], k.shape[2]
    if heads_k >= 1 and heads_q % heads_k == 0:
        return (f"; q {tuple(q.shape)} and k {tuple(k.shape)} read as (B, S, H, D) would be "
                f"consistent: nki-lib takes (B, H, S, D), transpose(1, 2) first")
    return ""


def has_values(*tensors) -> bool:
    """False while any tensor is a tracing stand-in (a fake or functional tensor: the op body being
    traced into a graph for ``torch.compile(backend="neuron")``): its data cannot be read there, so
    the data checks run on the eager calls only."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(t is not None and is_fake(t) for t in tensors)


@contextlib.contextmanager
def on_host(*tensors: torch.Tensor | None) -> Iterator[tuple]:
    """Host copies (``.to("cpu")``) of ``tensors`` (None stays None) for data checks and launch
    choices run on the host CPU. The whole-op estimate charges each tensor copied as one transfer
    (one launch plus its nbytes read from HBM) and the torch ops run inside the block (on the
    copies, on the host) not at all (:data:`HOST_COPY_HOOK`, :data:`ON_HOST`; docs/cost-model.md
    §7.10)."""
    token = ON_HOST.set(True)
    try:
        copies = tuple(None if t is None else t.to("cpu") for t in tensors)
        hook = HOST_COPY_HOOK.get()
        if hook is not None:
            hook([t for t in tensors if t is not None])
        yield copies
    finally:
        ON_HOST.reset(token)
