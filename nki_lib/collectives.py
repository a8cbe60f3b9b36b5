"""The torch.distributed pieces expert and context parallelism share (no transport of our own).

* :func:`as_group` — a ``ProcessGroup`` from a group, ``None`` (default group) or 1-D ``DeviceMesh``.
* :func:`group_info` — ``(size, rank)`` of a process group (``None``: the default group).
* :func:`all_to_all` — equal-split ``all_to_all_single`` along dim 0, differentiable: its
  backward is the same exchange of the gradients in the opposite direction.
* :class:`RingTransfer` — one posted ring step (send to rank + 1, receive from rank - 1) through
  ``batch_isend_irecv``; ``wait()`` returns the received tensor. Posting before a block's compute
  and waiting after it is what overlaps the transfer with the compute.

Peers are group ranks; they are translated to global ranks for ``P2POp``. Inside
``count_traffic()`` every call adds the bytes this rank sends to other ranks (an all-to-all's own
slice stays local) to the yielded counter, by kind (``"all_to_all"``, ``"ring"``): what the
scale-out bench's formulas are checked against.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist

_traffic: list[Counter] = []


@contextlib.contextmanager
def count_traffic() -> Iterator[Counter]:
    """Count the bytes this rank sends inside the block (by kind)."""
    counter: Counter = Counter()
    _traffic.append(counter)
    try:
        yield counter
    finally:
        _traffic.remove(counter)


def _count(kind: str, nbytes: int) -> None:
    for counter in _traffic:
        counter[kind] += nbytes


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    size, _ = group_info(group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    _count("all_to_all", x.numel() * x.element_size() * (size - 1) // size)
    return out


def as_group(group):
    """The process group of ``group``: a ``ProcessGroup``, ``None`` (the default group) or a 1-D
    ``DeviceMesh`` (its only dimension's group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: pass a 1-D DeviceMesh (e.g. mesh['ep']), got one with {group.ndim} dims")
        return group.get_group()
    return group


def group_info(group) -> tuple[int, int]:
    """``(size, rank)`` of ``group`` in this process; a clear error outside a process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("this needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh or None, "
                        f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return dist.get_world_size(group), rank


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Rank r's rows ``[d * n / P, (d + 1) * n / P)`` go to rank d, which stores them at rows
    ``[r * n / P, ...)``; differentiable in ``x``. ``x.shape[0]`` must be a multiple of P."""
    size, _ = group_info(group)
    if x.shape[0] % size:
        raise ValueError(f"all_to_all needs dim 0 ({x.shape[0]}) to be a multiple of the group size {size}")
    return _AllToAll.apply(x, group) if x.requires_grad else _exchange(x, group)


class RingTransfer:
    """``tensor`` posted to the next rank of the ring while the previous rank's arrives."""

    def __init__(self, tensor: torch.Tensor, group, *, tag: int):
        size, rank = group_info(group)
        self._recv = torch.empty_like(tensor)
        send = tensor.contiguous()
        ops = [dist.P2POp(dist.isend, send, _global_rank(group, (rank + 1) % size), group, tag),
               dist.P2POp(dist.irecv, self._recv, _global_rank(group, (rank - 1) % size), group, tag)]
        self._keep = send  # the send buffer must outlive the transfer
        _count("ring", send.numel() * send.element_size())
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._keep = [], None
        return self._recv
