"""An emulated ``neuron`` device: PrivateUse1 renamed to ``neuron`` with PyTorch's Python-backend
support, every aten op on a neuron tensor served on the CPU underneath and counted.

A neuron tensor here is a storage-less PrivateUse1 tensor (``torch._C._acc.create_empty_tensor``)
whose sizes, strides and storage offset mirror a CPU tensor it carries (``_raw``). One boxed
fallback on the PrivateUse1 dispatch key serves every aten op: it swaps neuron tensors for their
CPU tensors (and a ``device="neuron"`` argument for ``"cpu"``), runs the op, and maps the results
back by the op's schema: in-place / ``out=`` results are the neuron argument itself, views are
neuron views of the neuron base (so storage aliasing is the same on both sides), fresh results are
new neuron tensors. Each call is counted in the coverage ledger under its op name (an *emulated
aten call*: on Trainium TorchNeuron would run it as a device op or its own CPU fallback).

Autograd (AutogradPrivateUse1), FakeTensor conversion and AOTAutograd see ordinary PrivateUse1
tensors, as they see TorchNeuron's. Not emulated: streams, events, memory stats, pinned memory.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.utils import _pytree as pytree

DEVICE = "neuron"
_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class EmulationError(RuntimeError):
    """``emulate_neuron()`` cannot take PrivateUse1 in this process."""


class _DeviceModule:
    """``torch.neuron``: what PyTorch asks of a backend's device module (one device)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:  # CPU generators serve random ops underneath
        del seed

    @staticmethod
    def get_amp_supported_dtype() -> list:
        # torch.autocast(device_type="neuron") works on TorchNeuron (its FAQ); bf16/fp16 lower precision
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def is_emulated() -> bool:
        return True


# --------------------------------------------------------------------------- tensors
#
# A neuron storage is a non-owning PrivateUse1 storage over the bytes of a CPU storage; the table
# below maps its data pointer to that CPU storage and keeps the CPU storage alive while any tensor
# uses the neuron storage (swept by use count). Any neuron tensor, however PyTorch built it (a
# saved output autograd re-wraps, a composite view op), finds its CPU tensor through its storage.

class _Storages:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ptr: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._sweep_at = 64

    def neuron_storage(self, cpu_storage: torch.UntypedStorage) -> torch.UntypedStorage:
        ptr = cpu_storage.data_ptr()
        with self._lock:
            entry = self._by_ptr.get(ptr)
            if entry is not None and entry[1].nbytes() >= cpu_storage.nbytes():
                return entry[0]
            if len(self._by_ptr) >= self._sweep_at:
                self._sweep()   # before the new entry: no tensor uses its storage yet
            neuron = torch._C._construct_storage_from_data_pointer(
                ptr, torch.device(DEVICE, 0), cpu_storage.nbytes())
            self._by_ptr[ptr] = (neuron, cpu_storage)
            return neuron

    def cpu_storage(self, neuron_storage: torch.UntypedStorage) -> torch.UntypedStorage:
        with self._lock:
            entry = self._by_ptr.get(neuron_storage.data_ptr())
        if entry is None:
            raise RuntimeError("a neuron tensor whose storage nki_lib's emulation did not create")
        return entry[1]

    def _sweep(self) -> None:
        """Drop CPU storages no neuron tensor uses any more (only this table holds the storage)."""
        self._by_ptr = {ptr: e for ptr, e in self._by_ptr.items() if torch._C._storage_Use_Count(e[0]._cdata) > 1}
        self._sweep_at = max(64, 2 * len(self._by_ptr))

    def __len__(self) -> int:
        return len(self._by_ptr)


STORAGES = _Storages()


