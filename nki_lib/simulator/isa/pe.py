"""Tensor-engine (PE) instructions: nc_matmul, nc_transpose (docs/nki-semantics.md §8.6, §8.8).

``nc_matmul``: stationary (K, M), moving (K, N) in SBUF -> dst (M, N) in PSUM, ``dst = S.T @ V``.
Each instruction's dot products are summed in fp64 BLAS (products of NKI inputs are exact there) and
rounded once to fp32, so an element's value never depends on the tile's N or M (fp32 BLAS results do,
through its blocking at tile edges; the systolic array's do not); PSUM accumulation across
instructions is fp32.
Accumulation: ``accumulate=None`` overwrites PSUM elements not yet written by a matmul since the
allocation (or since a non-TensorE write) and adds onto the others; True adds; False overwrites.
``nc_transpose``: TensorE (P, F <= 128, SBUF -> PSUM, bit-exact) or VectorE (P, F <= 32).
"""

from __future__ import annotations

import numpy as np

from ..hw import MATMUL_TILE_SIZES, VECTOR_TRANSPOSE_MAX
from ..tensor import NkiTensor
from ._common import INSTRUCTION, begin, engine_name, onchip, read_f32, read_raw
from .constants import matmul_perf_mode as _perf_mode

__all__ = ["nc_matmul", "nc_transpose"]

_MM_INPUTS = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32")
_FP8 = ("float8_e4m3", "float8_e5m2", "float8_e4m3fn")
_WIDE = ("float32", "tfloat32")


def _check_inputs(c, stationary, moving):
    allowed = _MM_INPUTS + (("float8_e4m3fn",) if c.spec.gen >= 4 else ())
    for t, nm in ((stationary, "stationary"), (moving, "moving")):
        c.check(t._dtype in allowed, nm, f"nc_matmul input dtype {t._dtype} not supported on {c.spec.name} "
                                         f"(allowed: {', '.join(allowed)})")
    s_wide, m_wide = stationary._dtype in _WIDE, moving._dtype in _WIDE
    c.check(s_wide == m_wide, "moving", "fp32/tf32 operands can only be paired with fp32/tf32")
    pair = {stationary._dtype, moving._dtype}
    c.check(not {"float8_e4m3", "float8_e4m3fn"} <= pair, "moving", "float8_e4m3 and float8_e4m3fn cannot be mixed")


def _psum_dst(c, dst, n, transpose):
    pf = onchip(c, dst, "dst", sbuf=False, why=" (nc_matmul writes PSUM)", free_limit=False)
    allowed = ("float32", "bfloat16") if c.spec.gen >= 4 else ("float32",)
    c.check(transpose or dst._dtype in allowed, "dst",
            f"matmul PSUM result must be {' or '.join(allowed)} on {c.spec.name}, got {dst._dtype}")
    acc = dst._access()
    bank = c.spec.psum_bank_bytes
    first, last = acc.byte_range[0] // bank, (acc.byte_range[1] - 1) // bank
    nmax = c.spec.matmul_fp32_nmax if transpose or dst._dtype == "float32" else c.spec.matmul_bf16_nmax
    c.check(n <= nmax, "moving", f"moving free size {n} exceeds {nmax} on {c.spec.name}")
    if c.spec.gen < 4:
        c.check(first == last, "dst", f"matmul result spans PSUM banks {first}..{last}; it must fit one 2 KiB bank")
    return pf


def _psum_write(c, dst, result, accumulate, dpf) -> bool:
    """Write a TensorE result with the overwrite/accumulate rule of nc_matmul (§8.8); True if it added."""
    mask = dst._mask_view(dst._offset) if dst._dyn is None else None
    if accumulate is False:
        out, added = result, False
    else:
        old = read_f32(c, dst, "dst", dpf)
        if accumulate is True or mask is None:
            out, added = old + result, True
        else:
            started = mask.reshape(dpf).astype(bool)
            added = bool(started.any())
            out = np.where(started, old + result, result) if added else result
    dst._scatter(out.astype(dst._dtype.np), c.opcode, "dst", matmul=True)
    return added


