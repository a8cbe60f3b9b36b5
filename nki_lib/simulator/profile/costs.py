"""Per-instruction cost rules: one trace entry -> engine occupancy and completion latency.

Each rule is the formula of ``docs/cost-model.md`` §7.2 (compute engines) or §7.3 (DMA),
evaluated on the shapes, dtypes and memories recorded in the trace entry, with the constants of
:mod:`.constants`. Notation: ``P`` = partitions (cost does not depend on it, §2.2), ``N`` = free
elements per partition of the streamed operand (the largest non-HBM access of the entry), ``w``
= elements per lane per engine cycle. Every compute instruction pays at least MIN_II cycles.

| engine | opcode | engine cycles |
|---|---|---|
| tensor | nc_matmul, nc_matmul_mx | r * max(min(64, M), N); r = 4 for fp32 inputs, 2 for fp32 in transpose mode |
| tensor | nc_transpose | r * max(P_in, min(64, F_in)) (== the matmul rule with an identity moving); x0.5 on trn3 (background transpose) |
| vector | tensor_copy, tensor_scalar, memset | max(64, N / w), w from dtype/memory/contiguity (§2.2) |
| vector | tensor_tensor | max(64, passes * N / w): passes 1 if one input is in PSUM, else 2 |
| vector | tensor_reduce | max(64, N) (N/2 for bf16 in and out with add/max) |
| vector | reciprocal | max(64, 8N) |
| vector | scalar_tensor_tensor | max(64, 2N) |
| vector | tensor_scalar_reduce | max(64, N) + 64 |
| vector | bn_aggr | max(64, 13N/3) |
| vector | exponential (trn3) | max(64, N / 4) |
| vector | tensor_copy_dynamic_* | max(600, N) |
| vector | other documented max(64, N) ops | max(64, N) |
| scalar | activation(_reduce) | max(64, N) (+64 with an accumulate read-out) |
| scalar | tensor_copy, tensor_scalar | max(64, N / w_act) (w_act = 2 for 16-bit on trn3) |
| gpsimd | iota, affine_select | 150 + N |
| gpsimd | other | max(64, N / w_pool) |
| sync | register ops | 64 |

An opcode without a rule gets the generic ``max(64, N)`` on its engine and is flagged
``modelled=False`` (the estimate counts these; nothing is dropped silently).

DMA (§7.3): ``E_used = min(16, ceil(P / 8))`` engines, each moving ``ceil(P / E_used)`` rows of
``ceil(row_bytes / chunk)`` contiguous chunks, each chunk costing ``max(chunk / BW, 105 ns)``;
BW is the per-engine bandwidth, capped at the core's HBM share / 16 when HBM is involved; DMA
transposes run at 90 % (from HBM) or 50 % (SBUF->SBUF) of it. Consumers see the data
``dma_latency`` (1.3 us) after the transfer ends. Descriptor generation (:func:`dge_mode_of`,
docs/cost-model.md "DGE") costs 600 ns on the triggering engine (sync, or scalar when the DMA
names it) for ``hwdge``, ~1 us + 50 ns per descriptor (one per contiguous chunk) on GpSimd for
``swdge``, ~0.1 us (no engine) for precomputed descriptors (``none``). The mode follows the
DMA's recorded form (``attrs["indirect"]``), not only what the kernel names: a ``vector_offset``
DMA is always ``swdge``; ``unknown`` with a ``scalar_offset`` is ``hwdge`` (``swdge`` for a
``dma_transpose`` whose source shape the hardware DGE cannot take); a static ``unknown`` DMA is
``none``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .constants import HardwareParams

__all__ = ["InstrCost", "instruction_cost", "dge_mode_of", "DTYPE_BYTES"]

DTYPE_BYTES = {
    "float64": 8, "int64": 8, "uint64": 8,
    "float32": 4, "tfloat32": 4, "int32": 4, "uint32": 4,
    "bfloat16": 2, "float16": 2, "int16": 2, "uint16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3": 1, "float8_e3m4": 1, "int8": 1, "uint8": 1, "bool": 1,
}
_ON_CHIP = ("sbuf", "psum")
_HBM = ("hbm", "shared_hbm", "private_hbm")
_TABLE_OPCODES = ("activation", "activation_reduce", "activate2")
_DVE_GENERIC = ("select_reduce", "range_select", "dropout", "nc_stream_shuffle", "max8", "nc_find_index8",
                "tensor_copy_predicated", "bn_stats", "tensor_tensor_scan", "nc_transpose", "iota",
                "affine_select", "nonzero_with_count", "tensor_partition_reduce", "quantize_mx",
                "tensor_scalar_cumulative")
_SYNC_OPS = ("register_alloc", "register_load", "register_store", "register_move", "core_barrier",
             "sendrecv", "barrier")


@dataclass(frozen=True)
class InstrCost:
    """Cost of one instruction.

    ``service_ns`` is the time the instruction occupies its engine (for DMA: each of the
    ``dma_engines`` DMA engines it uses). ``latency_ns`` is added after the service before a
    dependent instruction may start. ``issue_engine``/``issue_ns``: DMA descriptor generation
    on a compute engine (it occupies that engine in its program order). ``table_func`` is the
    ScalarE function that needs a lookup table (the scheduler charges table switches).
    """

    engine: str
    service_ns: float
    latency_ns: float
    dma_engines: int = 0
    issue_engine: str | None = None
    issue_ns: float = 0.0
    table_func: str | None = None
    modelled: bool = True


def _ns(cycles: float, freq: float) -> float:
    return cycles * 1e9 / freq


def _free(shape) -> int:
    return int(math.prod(shape[1:])) if len(shape) > 1 else 1


def _streams(entry):
    """On-chip accesses that stream through the engine (not (P, 1) per-partition scalars)."""
    accesses = [a for a in (*entry.reads, *entry.writes) if a.memory in _ON_CHIP]
    widest = max((_free(a.shape) for a in accesses), default=1)
    return [a for a in accesses if _free(a.shape) > 1 or widest == 1], widest


def _stream_elems(entry) -> int:
    streams, widest = _streams(entry)
    if streams:
        return widest
    parts = entry.shape[0] if entry.shape else 1
    return max(1, math.ceil(entry.elements / max(parts, 1)))


def _contiguous(access) -> bool:
    size = DTYPE_BYTES.get(access.dtype, 4)
    return access.byte_range[1] - access.byte_range[0] <= _free(access.shape) * size


def _dve_width(entry, hw: HardwareParams) -> float:
    streams, _ = _streams(entry)
    fast = all(a.dtype in hw.dve_fast_dtypes for a in streams) and bool(streams)
    psum = any(a.memory == "psum" for a in streams)
    if fast:
        if not psum and all(_contiguous(a) for a in streams):
            return hw.dve_width_16bit_sbuf
        return hw.dve_width_16bit_other
    if any(a.memory == "psum" and a.dtype == "float32" for a in streams if a in entry.reads):
        return hw.dve_width_psum_fp32
    return hw.dve_width_fp32


def _func_name(entry) -> str:
    func = entry.attrs.get("func", entry.attrs.get("op", "")) or ""
    return str(getattr(func, "__name__", func)).rsplit(".", 1)[-1].lower()


def _pe_cycles(entry, hw: HardwareParams) -> tuple[float, bool]:
    attrs = entry.attrs
    fp32 = any(a.dtype == "float32" for a in entry.reads if a.memory in _ON_CHIP)
    floor = hw.pe_moving_floor_cycles
    if entry.opcode == "nc_transpose":
        src = entry.reads[0].shape if entry.reads else entry.shape
        rate = (hw.pe_fp32_transpose_factor if fp32 else 1) * hw.pe_transpose_factor
        return rate * max(src[0] if src else 1, min(floor, _free(src))), True
    if entry.opcode in ("nc_matmul", "nc_matmul_mx"):
        m = int(attrs.get("M", entry.shape[0] if entry.shape else 1))
        n = int(attrs.get("N", _free(entry.shape)))
        transpose = bool(attrs.get("is_transpose", False))
        rate = (hw.pe_fp32_transpose_factor if transpose else hw.pe_fp32_factor) if fp32 else 1
        if transpose:
            rate *= hw.pe_transpose_factor
        return rate * max(min(floor, m), n), True
    return max(hw.min_ii_cycles, _stream_elems(entry)), False


def _vector_cycles(entry, hw: HardwareParams) -> tuple[float, bool]:
    op, n, ii = entry.opcode, _stream_elems(entry), hw.min_ii_cycles
    if op in ("tensor_copy", "tensor_scalar", "memset"):
        return max(ii, n / _dve_width(entry, hw)), True
    if op == "tensor_tensor":
        streams, _ = _streams(entry)
        ins = [a for a in entry.reads if a in streams]
        one_psum = sum(a.memory == "psum" for a in ins) == 1
        width = _dve_width(entry, hw)
        if width == hw.dve_width_16bit_sbuf:  # all 16-bit in SBUF: the tensor_tensor perf mode
            width = hw.dve_tt_16bit_sbuf_speedup
        passes = 1 if one_psum else 2
        return max(ii, passes * n / width), True
    if op == "tensor_reduce":
        fast = all(a.dtype in ("bfloat16",) for a in (*entry.reads, *entry.writes))
        cheap = fast and _func_name(entry) in ("add", "max", "maximum")
        return max(ii, n / hw.dve_reduce_16bit_speedup if cheap else n), True
    if op == "reciprocal":
        return max(ii, hw.dve_reciprocal_factor * n), True
    if op == "scalar_tensor_tensor":
        return max(ii, 2 * n), True
    if op == "tensor_scalar_reduce":
        return max(ii, n) + hw.dve_scalar_reduce_extra_cycles, True
    if op == "bn_aggr":
        return max(ii, hw.dve_bn_aggr_factor * n), True
    if op == "exponential" and hw.dve_exponential_width:
        return max(ii, n / hw.dve_exponential_width), True
    if op.startswith("tensor_copy_dynamic"):
        return max(hw.dynamic_copy_min_cycles, n), True
    return max(ii, n), op in _DVE_GENERIC


def _scalar_cycles(entry, hw: HardwareParams) -> tuple[float, bool]:
    op, n, ii = entry.opcode, _stream_elems(entry), hw.min_ii_cycles
    if op in _TABLE_OPCODES:
        reduce = bool(entry.attrs.get("reduce", False)) or op == "activation_reduce"
        return max(ii, n / hw.act_width) + (hw.act_reduce_extra_cycles if reduce else 0), True
    if op in ("tensor_copy", "tensor_scalar"):
        streams, _ = _streams(entry)
        fast = bool(streams) and all(a.dtype in ("bfloat16", "float16") for a in streams)
        return max(ii, n / (hw.act_width_16bit_copy if fast else hw.act_width)), True
    return max(ii, n / hw.act_width), False


def _pool_cycles(entry, hw: HardwareParams) -> tuple[float, bool]:
    n = _stream_elems(entry)
    if entry.opcode in ("iota", "affine_select"):
        return hw.pool_start_cycles + n, True
    known = entry.opcode in ("tensor_copy", "tensor_scalar", "tensor_tensor", "memset", "tensor_reduce",
                             "activation", "local_gather", "nc_transpose")
    return max(hw.min_ii_cycles, n / hw.pool_width), known


def dge_mode_of(attrs) -> str:
    """The DGE mode that generates a DMA's descriptors (docs/cost-model.md "DGE").

    ``vector_offset`` (per-partition indices) is served only by software DGE, whatever mode the
    kernel names (``unknown`` resolves to ``swdge``); a named mode is used as named; ``unknown``
    with a runtime ``scalar_offset`` is hardware DGE (dynamic addresses rule out descriptors
    precomputed in HBM; NeuronCore-v3+ has hardware DGE), except a ``dma_transpose`` whose source
    the hardware DGE cannot take (``attrs["hwdge_shape"]`` False: not 16 rows, or a last dim not a
    multiple of 128), which only software DGE can serve; a static ``unknown`` DMA gets precomputed
    descriptors (``none``).
    """
    mode = str(attrs.get("dge_mode", "") or "unknown").rsplit(".", 1)[-1].lower()
    form = attrs.get("indirect")
    if form == "vector" or form is True:
        return "swdge"
    if mode in ("swdge", "hwdge", "none"):
        return mode
    if form == "scalar":
        return "swdge" if attrs.get("hwdge_shape") is False else "hwdge"
    return "none"


def _descriptor_generation(attrs, descriptors: int, hw: HardwareParams) -> tuple[str | None, float]:
    """(engine that generates the descriptors or None, its time in ns) for one DMA."""
    mode = dge_mode_of(attrs)
    if mode == "swdge":
        return "gpsimd", hw.dma_issue_swdge_ns + hw.dma_issue_swdge_per_descriptor_ns * descriptors
    if mode == "hwdge":
        trigger = str(attrs.get("engine") or "sync").rsplit(".", 1)[-1].lower()
        return ("scalar" if trigger in ("scalar", "act", "activation") else "sync"), hw.dma_issue_hwdge_ns
    return None, hw.dma_issue_static_ns


def _hbm_passes(entry) -> int:
    """How many times a DMA's bytes cross HBM: once per HBM-side read and once per HBM-side write
    (docs/cost-model.md §7.3): 1 for a load or a store, 2 for an HBM-to-HBM copy or a
    read-modify-write of HBM (``dma_compute``'s scatter RMW reads its destination and writes it)."""
    return max(1, sum(a.memory in _HBM for a in (*entry.reads, *entry.writes)))


def _dma_cost(entry, hw: HardwareParams) -> InstrCost:
    attrs = entry.attrs
    on_chip = [a for a in (*entry.writes, *entry.reads) if a.memory in _ON_CHIP]
    if on_chip:
        rows = max(1, on_chip[0].partitions[1] - on_chip[0].partitions[0])
    else:
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
    total = max(1, int(entry.bytes))
    row_bytes = total / rows
    chunk = float(attrs.get("contiguous_bytes") or row_bytes)
    chunk = min(max(chunk, 1.0), row_bytes)
    chunks_per_row = math.ceil(row_bytes / chunk - 1e-9)
    engines = min(hw.dma_engines, math.ceil(rows / hw.dma_partitions_per_engine))
    rows_per_engine = math.ceil(rows / engines)
    memories = {a.memory for a in (*entry.reads, *entry.writes)} | {attrs.get("src_memory"), attrs.get("dst_memory")}
    hbm = bool(memories & set(_HBM))
    bw = min(hw.dma_bw_per_engine, hw.hbm_bw_share / hw.dma_engines / _hbm_passes(entry)) if hbm \
        else hw.dma_bw_per_engine
    if entry.opcode == "dma_transpose":
        bw *= hw.dma_transpose_eff_hbm if hbm else hw.dma_transpose_eff_sbuf
    service = rows_per_engine * chunks_per_row * max(chunk / bw, hw.dma_chunk_floor_ns)
    issue_engine, issue = _descriptor_generation(attrs, rows * chunks_per_row, hw)
    known = entry.opcode in ("dma_copy", "dma_transpose", "dma_compute", "sendrecv")
    return InstrCost("dma", service, hw.dma_latency_ns, dma_engines=engines, issue_engine=issue_engine,
                     issue_ns=issue, modelled=known)


def instruction_cost(entry, hw: HardwareParams) -> InstrCost:
    """The cost of one trace entry on the target described by ``hw``."""
    engine = entry.engine
    if engine == "dma" or entry.opcode in ("dma_copy", "dma_transpose", "dma_compute", "sendrecv"):
        return _dma_cost(entry, hw)
    if engine == "tensor":
        cycles, known = _pe_cycles(entry, hw)
        return InstrCost("tensor", _ns(cycles, hw.f_pe), hw.pe_result_latency_ns, modelled=known)
    if engine == "vector":
        cycles, known = _vector_cycles(entry, hw)
        return InstrCost("vector", _ns(cycles, hw.f_dve), hw.dve_completion_ns, modelled=known)
    if engine == "scalar":
        cycles, known = _scalar_cycles(entry, hw)
        func = _func_name(entry) if entry.opcode in _TABLE_OPCODES else None
        table = func if func and func not in hw.act_table_free_functions else None
        return InstrCost("scalar", _ns(cycles, hw.f_act), hw.act_completion_ns, table_func=table, modelled=known)
    if engine == "gpsimd":
        cycles, known = _pool_cycles(entry, hw)
        return InstrCost("gpsimd", _ns(cycles, hw.f_pool), _ns(hw.pool_completion_cycles, hw.f_pool), modelled=known)
    if engine == "sync":
        if entry.opcode in ("core_barrier", "barrier"):
            return InstrCost("sync", _ns(hw.sync_op_cycles, hw.f_act), hw.barrier_ns)
        return InstrCost("sync", _ns(hw.sync_op_cycles, hw.f_act), 0.0, modelled=entry.opcode in _SYNC_OPS)
    raise ValueError(f"trace entry {entry.index} ({entry.opcode}): unknown engine {engine!r}")
