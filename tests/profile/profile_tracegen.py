"""Tiny builders of hand-made simulator trace entries for the cost-model tests.

Shapes follow the trace format of ``nki_lib.simulator.trace``: on-chip accesses cover
partitions ``[p0, p0 + shape[0])`` and a contiguous byte range of ``free * itemsize`` bytes;
HBM accesses cover partitions (0, 1) and ``size * itemsize`` bytes of the flat buffer.
"""

from __future__ import annotations

import itertools
import math

from nki_lib.simulator.profile.costs import DTYPE_BYTES
from nki_lib.simulator.trace import Access, TraceEntry

_ids = itertools.count(1)


def new_id() -> int:
    return next(_ids)


def onchip(buffer_id: int, memory: str, shape: tuple, dtype: str = "bfloat16", *, p0: int = 0, b0: int = 0) -> Access:
    nbytes = math.prod(shape[1:]) * DTYPE_BYTES[dtype]
    return Access(buffer_id, memory, (p0, p0 + shape[0]), (b0, b0 + nbytes), tuple(shape), dtype)


def hbm(buffer_id: int, shape: tuple, dtype: str = "bfloat16", *, offset: int = 0) -> Access:
    return Access(buffer_id, "hbm", (0, 1), (offset, offset + math.prod(shape) * DTYPE_BYTES[dtype]),
                  tuple(shape), dtype)


class Trace:
    """Appends entries in program order for one program."""

    def __init__(self, program_id: int = 0) -> None:
        self.entries: list[TraceEntry] = []
        self.program_id = program_id

    def add(self, engine, opcode, reads, writes, shape, dtype, attrs=None, nbytes=None) -> TraceEntry:
        elements = math.prod(shape)
        entry = TraceEntry(index=len(self.entries), program_id=self.program_id, engine=engine, opcode=opcode,
                           reads=tuple(reads), writes=tuple(writes), shape=tuple(shape), dtype=dtype,
                           elements=elements,
                           bytes=nbytes if nbytes is not None else elements * DTYPE_BYTES[dtype],
                           attrs=dict(attrs or {}), source="test.py:1")
        self.entries.append(entry)
        return entry

    def matmul(self, stationary: Access, moving: Access, out: Access, *, is_transpose=False, tile=None) -> TraceEntry:
        """``tile``: the PE tile ``(start_row, rows, start_column, columns)`` the simulator records."""
        k, m, n = stationary.shape[0], math.prod(stationary.shape[1:]), math.prod(moving.shape[1:])
        return self.add("tensor", "nc_matmul", [stationary, moving], [out], (m, n), out.dtype,
                        {"K": k, "M": m, "N": n, "accumulate": False, "is_transpose": is_transpose, "tile": tile})

    def dma(self, src: Access, dst: Access, **attrs) -> TraceEntry:
        nbytes = math.prod(dst.shape) * DTYPE_BYTES[dst.dtype]
        row = dst.shape if dst.memory in ("sbuf", "psum") else src.shape
        attrs.setdefault("contiguous_bytes", math.prod(row[1:]) * DTYPE_BYTES[dst.dtype])
        attrs.setdefault("src_memory", src.memory)
        attrs.setdefault("dst_memory", dst.memory)
        return self.add("dma", "dma_copy", [src], [dst], dst.shape, dst.dtype, attrs, nbytes=nbytes)

    def vector(self, opcode, reads, out: Access, **attrs) -> TraceEntry:
        return self.add("vector", opcode, reads, [out], out.shape, out.dtype, attrs)

    def activation(self, src: Access, out: Access, func: str = "exp", reduce: bool = False) -> TraceEntry:
        return self.add("scalar", "activation", [src], [out], out.shape, out.dtype, {"func": func, "reduce": reduce})