def _tiling(c, tile_position, tile_size, k, m, dst):
    """The documented tiling-mode rules (nki_lib/simulator/README.md, "nc_matmul tiling mode"): both
    tuples set, sizes from MATMUL_TILE_SIZES, positions multiples of their sizes inside the array, the
    stationary (K, M) within the tile; a column tile's dst starts at its start column. Where the
    operands start is not constrained by the docs, so it is not checked."""
    if not tile_position and not tile_size:
        return
    c.check(bool(tile_position) and bool(tile_size), "tile_size", "tile_position and tile_size must be set together")
    c.check(len(tile_position) == 2 and len(tile_size) == 2, "tile_size", "expects (row, column) pairs")
    sizes = MATMUL_TILE_SIZES if c.spec.gen >= 3 else MATMUL_TILE_SIZES[1:]
    for v, nm in zip(tile_size, ("row", "column")):
        c.check(v in sizes, "tile_size", f"{nm} tile size {v} not in {sizes}")
    for pos, size, nm in zip(tile_position, tile_size, ("row", "column")):
        c.check(pos % size == 0 and 0 <= pos < c.spec.pmax, "tile_position",
                f"{nm} position {pos} must be a multiple of the tile size {size} within the array")
    c.check(k <= tile_size[0], "stationary", f"contraction {k} exceeds the row tile size {tile_size[0]}")
    c.check(m <= tile_size[1], "stationary", f"stationary free size {m} exceeds the column tile size {tile_size[1]}")
    if tile_size[1] < c.spec.pmax:
        start = dst._access().partitions[0]
        c.check(start == tile_position[1], "dst", f"dst starts at partition {start}, column tile at {tile_position[1]}")


def _tile_attr(tile_position, tile_size):
    """The trace's record of a tiled matmul, ``(start_row, rows, start_column, columns)``, or None
    (the cost model runs matmuls on disjoint PE tiles in parallel: docs/cost-model.md §7.4)."""
    if not tile_size:
        return None
    return (int(tile_position[0]), int(tile_size[0]), int(tile_position[1]), int(tile_size[1]))


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=_perf_mode.none, name=None):
    """``dst (M, N) [+]= stationary(K, M).T @ moving(K, N)`` on the Tensor engine."""
    c = begin("nc_matmul")
    spf = onchip(c, stationary, "stationary", psum=False, why=" (TensorE reads SBUF)")
    mpf = onchip(c, moving, "moving", psum=False, why=" (TensorE reads SBUF)")
    c.check(accumulate in (None, True, False), "accumulate", "accumulate must be None, True or False")
    c.check(isinstance(perf_mode, _perf_mode), "perf_mode", "perf_mode must be a nisa.matmul_perf_mode member")
    double = perf_mode == _perf_mode.double_row
    if double:
        c.check(c.spec.gen >= 3, "perf_mode", "double_row needs NC-v3+")
        for t, nm in ((stationary, "stationary"), (moving, "moving")):
            c.check(t._dtype in _FP8, nm, "double_row mode needs fp8 operands")
            c.check(len(t._shape) == 3 and t._shape[1] == 2, nm, "double_row operands are (K, 2, free)")
        c.check(not tile_size or len(tile_size) != 2 or tile_size[1] == c.spec.pmax, "tile_size",
                "double_row cannot be combined with column tiling")
    k, m = spf
    km, n = mpf
    c.check(k == km, "moving", f"contraction (partition) sizes differ: stationary {k}, moving {km}")
    if double:
        m, n = stationary._shape[2], moving._shape[2]
    _check_inputs(c, stationary, moving)
    c.check(m <= c.spec.gemm_stationary_fmax, "stationary",
            f"stationary free size {m} exceeds gemm_stationary_fmax {c.spec.gemm_stationary_fmax}")
    dpf = _psum_dst(c, dst, n, bool(is_transpose))
    c.check(dpf == (m, n), "dst", f"dst must be ({m}, {n}) (M partitions x N elements), got {dst._shape}")
    _tiling(c, tile_position, tile_size, k, m, dst)
    if is_transpose:
        c.check(c.spec.gen >= 3, "is_transpose", "transpose mode needs NC-v3+")
        c.check(n == k, "moving", "transpose mode needs a (K, K) identity as moving")
        ident = read_f32(c, moving, "moving", mpf)
        c.check(np.array_equal(ident, np.eye(k, dtype=np.float32)), "moving", "transpose mode needs an identity moving")
        c.check(dst._dtype == stationary._dtype or dst._dtype == "float32", "dst",
                "transpose mode writes the stationary dtype (or fp32)")
        vals = np.array(read_raw(c, stationary, "stationary")).reshape(spf).T
        out = vals if dst._dtype == stationary._dtype else vals.astype(np.float32)
        dst._scatter(np.ascontiguousarray(out), c.opcode, "dst")
        c.record("tensor", (stationary, moving), (dst,), (m, n), dst._dtype, m * n, m * n * dst.itemsize,
                 {"K": k, "M": m, "N": n, "accumulate": False, "is_transpose": True,
                  "tile": _tile_attr(tile_position, tile_size)})
        return INSTRUCTION
    # products are exact in fp64; the fp64 sum rounded once to fp32 does not depend on the BLAS blocking
    # (fp32 BLAS results change with N at tile edges; the systolic array's do not)
    s = read_f32(c, stationary, "stationary", spf).astype(np.float64)
    v = read_f32(c, moving, "moving", mpf).astype(np.float64)
    if double:
        result = np.matmul(s.reshape(k, 2, m).transpose(1, 0, 2).reshape(2 * k, m).T,
                           v.reshape(k, 2, n).transpose(1, 0, 2).reshape(2 * k, n)).astype(np.float32)
    else:
        result = np.matmul(s.T, v).astype(np.float32)
    accumulated = _psum_write(c, dst, result, accumulate, dpf)
    c.record("tensor", (stationary, moving), (dst,), (m, n), dst._dtype, m * n, m * n * dst.itemsize,
             {"K": 2 * k if double else k, "M": m, "N": n, "accumulate": accumulated, "is_transpose": False,
              "perf_mode": perf_mode.value, "tile": _tile_attr(tile_position, tile_size)})
    return INSTRUCTION


