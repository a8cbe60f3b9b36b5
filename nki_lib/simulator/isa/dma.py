"""DMA instructions: dma_copy, dma_transpose, dma_compute (docs/nki-semantics.md §8.1, §8.10, §8.24).

DMA moves data between HBM and SBUF (and HBM->HBM, SBUF->SBUF), never PSUM. Both operands are
flattened in row-major view order; only the element counts must match. Differing dtypes convert
through fp32 (not allowed with ``dge_mode.hwdge``).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import cast_to, is_packed, to_f32
from ..hw import DGE_TRANSPOSE_LAST_GRANULE, DGE_TRANSPOSE_MAX_LAST, DGE_TRANSPOSE_ROWS
from ..memory import ONCHIP
from ..tensor import NkiTensor
from ._common import INSTRUCTION, as_op, begin
from .constants import dge_mode as _dge_mode
from .constants import oob_mode as _oob_mode

__all__ = ["dma_copy", "dma_transpose", "dma_compute"]

_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def _dma_operand(c, t, operand, allow_onchip=True):
    if not isinstance(t, NkiTensor):
        c.fail(operand, f"expected an NkiTensor, got {type(t).__name__}")
    kind = t._st.kind
    c.check(kind != "psum", operand, "DMA may not access PSUM (copy PSUM to SBUF with tensor_copy first)")
    if kind in ONCHIP:
        c.check(allow_onchip, operand, "must be in HBM")
        c.check(t._shape[0] <= c.spec.pmax, operand,
                f"partition dimension {t._shape[0]} exceeds maximum {c.spec.pmax}")


def _modes(c, oob_mode, dge_mode):
    c.check(isinstance(oob_mode, _oob_mode), "oob_mode", f"must be a nisa.oob_mode member, got {oob_mode!r}")
    c.check(isinstance(dge_mode, _dge_mode), "dge_mode", f"must be a nisa.dge_mode member, got {dge_mode!r}")
    return oob_mode == _oob_mode.skip


def _convert(c, vals, src_dt, dst_dt, operand="src"):
    if src_dt == dst_dt:
        return vals
    c.check(not is_packed(src_dt) and not is_packed(dst_dt), operand,
            f"cannot convert between {src_dt} and {dst_dt} (packed types move as raw bits; use .view())")
    return cast_to(to_f32(vals, src_dt), dst_dt)


def _attrs(src, dst, **extra):
    attrs = {"src_memory": src._st.kind, "dst_memory": dst._st.kind,
             "contiguous_bytes": min(src._contig_bytes(), dst._contig_bytes()), "queue": "dma",
             "indirect": _indirect_form(src, dst)}
    attrs.update(extra)
    return attrs


def _indirect_form(*views):
    """The DMA's addressing form for the cost model's DGE rule: ``"vector"`` (per-partition
    ``vector_offset`` gather/scatter), ``"scalar"`` (one runtime ``scalar_offset``) or None."""
    forms = {v._dyn[0] for v in views if v._dyn is not None}
    return "vector" if "vector" in forms else ("scalar" if forms else None)


def _reads(srcs, dst):
    """The source views ``srcs`` (one view or several) plus the SBUF tensors holding the runtime
    offsets of any of them or of ``dst`` (the DMA reads those too)."""
    srcs = tuple(srcs) if isinstance(srcs, (list, tuple)) else (srcs,)
    offsets = tuple(v._dyn[1] for v in (*srcs, dst) if v._dyn is not None and isinstance(v._dyn[1], NkiTensor))
    return srcs + offsets


def dma_copy(dst, src, priority=None, oob_mode=_oob_mode.error, dge_mode=_dge_mode.unknown,
             engine=None, name=None):
    """``dst = src`` over the row-major flattening of both views."""
    c = begin("dma_copy")
    _dma_operand(c, dst, "dst")
    _dma_operand(c, src, "src")
    skip = _modes(c, oob_mode, dge_mode)
    c.check(src.size == dst.size, "dst", f"element count {dst.size} differs from src's {src.size}")
    if dge_mode == _dge_mode.hwdge:
        c.check(src._dtype == dst._dtype, "dst", "dge_mode.hwdge requires identical src and dst dtypes")
        c.check(src._dyn is None or src._dyn[0] != "vector", "src", "vector_offset indirection requires swdge")
        c.check(dst._dyn is None or dst._dyn[0] != "vector", "dst", "vector_offset indirection requires swdge")
    vals, rows = src._gather(c.opcode, "src", skip)
    if vals is None:                      # whole transfer skipped (scalar offset out of bounds)
        c.record("dma", _reads(src, dst), (dst,), dst._shape, dst._dtype, 0, 0,
                 _attrs(src, dst, skipped=True))
        return INSTRUCTION
    out = _convert(c, np.asarray(vals), src._dtype, dst._dtype)
    if rows is not None and not rows.all():
        keep = np.broadcast_to(rows.reshape((-1,) + (1,) * (out.ndim - 1)), out.shape).reshape(-1)
        current_vals, _ = dst._gather(c.opcode, "dst", skip)
        merged = np.array(current_vals).reshape(-1)
        merged[keep] = out.reshape(-1)[keep]
        out = merged
    dst._scatter(out, c.opcode, "dst", skip=skip)
    c.record("dma", _reads(src, dst), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             _attrs(src, dst, dge_mode=dge_mode.name, oob_mode=oob_mode.name, engine=getattr(engine, "name", engine)))
    return INSTRUCTION


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=_dge_mode.unknown, oob_mode=_oob_mode.error,
                  name=None):
    """DMA-engine transpose: ``dst = src.transpose(axes)`` (dst in SBUF)."""
    c = begin("dma_transpose")
    _dma_operand(c, dst, "dst")
    _dma_operand(c, src, "src")
    c.check(dst._st.kind == "sbuf", "dst", "dma_transpose writes SBUF")
    skip = _modes(c, oob_mode, dge_mode)
    c.check(src._dtype == dst._dtype, "dst", f"dtype {dst._dtype} differs from src's {src._dtype}")
    rank = len(src._shape)
    c.check(rank in _DMA_TRANSPOSE_AXES, "src", f"dma_transpose supports 2-, 3- and 4-d sources, got {rank}-d")
    default = _DMA_TRANSPOSE_AXES[rank]
    axes = default if axes is None else tuple(int(a) for a in axes)
    c.check(axes == default, "axes", f"only the permutation {default} is supported for {rank}-d sources")
    want = tuple(src._shape[a] for a in axes)
    c.check(tuple(dst._shape) == want, "dst", f"shape {dst._shape} must equal the permuted src shape {want}")
    if dge_mode == _dge_mode.hwdge or src._dyn is not None:
        c.check(src._dtype.itemsize == 2, "src", "the hwdge / indirect dma_transpose paths need 2-byte dtypes")
    if src._dyn is not None and src._dyn[0] == "vector":
        _indirect_transpose_rules(c, src._shape, src._dyn[1], dge_mode)
    if dge_mode == _dge_mode.hwdge:
        _hwdge_transpose_shape(c, src._shape)
    vals, rows = src._gather(c.opcode, "src", skip)
    if vals is None:
        c.record("dma", _reads(src, dst), (dst,), dst._shape, dst._dtype, 0, 0,
                 _attrs(src, dst, skipped=True, hwdge_shape=_hwdge_shape_ok(src._shape)))
        return INSTRUCTION
    out = np.transpose(np.asarray(vals), axes)
    dst._scatter(np.ascontiguousarray(out), c.opcode, "dst")
    c.record("dma", _reads(src, dst), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             _attrs(src, dst, axes=axes, dge_mode=dge_mode.name, hwdge_shape=_hwdge_shape_ok(src._shape)))
    return INSTRUCTION


def _hwdge_transpose_shape(c, shape):
    """Hardware-DGE transpose shapes (docs/nki-semantics.md §8.10, the nki.isa.dma_transpose page's
    "DMA Direct Transpose Constraints"): exactly 16 source rows (``src.shape[0]``, every rank) and a
    last dim that is a multiple of 128 (the 2-byte dtype is checked by the caller)."""
    c.check(shape[0] == DGE_TRANSPOSE_ROWS, "src",
            f"a hwdge dma_transpose needs src.shape[0] == {DGE_TRANSPOSE_ROWS}, got src shape {tuple(shape)}")
    c.check(shape[-1] % DGE_TRANSPOSE_LAST_GRANULE == 0, "src",
            f"a hwdge dma_transpose needs src.shape[-1] a multiple of {DGE_TRANSPOSE_LAST_GRANULE}, "
            f"got src shape {tuple(shape)}")


def _hwdge_shape_ok(shape):
    """Whether a ``dma_transpose`` source of ``shape`` has the hardware DGE's form (16 rows, a last dim
    that is a multiple of 128): recorded in the trace (``attrs["hwdge_shape"]``) for the cost model's
    DGE rule (a runtime-offset transpose of another shape can only get software DGE)."""
    return shape[0] == DGE_TRANSPOSE_ROWS and shape[-1] % DGE_TRANSPOSE_LAST_GRANULE == 0


def _indirect_transpose_rules(c, shape, indices, dge_mode):
    """The indirect (software-DGE gather) transpose's documented limits (docs/nki-semantics.md §8.10;
    the source in HBM, the indices in SBUF and 2-byte data are checked elsewhere)."""
    c.check(dge_mode in (_dge_mode.unknown, _dge_mode.swdge), "dge_mode",
            f"an indirect dma_transpose lowers to a software-DGE transpose: dge_mode unknown or swdge, got {dge_mode.name}")
    if len(shape) == 4:
        c.check(shape[1] == 1 or shape[2] == 1, "src",
                f"a 4-d indirect transpose needs shape[1] or shape[2] equal to 1, got {shape}")
    c.check(shape[-1] <= DGE_TRANSPOSE_MAX_LAST, "src",
            f"an indirect transpose needs shape[-1] <= {DGE_TRANSPOSE_MAX_LAST}, got {shape[-1]}")
    c.check(shape[0] % DGE_TRANSPOSE_ROWS == 0, "src",
            f"an indirect transpose needs shape[0] a multiple of {DGE_TRANSPOSE_ROWS}, got {shape[0]}")
    idx = indices._shape
    c.check(len(idx) == 2, "src", f"the indirect transpose's indices must be 2-d, got shape {idx}")
    c.check(DGE_TRANSPOSE_ROWS <= idx[0] <= c.spec.pmax and idx[0] % DGE_TRANSPOSE_ROWS == 0, "src",
            f"the indirect transpose's indices need shape[0] in [{DGE_TRANSPOSE_ROWS}, {c.spec.pmax}], "
            f"a multiple of {DGE_TRANSPOSE_ROWS}, got {idx}")
    c.check(idx[1] == 1 or idx[0] == c.spec.pmax, "src",
            f"indices with more than one column need {c.spec.pmax} rows, got {idx}")
    c.check(indices.dtype == "uint32", "src", f"the indirect transpose's indices must be uint32, got {indices.dtype}")


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=_oob_mode.error, name=None):
    """DMA elementwise reduction ``dst = sum_i srcs[i] * scales[i]`` in fp32 (reduce_op add only)."""
    c = begin("dma_compute")
    _dma_operand(c, dst, "dst")
    c.check(isinstance(srcs, (list, tuple)) and 1 <= len(srcs) <= 16, "srcs", "srcs must be a list of 1..16 tensors")
    op = as_op(c, reduce_op, "reduce_op")
    c.check(op.name == "add", "reduce_op", "dma_compute supports only nl.add")
    if scales is not None:
        c.check(len(scales) == len(srcs), "scales", "one scale per source")
        c.check(all(float(s) == 1.0 for s in scales), "scales", "all scales must be 1.0")
    c.check(unique_indices is True, "unique_indices", "must be True")
    skip = _modes(c, oob_mode, _dge_mode.unknown)
    total = None
    for i, src in enumerate(srcs):
        _dma_operand(c, src, f"srcs[{i}]")
        c.check(src.size == dst.size, f"srcs[{i}]", f"element count {src.size} differs from dst's {dst.size}")
        vals, _ = src._gather(c.opcode, f"srcs[{i}]", skip)
        if vals is None:
            continue
        f = to_f32(np.asarray(vals), src._dtype).reshape(-1)
        total = f if total is None else total + f
    if total is not None:
        dst._scatter(cast_to(total, dst._dtype), c.opcode, "dst", skip=skip)
    c.record("dma", _reads(srcs, dst), (dst,), dst._shape, dst._dtype, dst.size, dst.size * dst.itemsize,
             _attrs(srcs[0], dst, num_srcs=len(srcs)))
    return INSTRUCTION
