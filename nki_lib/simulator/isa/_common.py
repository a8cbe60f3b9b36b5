"""Helpers shared by the instruction implementations: operand checks, fp32 reads, cast-on-write."""

from __future__ import annotations

import numpy as np

from ..dtypes import cast_to, is_int, to_f32
from ..hw import FREE_MAX_PSUM, FREE_MAX_SBUF, MAX_FREE_DIMS
from ..ops import Op, lookup_op
from ..state import Program, current
from ..tensor import NkiTensor
from .constants import engine

__all__ = ["begin", "onchip", "read_f32", "read_raw", "write", "scalar_operand", "engine_name", "same_pf",
           "INSTRUCTION", "as_op", "Program"]

_ENGINE_NAMES = {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar",
                 engine.gpsimd: "gpsimd", engine.dma: "dma", engine.sync: "sync"}


class NkiInstruction:
    """Opaque handle returned by every instruction (``depends_on`` only affects scheduling)."""

    __slots__ = ()

    def depends_on(self, *producers):
        return self


INSTRUCTION = NkiInstruction()


def begin(opcode: str) -> Program:
    prog = current()
    prog.opcode = opcode
    return prog


def engine_name(c: Program, eng, default: str, allowed: tuple) -> str:
    if eng is None or eng == engine.unknown:
        return default
    if not isinstance(eng, engine):
        c.fail("engine", f"engine must be a nisa.engine member, got {eng!r}")
    name = _ENGINE_NAMES[eng]
    c.check(name in allowed, "engine", f"{c.opcode} cannot run on the {name} engine (allowed: {', '.join(allowed)})")
    return name


def onchip(c: Program, t, operand: str, sbuf=True, psum=True, why="", free_limit=True) -> tuple[int, int]:
    """Check ``t`` is an on-chip tile in an allowed memory; returns (P, elements per partition).

    ``free_limit``: apply the Vector/Scalar/GpSimd elements-per-partition limits (not for TensorE results).
    """
    if not isinstance(t, NkiTensor):
        c.fail(operand, f"expected an NkiTensor tile, got {type(t).__name__}")
    kind = t._st.kind
    if kind == "sbuf":
        if not sbuf:
            c.fail(operand, f"operand may not be in SBUF{why}")
    elif kind == "psum":
        if not psum:
            c.fail(operand, f"operand may not be in PSUM{why}")
    else:
        c.fail(operand, f"compute engines cannot access HBM ({kind}); dma_copy it to SBUF first")
    if len(t._shape) > MAX_FREE_DIMS + 1:
        c.fail(operand, f"access pattern has {len(t._shape) - 1} free dims; the hardware supports at most "
                        f"{MAX_FREE_DIMS}")
    p = t._shape[0]
    if p > c.spec.pmax:
        c.fail(operand, f"partition dimension {p} exceeds maximum {c.spec.pmax}")
    f = t._size // p
    if free_limit and f > (FREE_MAX_SBUF if kind == "sbuf" else FREE_MAX_PSUM):
        c.fail(operand, f"{f} elements per partition exceed the compute-engine limit for {kind.upper()} "
                        f"operands ({FREE_MAX_SBUF if kind == 'sbuf' else FREE_MAX_PSUM})")
    return p, f


def same_pf(c: Program, ref: tuple, t, operand: str, sbuf=True, psum=True, why="") -> tuple[int, int]:
    pf = onchip(c, t, operand, sbuf, psum, why)
    if pf[0] != ref[0]:
        c.fail(operand, f"partition count {pf[0]} differs from {ref[0]}")
    if pf[1] != ref[1]:
        c.fail(operand, f"{pf[1]} elements per partition, expected {ref[1]}")
    return pf


def read_raw(c: Program, t: NkiTensor, operand: str):
    vals, _ = t._gather(c.opcode, operand)
    return vals


def read_f32(c: Program, t: NkiTensor, operand: str, pf: tuple) -> np.ndarray:
    vals, _ = t._gather(c.opcode, operand)
    try:
        return to_f32(vals, t._dtype).reshape(pf)
    except TypeError as exc:
        c.fail(operand, str(exc))


def write(c: Program, t: NkiTensor, values, operand: str = "dst", matmul: bool = False):
    try:
        out = cast_to(values, t._dtype)
    except TypeError as exc:
        c.fail(operand, str(exc))
    t._scatter(out, c.opcode, operand, matmul=matmul)


def tile_operands(*operands) -> tuple:
    """The operands that are tiles (an immediate scalar is not a read of any memory): what an
    instruction with scalar-or-tile operands records as reads beside its data tiles, so the trace's
    dependencies (and the cost model's schedule) see every tile it reads."""
    return tuple(x for x in operands if isinstance(x, NkiTensor))


def scalar_operand(c: Program, x, p: int, operand: str, allow_tile=True):
    """An fp32 immediate, or a (P, 1) per-partition tile as a (P, 1) fp32 array."""
    if isinstance(x, NkiTensor):
        c.check(allow_tile, operand, "must be a compile-time scalar here")
        pf = onchip(c, x, operand)
        c.check(pf == (p, 1), operand, f"per-partition scalar tile must be ({p}, 1), got {x.shape}")
        return read_f32(c, x, operand, pf)
    if isinstance(x, (bool, np.bool_)):
        return np.float32(x)
    if isinstance(x, (int, float, np.integer, np.floating)):
        return np.float32(x)
    c.fail(operand, f"expected a number or a ({p}, 1) tile, got {type(x).__name__}")


def as_op(c: Program, op, operand: str, allow_none=False) -> Op | None:
    if op is None and allow_none:
        return None
    try:
        return lookup_op(op, operand)
    except TypeError as exc:
        c.fail(operand, str(exc))


def int_tile(t) -> bool:
    return isinstance(t, NkiTensor) and is_int(t._dtype)
