"""``nki_kernel_call``: one NKI kernel launch as a graph node, the emulation's stand-in for
TorchNeuron's ``nki_kernel_wrapper`` higher-order operator (docs/neuron.md §1, §4).

A launch is ``nki_kernel_call(kernel_idx, grid, constants_idx, tensors)``: the kernel and the
non-tensor arguments live in side tables (every distinct constant set is a distinct compilation,
as on Neuron), the tensors are the node's inputs. Implementations, one per dispatch situation:

* dense (eager, real tensors): the kernel runs on ``nki_lib.simulator`` over the tensors' bytes;
  outputs come back on the device of the first tensor argument (``neuron`` under emulation);
* fake (``torch.compile`` / export tracing): output metadata from one simulated run on zero
  inputs of the same shapes, cached per specialization (TorchNeuron traces the kernel on meta
  tensors for the same purpose);
* proxy: records the node in the FX graph; functionalization: the launch is functional.

No autograd formula and no autocast: gradients come from the enclosing op's ``register_autograd``
(its backward op launches the backward kernel), and kernels get their inputs' dtypes.
"""

from __future__ import annotations

import contextvars
import threading

import numpy as np
import torch
from torch._C import DispatchKey
from torch._higher_order_ops.utils import register_fake
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    track_tensor_tree,
)
from torch.utils import _pytree as pytree


class _Table:
    """Append-only side table with de-duplication by key (kernels, constant sets)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list = []
        self._index: dict = {}

    def add(self, key, item) -> int:
        with self._lock:
            idx = self._index.get(key)
            if idx is None:
                idx = self._index[key] = len(self._items)
                self._items.append(item)
            return idx

    def __getitem__(self, idx: int):
        return self._items[idx]


KERNELS = _Table()
CONSTANTS = _Table()   # (treespec, leaves with SLOT where a tensor goes, nki op name)


class _Slot:
    def __repr__(self) -> str:
        return "<tensor>"


SLOT = _Slot()


class NKIKernelCall(HigherOrderOperator):
    def __init__(self) -> None:
        super().__init__("nki_kernel_call", cacheable=True)

    def __call__(self, kernel_idx: int, grid: int, constants_idx: int, tensors: list):
        return super().__call__(kernel_idx, grid, constants_idx, tensors)


nki_kernel_call = NKIKernelCall()


def launch(kernel, grid: int, args: tuple, kwargs: dict, op: str | None = None):
    """Launch ``kernel[grid](*args, **kwargs)`` for nki op ``op`` through ``nki_kernel_call``
    (eager or traced)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    template = tuple(SLOT if isinstance(v, torch.Tensor) else v for v in leaves)
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    kernel_idx = KERNELS.add(id(kernel), kernel)
    constants_idx = CONSTANTS.add((str(spec), repr(template), op), (spec, template, op))
    token = _eager_op_call.set(True)   # dispatch counts this call; a compiled graph's run does not pass here
    try:
        return nki_kernel_call(kernel_idx, int(grid), constants_idx, tensors)
    finally:
        _eager_op_call.reset(token)


_eager_op_call: contextvars.ContextVar[bool] = contextvars.ContextVar("nki_lib_eager_op_call", default=False)


def _arguments(constants_idx: int, tensors) -> tuple[tuple, dict]:
    """The launch's ``(args, kwargs)`` with ``tensors`` in the tensor slots."""
    spec, template, _ = CONSTANTS[constants_idx]
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if v is SLOT else v for v in template], spec)


def _launchable(kernel_idx: int, grid: int):
    kernel = KERNELS[kernel_idx]
    return kernel[grid] if grid != 1 else kernel


def _device_of(tensors) -> torch.device:
    return next((t.device for t in tensors), torch.device("cpu"))


@nki_kernel_call.py_impl(DispatchKey.CompositeExplicitAutograd)
def _dense(kernel_idx, grid, constants_idx, tensors):
    from nki_lib.coverage import LEDGER
    from nki_lib.dispatch import run_on_simulator

    args, kwargs = _arguments(constants_idx, tensors)
    op = CONSTANTS[constants_idx][2]
    if not _eager_op_call.get() and op is not None:   # a compiled graph's node: the op call runs here
        LEDGER.record_call(op, "device")
    return run_on_simulator(_launchable(kernel_idx, grid), args, kwargs, _device_of(tensors))


_fake_cache: dict = {}


def _zeros(t: torch.Tensor) -> np.ndarray:
    from nki_lib.torch_bridge import numpy_dtype

    return np.zeros(tuple(int(s) for s in t.shape), dtype=numpy_dtype(t.dtype))


@register_fake(nki_kernel_call)
def _fake(kernel_idx, grid, constants_idx, tensors):
    from nki_lib._nki import nki
    from nki_lib.torch_bridge import torch_dtype

    key = (kernel_idx, grid, constants_idx, tuple((tuple(t.shape), t.dtype) for t in tensors))
    metas = _fake_cache.get(key)
    if metas is None:
        args, kwargs = _arguments(constants_idx, [_zeros(t) for t in tensors])
        outputs = nki.simulate(_launchable(kernel_idx, grid))(*args, **kwargs)
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        metas = _fake_cache[key] = (single, tuple((o.shape, torch_dtype(o.dtype)) for o in outs))
    single, shapes = metas
    device = _device_of(tensors)
    outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes)
    return outs[0] if single else outs


@nki_kernel_call.py_impl(ProxyTorchDispatchMode)
def _proxy(mode, kernel_idx, grid, constants_idx, tensors):
    with disable_proxy_modes_tracing():
        out = nki_kernel_call(kernel_idx, grid, constants_idx, tensors)
    proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, (kernel_idx, grid, constants_idx, tensors))
    out_proxy = mode.tracer.create_proxy("call_function", nki_kernel_call, proxy_args, {},
                                         name="nki_kernel_call")
    return track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)


@nki_kernel_call.py_functionalize_impl
def _functionalize(ctx, kernel_idx, grid, constants_idx, tensors):
    unwrapped = ctx.unwrap_tensors(tensors)
    with ctx.redispatch_to_next():
        return ctx.wrap_tensors(nki_kernel_call(kernel_idx, grid, constants_idx, unwrapped))


for _key in (DispatchKey.PythonDispatcher, DispatchKey.PythonTLSSnapshot, DispatchKey.ADInplaceOrView,
             DispatchKey.BackendSelect, DispatchKey.AutocastCPU, DispatchKey.AutocastPrivateUse1,
             DispatchKey.AutogradCPU, DispatchKey.AutogradPrivateUse1):
    nki_kernel_call.fallthrough(_key)


def kernel_name(kernel_idx: int) -> str:
    kernel = KERNELS[kernel_idx]
    return getattr(kernel, "__qualname__", None) or getattr(getattr(kernel, "fn", None), "__qualname__", repr(kernel))
