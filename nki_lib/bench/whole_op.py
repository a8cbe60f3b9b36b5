"""Whole-op estimates: the kernels of an op call plus every host-side torch op around them.

A launcher prepares its kernel's inputs in torch (transposes, re-laid-out and padded copies,
tables) and post-processes its outputs; on a device each of those ops reads and writes HBM and
costs a launch of its own. :func:`record_host_ops` captures them while an op runs: a
``TorchDispatchMode`` sees every aten op executed inside an ``nki::`` op (charged to the op its
kernels are recorded under, :func:`owner_op`; the op's own
implementation, forward and backward, including the launchers' argument preparation; an op
call served by the reference backend is not recorded) and in the autograd formula of an ``nki::``
op around its backward op (e.g. zeros for an unused output's gradient, a cast of a gradient to
its input's dtype; charged to the backward op), and keeps the ones that move data:

* a view or alias (the output shares storage with an input: ``view``, ``transpose``,
  ``reshape`` of a contiguous tensor, ``detach``, ...) moves nothing and is not an op on a device;
* an allocation without initialisation (``empty``, ``new_empty``, ...) moves nothing;
* every other op is charged ``bytes_read + bytes_written`` (the nbytes of its tensor inputs,
  none for factories such as ``new_zeros`` that only take a dtype from their input, only the
  indices and the rows selected for gathers such as ``index_select``, and of the tensors it
  writes) at the core's HBM bandwidth (``HardwareParams.dma_bandwidth()``, one core),
  plus one kernel launch (``kernel_launch_ns``) -- docs/cost-model.md §7.10;
* a data check on host copies (``nki_lib.validation.on_host``: a validator copies index tensors to
  the host and checks them there) is charged one transfer per tensor copied, one launch plus the tensor's
  nbytes read from HBM (the rule of a copy; the host-side write is not HBM traffic), and the
  ops it runs on the copies run on the host CPU and are not charged. A host round trip's latency
  beyond that one launch (the wait for the copy, the host's own time) is not modelled.

:func:`estimate_call` runs one op call on the simulator and returns both parts
(:class:`WholeOpEstimate`); the bench harness and ``dry_run`` use it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nki_lib.validation import HOST_COPY_HOOK, ON_HOST

__all__ = ["HostOp", "record_host_ops", "host_cost", "host_time_ns", "WholeOpEstimate", "estimate_call"]

_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_FACTORIES = frozenset({"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "zeros",
                        "ones", "full", "arange", "scalar_tensor", "rand_like", "randn_like"})
_GATHERS = frozenset({"index_select", "embedding", "gather", "take"})   # source first: read only where indexed
_NAMESPACE = "nki"
_AUTOGRAD_NODE = f"GeneratedBackwardFor_{_NAMESPACE}_"   # torch.library.register_autograd's node names
TO_HOST = "to_host"          # HostOp.name of a device-to-host copy (``nki_lib.validation.on_host``)


@dataclass(frozen=True)
class HostOp:
    """One host-side torch op of an op call that moves data on a device."""

    op: str              # the nki op it ran inside, e.g. "flash_attention_backward"
    name: str            # aten op, e.g. "aten.cat.default"
    bytes_read: int
    bytes_written: int

    @property
    def hbm_bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place / out= op writes (schema arguments marked as written)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += _tensors(value)
    return out


def account(func, args, kwargs, result, op: str) -> HostOp | None:
    """The HBM traffic of one aten op (None when it moves nothing)."""
    base = func.overloadpacket.__name__
    if base in _ALLOCATIONS:
        return None
    inputs = _tensors(args) + _tensors(kwargs)
    written = _written_args(func, args, kwargs)
    if written:
        ids = {id(t) for t in written}
        reads = [t for t in inputs if id(t) not in ids]
    else:
        sources = {_storage(t) for t in inputs}
        written = [t for t in _tensors(result) if _storage(t) not in sources]
        if not written:
            return None  # a view or alias of an input
        reads = inputs
    written_bytes = sum(_nbytes(t) for t in written)
    if base in _FACTORIES:
        read_bytes = 0
    elif base in _GATHERS:       # each element written reads one element of the source, plus the indices
        read_bytes = written_bytes + sum(_nbytes(t) for t in reads[1:])
    else:
        read_bytes = sum(_nbytes(t) for t in reads)
    return HostOp(op, str(func), read_bytes, written_bytes)


def owner_op(name: str) -> str:
    """The registered op (or backward op) an ``nki::`` custom op's host ops are charged to, the name
    its kernel launches are recorded under: itself, or for an op's internal variant (its spec's
    ``variants``, e.g. ``moe_experts_train``, the training forward of ``moe_experts``) that op."""
    from nki_lib import registry

    for spec in registry.all_specs():
        if name in spec.variants:
            return spec.name
    return name


def autograd_glue_op(node_name: str) -> str | None:
    """The op an aten op belongs to when it runs in the autograd formula of an ``nki::`` op (the
    autograd node ``GeneratedBackwardFor_nki_<op>_<overload>Backward``): the backward op of the
    op's owner (:func:`owner_op`; its registry ``backward_name``, else the owner), or None for
    any other node."""
    if not node_name.startswith(_AUTOGRAD_NODE) or not node_name.endswith("Backward"):
        return None
    from nki_lib import registry

    op = owner_op(node_name[len(_AUTOGRAD_NODE):-len("Backward")].rsplit("_", 1)[0])
    try:
        spec = registry.get(op)
    except ValueError:
        return op
    return spec.backward_name or op


def _current_glue_op() -> str | None:
    node = torch._C._current_autograd_node()
    return None if node is None else autograd_glue_op(node.name())


class _Recorder(TorchDispatchMode):
    """Records the data-moving aten ops executed inside ``nki::`` ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[HostOp] = []
        self.inside: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == _NAMESPACE:
            from nki_lib import backend

            if backend.requested_path(_tensors(args) + _tensors(kwargs)) == "reference":
                return func(*args, **kwargs)  # the reference path: no kernel, no device op
            # run the op's CPU implementation with this mode active, so its aten ops come here
            self.inside.append(owner_op(func.overloadpacket.__name__))
            try:
                with self:
                    return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
            finally:
                self.inside.pop()
        result = func(*args, **kwargs)
        if ON_HOST.get():
            return result    # on the host CPU (``nki_lib.validation.on_host``): no device op
        op = self.current_op()
        if op is not None:
            host = account(func, args, kwargs, result, op)
            if host is not None:
                self.ops.append(host)
        return result

    def current_op(self) -> str | None:
        """The op an aten op running now is charged to (None: outside every ``nki::`` op)."""
        return self.inside[-1] if self.inside else _current_glue_op()

    def charge_copies(self, tensors) -> None:
        """``nki_lib.validation.on_host``'s copies: one transfer each (``TO_HOST``, its nbytes
        read from HBM; the host-side write is not HBM traffic), to the op they run in."""
        op = self.current_op()
        if op is not None:
            self.ops.extend(HostOp(op, TO_HOST, _nbytes(t), 0) for t in tensors)