def nc_transpose(dst, data, engine=None, name=None):
    """``dst[j, i] = data[i, j]`` over data's (P, F) stream (TensorE or VectorE), bit-exact."""
    c = begin("nc_transpose")
    if not isinstance(data, NkiTensor) or not isinstance(dst, NkiTensor):
        c.fail("data" if not isinstance(data, NkiTensor) else "dst", "expected NkiTensor operands")
    default = "tensor" if data._st.kind == "sbuf" and dst._st.kind == "psum" else "vector"
    eng = engine_name(c, engine, default, ("tensor", "vector"))
    if eng == "tensor":
        p, f = onchip(c, data, "data", psum=False, why=" (TensorE reads SBUF)")
        dpf = onchip(c, dst, "dst", sbuf=False, why=" (TensorE writes PSUM)")
        limit = c.spec.pmax
        c.check(dst._dtype == data._dtype or dst._dtype == "float32", "dst",
                f"dst dtype {dst._dtype} must equal data's {data._dtype} (or be float32)")
    else:
        p, f = onchip(c, data, "data")
        dpf = onchip(c, dst, "dst")
        limit = VECTOR_TRANSPOSE_MAX
        c.check(dst._dtype == data._dtype, "dst", f"dst dtype {dst._dtype} must equal data's {data._dtype}")
    c.check(p <= limit, "data", f"partition size {p} exceeds {limit} for the {eng} engine transpose")
    c.check(f <= limit, "data", f"free size {f} exceeds {limit} for the {eng} engine transpose")
    c.check(dpf == (f, p), "dst", f"dst must be ({f}, {p}), got {dst._shape}")
    vals = np.array(read_raw(c, data, "data")).reshape(p, f).T
    if dst._dtype != data._dtype:
        vals = vals.astype(np.float32)
    dst._scatter(np.ascontiguousarray(vals), c.opcode, "dst")
    c.record(eng, (data,), (dst,), (f, p), dst._dtype, f * p, f * p * dst.itemsize,
             {"K": p, "M": f, "N": p, "accumulate": False, "is_transpose": True} if eng == "tensor" else {})
    return INSTRUCTION