def is_neuron(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == DEVICE


def raw(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor underneath an emulated neuron tensor (same bytes, sizes, strides, offset)."""
    if t.untyped_storage().nbytes() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    cpu = torch.empty(0, dtype=t.dtype)
    return cpu.set_(STORAGES.cpu_storage(t.untyped_storage()), t.storage_offset(), t.shape, t.stride())


def wrap(cpu: torch.Tensor) -> torch.Tensor:
    """A neuron tensor over ``cpu``'s bytes (a view of any neuron tensor over the same storage)."""
    shell = torch._C._acc.create_empty_tensor((0,), cpu.dtype)
    if cpu.untyped_storage().nbytes() == 0:
        return shell.as_strided(cpu.shape, cpu.stride()) if cpu.numel() == 0 and cpu.dim() != 1 else shell
    storage = STORAGES.neuron_storage(cpu.untyped_storage())
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYSET, shell, storage, cpu.storage_offset(), cpu.shape, cpu.stride())
    return shell


# --------------------------------------------------------------------------- the fallback

def _to_cpu_arg(value):
    if is_neuron(value):
        return raw(value)
    if isinstance(value, torch.device) and value.type == DEVICE:
        return torch.device("cpu")
    return value


def _result_on_neuron(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is None or torch.device(device).type == DEVICE


def _written_args(op, args, kwargs) -> list:
    """For each return of ``op``: the argument it writes and returns (in-place / out=), or None."""
    schema = op._schema
    written = {}
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for alias_set in info.before_set:
                written[alias_set] = value
    out = []
    for ret in schema.returns:
        info = ret.alias_info
        out.append(next((written[a] for a in info.before_set if a in written), None) if info else None)
    return out


def _map_result(result, written, on_neuron):
    if not isinstance(result, torch.Tensor):
        return result
    if written is not None:
        if is_neuron(written):
            _follow(written, result)
        return written
    return wrap(result) if on_neuron else result


def _follow(t: torch.Tensor, cpu: torch.Tensor) -> None:
    """Point neuron ``t`` at ``cpu`` again after an op resized its CPU tensor (``out=``, resize_)."""
    same = (t.shape == cpu.shape and t.stride() == cpu.stride() and t.storage_offset() == cpu.storage_offset()
            and t.untyped_storage().data_ptr() == cpu.untyped_storage().data_ptr())
    if same:
        return
    storage = STORAGES.neuron_storage(cpu.untyped_storage())
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYSET, t, storage, cpu.storage_offset(), cpu.shape, cpu.stride())


def _copy_from(src, dst, non_blocking=False):
    dst_cpu = raw(dst) if is_neuron(dst) else dst
    dst_cpu.copy_(_to_cpu_arg(src), non_blocking=False)
    return dst


def _copy_from_and_resize(src, dst):
    if is_neuron(dst):
        raise NotImplementedError("emulated neuron: copying into a neuron tensor of another size")
    dst.resize_(src.shape)
    dst.copy_(_to_cpu_arg(src))
    return dst


_SPECIAL = {"aten::_copy_from": _copy_from, "aten::_copy_from_and_resize": _copy_from_and_resize}


def _rebox_numbers(op, args, kwargs):
    """A Python number where the schema has a Tensor was a wrapped number (``t % 2``) that boxing
    turned into a scalar; it goes back as a 0-dim CPU tensor that promotes like one: a float as
    float64 next to a floating tensor (whose dtype wins; kernels read the scalar at full precision),
    else in the default dtype; an int as int64, a bool as bool."""
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    float_dtype = torch.float64 if any(t.is_floating_point() for t in tensors) else torch.get_default_dtype()

    def fix(arg, value):
        if isinstance(value, (bool, int, float)) and isinstance(arg.type, torch.TensorType):
            if isinstance(value, bool):
                return torch.tensor(value)
            return torch.tensor(value, dtype=float_dtype if isinstance(value, float) else torch.int64)
        return value

    schema_args = op._schema.arguments
    args = tuple(fix(schema_args[i], v) if i < len(schema_args) else v for i, v in enumerate(args))
    by_name = {a.name: a for a in schema_args}
    kwargs = {k: fix(by_name[k], v) if k in by_name else v for k, v in kwargs.items()}
    return args, kwargs


def _fallback(op, *args, **kwargs):
    from nki_lib.coverage import LEDGER

    name = op._schema.name
    if not _state.get("probing"):
        LEDGER.record_emulated_aten(name)
    special = _SPECIAL.get(name)
    if special is not None:
        return special(*args, **kwargs)
    if name == "aten::set_":
        raise NotImplementedError("emulated neuron: Tensor.set_ on a neuron tensor is not supported")
    args, kwargs = _rebox_numbers(op, args, kwargs)
    cpu_args = pytree.tree_map(_to_cpu_arg, args)
    cpu_kwargs = pytree.tree_map(_to_cpu_arg, kwargs)
    out = op(*cpu_args, **cpu_kwargs)
    on_neuron = _result_on_neuron(kwargs)
    sources = _written_args(op, args, kwargs)
    if isinstance(out, (tuple, list)) and len(sources) == len(out):
        return type(out)(_map_result(o, s, on_neuron) for o, s in zip(out, sources))
    if len(sources) == 1:
        return _map_result(out, sources[0], on_neuron)
    return pytree.tree_map(lambda o: _map_result(o, None, on_neuron), out)


# --------------------------------------------------------------------------- setup

_lock = threading.Lock()
_state: dict = {}


def active() -> bool:
    """True once ``emulate_neuron()`` has run in this process."""
    return bool(_state.get("ready"))


def check_free() -> None:
    """Raise :class:`EmulationError` unless PrivateUse1 is free for the emulation."""
    if "torch_neuronx" in sys.modules:
        raise EmulationError("emulate_neuron(): torch_neuronx is loaded; the real neuron device is in use "
                             "(run the emulation in a process without it)")
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        raise EmulationError(f"emulate_neuron(): PrivateUse1 is already taken (renamed to {name!r}) in this process")


def setup() -> None:
    """Rename PrivateUse1 to ``neuron`` and install the CPU-underneath fallback (once)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    with _lock:
        if _state.get("ready"):
            return
        if _state:
            raise EmulationError("emulate_neuron(): an earlier call failed in this process; start a new process")
        check_free()
        _setup_privateuseone_for_python_backend(DEVICE, backend_module=_DeviceModule())
        lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 (a backend fallback needs the global namespace)
        lib.fallback(_fallback, "PrivateUse1")
        _state["lib"] = lib
        _probe_autograd()
        _state["ready"] = True


def _probe_autograd() -> None:
    """PyTorch sizes the autograd engine's device queues at the process's first backward: a
    backward that ran before the rename leaves no queue for neuron tensors."""
    _state["probing"] = True   # the probe's aten calls are not the user's (backward runs on another thread)
    try:
        probe = torch.zeros((), device=DEVICE, requires_grad=True)
        (probe * 1.0).backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise EmulationError("emulate_neuron() must run before the first autograd backward of the process "
                             "(PyTorch sizes its autograd device queues once); call it at startup") from None
    finally:
        _state["probing"] = False
