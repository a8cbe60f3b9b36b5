"""Synchronisation, communication and register instructions (docs/nki-semantics.md §5.3, §8.9, §8.14, §8.18).

LNC2 programs run as two threads: ``core_barrier`` is a two-party barrier, ``sendrecv`` exchanges
snapshots of ``src`` through a per-``pipe_id`` mailbox between two barrier waits. Under LNC1
``core_barrier`` is a no-op.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import is_float
from ..hw import GPSIMD_DMA_BYTES
from ..target import TARGETS, get_target
from ..tensor import NkiTensor, VirtualRegister
from ._common import INSTRUCTION, begin, onchip, read_raw
from .constants import dma_engine as _dma_engine
from .constants import nc_version

__all__ = ["core_barrier", "sendrecv", "register_alloc", "register_move", "register_load", "register_store",
           "get_nc_version", "get_nc_sub_version"]


def _wait(c):
    c.run.barrier.wait(c.pid)


def core_barrier(data, cores=(0, 1), engine=None, name=None):
    """Barrier between the two cores of an LNC2 launch (no-op under LNC1)."""
    c = begin("core_barrier")
    c.check(isinstance(data, NkiTensor), "data", "core_barrier needs the shared tensor it orders")
    c.check(isinstance(cores, (tuple, list)) and tuple(cores) == (0, 1), "cores",
            f"cores must be (0, 1), got {cores!r}")
    if c.run.grid == 2:
        _wait(c)
    c.record("sync", (data,), (), (), data._dtype, 0, 0, {"cores": tuple(cores)})
    return INSTRUCTION


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=_dma_engine.dma, name=None):
    """Send ``src`` to core ``send_to_rank`` while receiving core ``recv_from_rank``'s ``src`` into ``dst``."""
    c = begin("sendrecv")
    c.check(c.run.grid == 2, "send_to_rank", "sendrecv needs an LNC2 launch (kernel[2])")
    spf = onchip(c, src, "src", psum=False, why=" (sendrecv moves SBUF)")
    dpf = onchip(c, dst, "dst", psum=False, why=" (sendrecv moves SBUF)")
    c.check(spf == dpf and src._dtype == dst._dtype, "dst", "src and dst need the same shape and dtype")
    for r, nm in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        c.check(r in (0, 1) and r != c.pid, nm, f"rank must be the other core (0 or 1), got {r}")
    if dma_engine == _dma_engine.gpsimd_dma:
        limit = GPSIMD_DMA_BYTES[src.itemsize]
        c.check(spf[1] * src.itemsize <= limit, "src", f"gpsimd_dma moves at most {limit} bytes per partition")
    c.run.mailbox[(pipe_id, c.pid)] = np.array(read_raw(c, src, "src"))
    _wait(c)
    data = c.run.mailbox[(pipe_id, recv_from_rank)]
    _wait(c)
    # Each core removes its OWN message once both have read: removing the peer's could delete the
    # peer's next message on the same pipe_id (a fast core may already be in its next sendrecv).
    c.run.mailbox.pop((pipe_id, c.pid), None)
    dst._scatter(data, c.opcode, "dst")
    c.record("dma", (src,), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             {"pipe_id": pipe_id, "queue": dma_engine.name})
    return INSTRUCTION


def register_alloc(x=None):
    """A new 32-bit register, optionally initialised to the compile-time int ``x``."""
    c = begin("register_alloc")
    c.check(x is None or isinstance(x, (int, np.integer)), "x", "initial value must be an int")
    c.record("sync", (), (), (), "int32", 0, 0)
    return VirtualRegister(x)


def _reg(c, r, operand, writable=False):
    c.check(isinstance(r, VirtualRegister), operand, "expected a VirtualRegister")
    if writable:
        c.check(not r.frozen, operand, "loop induction registers are read-only")


def register_move(dst, src):
    c = begin("register_move")
    _reg(c, dst, "dst", True)
    _reg(c, src, "src")
    dst.value = src.value
    c.record("sync", (), (), (), "int32", 0, 0)
    return INSTRUCTION


def _one_element(c, t, operand):
    c.check(isinstance(t, NkiTensor), operand, "expected a one-element tensor")
    c.check(t.size == 1, operand, f"must hold exactly one element, has {t.size}")
    c.check(t._st.kind != "psum", operand, "registers load/store HBM or SBUF, not PSUM")


def register_load(dst, src):
    """Load the one element of ``src`` into register ``dst`` (floats truncate toward zero)."""
    c = begin("register_load")
    _reg(c, dst, "dst", True)
    _one_element(c, src, "src")
    value = np.asarray(read_raw(c, src, "src")).reshape(-1)[0]
    dst.value = int(np.trunc(np.float64(value))) if is_float(src._dtype) else int(value)
    c.record("sync", (src,), (), (), "int32", 0, 0)
    return INSTRUCTION


def register_store(dst, src):
    """Store register ``src`` into the one element of ``dst``."""
    c = begin("register_store")
    _reg(c, src, "src")
    _one_element(c, dst, "dst")
    c.check(src.value is not None, "src", "register read before it was written")
    from ..dtypes import cast_to
    dst._scatter(cast_to(np.array([src.value], dtype=np.int64), dst._dtype), c.opcode, "dst")
    c.record("sync", (), (dst,), dst._shape, dst._dtype, 1, dst.itemsize)
    return INSTRUCTION


def get_nc_version() -> nc_version:
    """The NeuronCore generation of the current target (gen3 = trn2, gen4 = trn3)."""
    return nc_version(TARGETS[get_target()].gen)


def get_nc_sub_version() -> int:
    return 0