@contextlib.contextmanager
def record_host_ops() -> Iterator[list[HostOp]]:
    """Collect the :class:`HostOp` of every ``nki::`` op called inside the block."""
    recorder = _Recorder()
    token = HOST_COPY_HOOK.set(recorder.charge_copies)
    try:
        with recorder:
            yield recorder.ops
    finally:
        HOST_COPY_HOOK.reset(token)


def host_time_ns(launches: int, nbytes: float, hw) -> float:
    """Device time of ``launches`` host ops moving ``nbytes`` in all: one launch each plus the bytes
    at the core's HBM bandwidth."""
    return launches * hw.kernel_launch_ns + nbytes / hw.dma_bandwidth()


def host_cost(ops: list[HostOp], hw, scale: float = 1.0) -> dict:
    """Device cost of host ops on target table ``hw``: each op one launch plus its bytes at the
    core's HBM bandwidth. ``scale`` multiplies the bytes (the bench extrapolates simulated parts
    of a problem to the real shape; the launch count does not scale)."""
    nbytes = scale * sum(o.hbm_bytes for o in ops)
    launches = len(ops)
    time_ns = host_time_ns(launches, nbytes, hw)
    by_name: dict = {}
    for o in ops:
        by_name[o.name] = by_name.get(o.name, 0) + 1
    return {"launches": launches, "hbm_bytes": nbytes, "time_us": time_ns * 1e-3, "ops": by_name}


@dataclass
class WholeOpEstimate:
    """One op call on ``target``: its kernels (both estimates) beside its host-side ops."""

    target: str
    kernels: list = field(default_factory=list)      # (op name, Estimate) per kernel launch
    host_ops: list = field(default_factory=list)     # HostOp
    kernel_us: float = 0.0
    kernel_dependency_bound_us: float = 0.0
    host: dict = field(default_factory=dict)         # host_cost(...)
    runs: list = field(default_factory=list)         # (op name, RunReport) per kernel launch (re-estimable)

    @property
    def total_us(self) -> float:
        return self.kernel_us + self.host["time_us"]

    @property
    def total_dependency_bound_us(self) -> float:
        return self.kernel_dependency_bound_us + self.host["time_us"]


def estimate_call(call: Callable[[], Any], target: str = "trn2") -> WholeOpEstimate:
    """Run ``call`` (one or more ``torch.ops.nki`` calls, e.g. a forward and its backward) on the
    simulator in strict mode and estimate the whole op on ``target``."""
    import nki_lib
    from nki_lib.dispatch import collect_runs
    from nki_lib.simulator import get_target, set_target
    from nki_lib.simulator.profile import estimate, params

    previous = get_target()
    set_target(target)
    try:
        with nki_lib.use_backend("simulator"), nki_lib.strict(True), collect_runs() as runs, \
                record_host_ops() as host_ops:
            call()
    finally:
        set_target(previous)
    kernels = [(op, estimate(r, target)) for op, r in runs if r is not None]
    return WholeOpEstimate(target, kernels, list(host_ops), sum(e.time_us for _, e in kernels),
                           sum(e.dependency_bound_us for _, e in kernels), host_cost(host_ops, params(target)),
                           [(op, r) for op, r in runs if r is not None])
