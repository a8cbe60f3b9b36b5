"""The ONE table of hardware constants used by the cost model, with source and confidence.

Every number the model uses lives here, per target (``trn2`` = NeuronCore-v3, ``trn3`` =
NeuronCore-v4), as a :class:`Param` carrying its value, unit, source and confidence tag.
Each ``source`` names the section of ``docs/cost-model.md`` that gives the number with the
public page (AWS Neuron documentation, or a named third-party measurement) it comes from.
Confidence tags follow that document:

* ``H``: stated in current official AWS Neuron material for that generation;
* ``M``: official but for an older generation, inconsistent between pages, or derived by simple
  arithmetic from ``H`` numbers;
* ``L``: third-party measurement, fit or inference: a prior to calibrate on hardware (§7.8).

Rules for changing this file: a value changes only together with a cited source. Nothing here
is tuned to make a kernel look good. ``trn3`` starts from ``trn2`` and overrides what the
Trn3 documentation changes ("reuse trn2 values until calibrated", docs/cost-model.md §7.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["Param", "HardwareParams", "TARGETS", "params", "low_confidence"]

DOC = "docs/cost-model.md"


@dataclass(frozen=True)
class Param:
    """One model constant: ``value`` in ``unit``, where it comes from, and how sure we are."""

    value: Any
    unit: str
    source: str
    confidence: str  # "H" | "M" | "L"
    bounds: tuple | None = None   # (low, high) a low-confidence value may take (docs/cost-model.md §7.9)
    bounds_source: str = ""

    def __post_init__(self) -> None:
        if self.confidence not in ("H", "M", "L"):
            raise ValueError(f"confidence must be H, M or L, got {self.confidence!r}")
        if self.bounds is not None:
            low, high = self.bounds
            if not low <= self.value <= high or not self.bounds_source:
                raise ValueError(f"bounds {self.bounds} must contain the value {self.value!r} and cite a source")


SENS = "docs/cost-model.md §7.9"


def _bounded(param: Param, low, high, why: str) -> Param:
    """``param`` with documented sensitivity bounds (each bound's source in ``why``)."""
    return Param(param.value, param.unit, param.source, param.confidence, (low, high), f"{SENS}: {why}")


_TRN2: dict[str, Param] = {
    # ---- clocks (§1.2, §7.1)
    "f_pe": Param(2.4e9, "Hz", f"{DOC} §1.2 TensorE clock (trainium2_arch.rst)", "H"),
    "f_dve": Param(0.96e9, "Hz", f"{DOC} §1.2 VectorE clock (trainium2_arch.rst)", "H"),
    "f_act": Param(1.2e9, "Hz", f"{DOC} §1.2 ScalarE clock (trainium2_arch.rst)", "H"),
    "f_pool": Param(1.2e9, "Hz", f"{DOC} §1.2 GpSimdE clock (trainium2_arch.rst)", "H"),
    # ---- TensorE (§2.1, §7.2)
    "pe_macs_per_cycle": Param(
        MappingProxyType({"bfloat16": 16384, "float16": 16384, "tfloat32": 16384, "float8": 16384,
                          "float8_double_row": 32768, "float32": 4096}),
        "MAC/cycle", f"{DOC} §1.2 / §7.1 per-dtype TensorE rates (128x128 PEs; fp32 1/4 rate)", "H"),
    "pe_moving_floor_cycles": Param(64, "PE cycles",
                                    f"{DOC} §2.1 matmul cost max(min(64, N_stationary), N_moving); "
                                    "MM_INIT_LATENCY = 64 (ISA doc v2.26, arch guide)", "M"),
    "pe_fp32_factor": Param(4, "x", f"{DOC} §2.1 FP32 inputs cost 4x (ISA doc v2.26)", "M"),
    "pe_fp32_transpose_factor": Param(2, "x", f"{DOC} §2.1 v3+ transpose mode: fp32 2x faster than fp32 "
                                      "matmul (trainium2_arch.rst)", "H"),
    "pe_transpose_factor": Param(1.0, "x", f"{DOC} §2.1 background transpose is NC-v4 only", "H"),
    "pe_result_latency_ns": Param(600.0, "ns", f"{DOC} §7.1 pe_result_latency (issue -> PSUM visible), "
                                  "third-party Trn2 probe 808 ns total - 213 ns service (§2.7)", "L"),
    "pe_throttle_start_frac": Param(0.5, "fraction", f"{DOC} §2.1 dI/dt throttle: TensorE starts at ~50% "
                                    "(neuron-explorer overview-summary-page.rst)", "H"),
    "pe_throttle_ramp_ns": Param(3000.0, "ns", f"{DOC} §2.1 throttle ramps to full over ~3 us", "H"),
    "pe_throttle_util_threshold": Param(0.5, "fraction", f"{DOC} §2.1 limit re-engages below 50% "
                                        "utilisation over a ~3 us window", "H"),
    # ---- VectorE / ScalarE / GpSimd streaming (§2.2-§2.4, §7.1, §7.2)
    "lanes": Param(128, "lanes", f"{DOC} §1.2 128 partitions / compute lanes per engine", "H"),
    "dve_reduce_16bit_speedup": Param(2, "x", f"{DOC} §2.2 tensor_reduce N/2 for bf16 in and out with "
                                      "add or max (ISA doc v2.26)", "M"),
    "min_ii_cycles": Param(64, "engine cycles", f"{DOC} §2 MIN_II ~64 cycles (nki.api.shared.rst)", "H"),
    "dve_width_16bit_sbuf": Param(4, "elem/lane/cycle", f"{DOC} §2.2 NC-v3 perf mode 4x for tensor_copy/"
                                  "tensor_scalar, SBUF->SBUF, BF16/FP16, contiguous (trainium2_arch.rst)", "H"),
    "dve_width_16bit_other": Param(2, "elem/lane/cycle", f"{DOC} §2.2 NC-v3 perf mode 2x when not contiguous "
                                   "or one side in PSUM (trainium2_arch.rst)", "H"),
    "dve_width_fp32": Param(2, "elem/lane/cycle", f"{DOC} §3 Voyager Trn2 probe: fp32 tensor_scalar/"
                            "tensor_tensor service 0.5x the documented estimate (docs baseline 1)", "L"),
    "dve_width_psum_fp32": Param(1, "elem/lane/cycle", f"{DOC} §7.1 dve_width.psum_fp32_source", "M"),
    "dve_tt_16bit_sbuf_speedup": Param(2, "x", f"{DOC} §2.2 NC-v3 2x for tensor_tensor, both inputs SBUF, "
                                       "all BF16/FP16 (trainium2_arch.rst)", "H"),
    "dve_fast_dtypes": Param(("bfloat16", "float16"), "dtypes", f"{DOC} §1.2 VectorE 512 elem/cycle for "
                             "BF16/FP16 (trainium2_arch.rst)", "H"),
    "dve_reciprocal_factor": Param(8, "x", f"{DOC} §2.2 reciprocal max(64, 8N) (ISA doc v2.26)", "M"),
    "dve_scalar_reduce_extra_cycles": Param(64, "DVE cycles", f"{DOC} §2.2 tensor_scalar_reduce "
                                            "max(64, N) + 64 (ISA doc v2.26)", "M"),
    "dve_bn_aggr_factor": Param(13 / 3, "x", f"{DOC} §2.2 bn_aggr max(64, 13N/3) (ISA doc v2.26)", "M"),
    "dve_exponential_width": Param(None, "elem/lane/cycle", f"{DOC} §2.2 nisa.exponential is NC-v4 only", "H"),
    "dynamic_copy_min_cycles": Param(600, "DVE cycles", f"{DOC} §2.2 tensor_copy_dynamic_src/dst minimum "
                                     "II ~600 cycles (ISA doc v2.26)", "M"),
    "act_width": Param(1, "elem/lane/cycle", f"{DOC} §1.2 ScalarE 128 elem/cycle (trainium2_arch.rst)", "H"),
    "act_width_16bit_copy": Param(1, "elem/lane/cycle", f"{DOC} §2.3 the 2x BF16 ScalarE copy/tensor_scalar "
                                  "mode is NC-v4 only", "H"),
    "act_reduce_extra_cycles": Param(64, "ACT cycles", f"{DOC} §2.3 activation_reduce max(64, N) + 64 "
                                     "(ActReadAccumulator)", "M"),
    "act_table_load_ns": Param(1283.0, "ns", f"{DOC} §3 Voyager Trn2 ACT_TABLE_LOAD ~1,283 ns "
                               "(AWS gives no figure)", "L"),
    "act_table_free_functions": Param(("copy", "identity", "bypass"), "function names",
                                      "inference: pass-through functions need no lookup table, so "
                                      f"they do not switch the table set ({DOC} §2.3/§8: grouping unknown)", "L"),
    "pool_width": Param(1, "elem/lane/cycle", f"{DOC} §1.2 GpSimd 8 cores x 16 fp32 lanes, 16 partitions per "
                        "core (NC-v2 figures)", "M"),
    "pool_start_cycles": Param(150, "POOL cycles", f"{DOC} §2.4 iota/affine_select 150 + N", "M"),
    # ---- completion (semaphore) latency a dependent instruction waits for (§2.7, §7.4)
    "dve_completion_ns": Param(159.0, "ns", f"{DOC} §2.7 dependent VectorE intercept ~159 ns (third-party)", "L"),
    "act_completion_ns": Param(190.0, "ns", f"{DOC} §2.7 ScalarE copy intercept ~190 ns (third-party)", "L"),
    "pool_completion_cycles": Param(100, "POOL cycles", f"{DOC} §2.2 ~100-cycle static overhead for "
                                    "dependent back-to-back instructions (NC-v2 arch guide)", "M"),
    "sync_op_cycles": Param(64, "SP cycles", f"{DOC} §2 MIN_II applied to register/sync ops; SP clock "
                            "taken as f_act (undocumented)", "L"),
    # ---- DMA (§2.6, §7.3)
    "dma_engines": Param(16, "engines", f"{DOC} §1.2 DMA engines per core (nki-dma-overview.rst)", "H"),
    "dma_partitions_per_engine": Param(8, "partitions", f"{DOC} §2.6 each engine covers 8 partitions of a "
                                       "128-partition tile (nki-dma-overview.rst)", "H"),
    "dma_bw_per_engine": Param(23.0, "B/ns", f"{DOC} §1.2 practical peak per engine "
                               "(nki-dma-bandwidth-guide.rst)", "H"),
    "dma_chunk_floor_ns": Param(105.0, "ns", f"{DOC} §2.6 fit to the throughput-vs-bytes curve: each "
                                "contiguous chunk costs max(B/BW, ~105 ns)", "L"),
    "dma_latency_ns": Param(1300.0, "ns", f"{DOC} §2.6 ~1300 ns trigger -> semaphore latency "
                            "(nki-dma-bandwidth-guide.rst)", "H"),
    "dma_issue_hwdge_ns": Param(600.0, "ns", f"{DOC} §2.6 hwdge ~600 ns per DMA instruction on SP/ACT "
                                "(nki-dge.rst)", "H"),
    "dma_issue_swdge_ns": Param(1000.0, "ns", f"{DOC} §7.3 swdge GpSimd issue, start value 1 us", "L"),
    "dma_issue_swdge_per_descriptor_ns": Param(50.0, "ns", f"{DOC} §7.3 swdge ~50 ns per descriptor", "L"),
    "dma_issue_static_ns": Param(100.0, "ns", f"{DOC} §7.3 static DGE (precomputed descriptors) ~0.1 us", "L"),
    "dma_transpose_eff_hbm": Param(0.9, "fraction", f"{DOC} §2.6 DMA transpose HBM->SBUF up to 90%", "H"),
    "dma_transpose_eff_sbuf": Param(0.5, "fraction", f"{DOC} §2.6 DMA transpose SBUF->SBUF up to 50%", "H"),
    "hbm_bw_share": Param(362.5, "B/ns", f"{DOC} §1.2 chip HBM 2.9 TB/s / 8 cores", "M"),
    "barrier_ns": Param(1300.0, "ns", f"{DOC} §7.5 cross-core barrier undocumented: use the DMA latency", "L"),
    "neuronlink_bw_chip": Param(1280.0, "B/ns", f"{DOC} §1.1 NeuronLink-v3 1.28 TB/s per chip (hw-trn2)", "H"),
    "neuronlink_links": Param(4, "links", f"{DOC} §1.1 4 NeuronLink-v3 per chip (arch-trn2)", "H"),
    "cores_per_chip": Param(8, "NeuronCores", f"{DOC} §1.1 8 NeuronCore-v3 per chip (hw-trn2)", "H"),
    # ---- memories (§1.2)
    "sbuf_bytes_per_partition": Param(212984, "B", f"{DOC} §1.2 usable SBUF per partition (nkipy "
                                      "HardwareConstants.h)", "M"),
    "psum_banks": Param(8, "banks", f"{DOC} §1.2 PSUM 8 banks x 2 KiB per partition", "H"),
    "psum_bank_bytes": Param(2048, "B", f"{DOC} §1.2 PSUM bank = 2 KiB per partition", "H"),
    # ---- fixed per-kernel cost (§2.7)
    "kernel_launch_ns": Param(3200.0, "ns", f"{DOC} §2.7 trivial kernel 3.2 us mean device time "
                              "(nrtpy tutorial-validate-benchmark.rst; 3-10 us range)", "M"),
}

_BOUNDS = {
    "pe_result_latency_ns": (27.0, 808.0,
        "low: MM_INIT_LATENCY 64 PE cycles at 2.4 GHz (§2.1); high: the whole 808 ns issue-to-consumable "
        "figure of the third-party probe (§2.7)"),
    "dve_width_fp32": (1, 2,
        "low: the isa-2.26 estimate, 1 element/lane/cycle (§2.2); high: 256 elements/cycle of arch-trn2 and "
        "the third-party probe (§2.2, §3)"),
    "act_table_load_ns": (0.0, 1283.0,
        "low: no load when the functions share a table set (grouping unpublished, §2.3, §8); high: the only "
        "measurement, 1,283 ns (§3)"),
    "dve_completion_ns": (104.0, 274.0,
        "low: the ~100-cycle static overhead of dependent instructions at 0.96 GHz (arch-v2, §2.2); high: the"
        " longest third-party intercept, 274 ns (§2.7)"),
    "act_completion_ns": (83.0, 274.0,
        "low: the ~100-cycle static overhead at 1.2 GHz (arch-v2, §2.2); high: the third-party ScalarE "
        "PSUM->SBUF copy, 265-274 ns (§2.7)"),
    "sync_op_cycles": (64, 164,
        "low: MIN_II 64 cycles (shared, §2); high: MIN_II + the ~100-cycle dependent-instruction overhead "
        "(arch-v2, §2.2)"),
    "dma_chunk_floor_ns": (89.0, 178.0,
        "low: 2 KiB per partition is close to peak (dma-bw), so the floor is at least 2048 B / 23 B/ns; high:"
        " 4 KiB saturates (dma-bw), so at most 4096 B / 23 B/ns (§2.6)"),
    "dma_issue_swdge_ns": (600.0, 1300.0,
        "low: a hardware-DGE instruction, 600 ns (dge, §2.6); high: the whole DMA fixed latency, 1300 ns "
        "(dma-bw, §2.6); no published figure"),
    "dma_issue_swdge_per_descriptor_ns": (6.7, 105.0,
        "low: one MIN_II (64-cycle) GpSimd instruction per descriptor on each of the 8 GpSimd cores at 1.2 "
        "GHz (§1.2, §2); high: the DMA per-chunk floor, 105 ns (§2.6); no published figure"),
    "dma_issue_static_ns": (0.0, 600.0,
        "low: no on-device generation for precomputed descriptors (dge); high: hardware DGE's 600 ns, since "
        "precomputed descriptors have the lowest latency (dge, §2.6)"),
    "barrier_ns": (190.0, 2600.0,
        "low: one semaphore hand-off, ~190 ns (third-party, §2.7); high: a DMA semaphore round trip to the "
        "other core, 2 x 1300 ns (dma-bw, §2.6)"),
}
for _name, (_low, _high, _why) in _BOUNDS.items():
    _TRN2[_name] = _bounded(_TRN2[_name], _low, _high, _why)

_TRN3_OVERRIDES: dict[str, Param] = {
    "f_dve": Param(1.2e9, "Hz", f"{DOC} §1.2 VectorE clock (trainium3_arch.rst)", "H"),
    "pe_macs_per_cycle": Param(
        MappingProxyType({"bfloat16": 16384, "float16": 16384, "tfloat32": 16384, "float8": 16384,
                          "float8_double_row": 32768, "mx": 65536, "float32": 4096}),
        "MAC/cycle", f"{DOC} §1.2 / §7.1 NC-v4 rates (MXFP8/MXFP4 4x bf16)", "H"),
    "dve_width_16bit_sbuf": Param(4, "elem/lane/cycle", f"{DOC} §1.2 VectorE 512 elem/cycle for "
                                  "BF16/FP16/FP8 (trainium3_arch.rst)", "H"),
    "pe_transpose_factor": Param(0.5, "x", f"{DOC} §7.2 NC-v4 background transpose: charge 0.5x "
                                 "(overlaps other matmuls; the hardware decides when)", "M"),
    "dve_width_fp32": Param(2, "elem/lane/cycle", f"{DOC} §1.2 VectorE 256 elem/cycle for other dtypes "
                            "(trainium3_arch.rst)", "H"),
    "dve_fast_dtypes": Param(("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3"), "dtypes",
                             f"{DOC} §1.2 VectorE 512 elem/cycle for BF16/FP16/FP8 (trainium3_arch.rst)", "H"),
    "dve_exponential_width": Param(4, "elem/lane/cycle", f"{DOC} §2.2 nisa.exponential at 4x ScalarE exp "
                                   "(trainium3_arch.rst)", "H"),
    "act_width_16bit_copy": Param(2, "elem/lane/cycle", f"{DOC} §2.3 NC-v4 ScalarE 2x BF16/FP16 mode for "
                                  "tensor_scalar/tensor_copy (trainium3_arch.rst)", "H"),
    "dma_bw_per_engine": Param(33.0, "B/ns", f"{DOC} §1.2 practical peak per engine "
                               "(nki-dma-bandwidth-guide.rst)", "H"),
    "hbm_bw_share": Param(612.0, "B/ns", f"{DOC} §1.2 chip HBM 4.9 TB/s / 8 cores", "M"),
    "sbuf_bytes_per_partition": Param(245752, "B", f"{DOC} §1.2 usable SBUF per partition (nkipy "
                                      "HardwareConstants.h)", "M"),
}

TARGETS: MappingProxyType = MappingProxyType({
    "trn2": MappingProxyType(dict(_TRN2)),
    "trn3": MappingProxyType({**_TRN2, **_TRN3_OVERRIDES}),
})


class HardwareParams:
    """Read-only view of one target's table: ``hw.f_pe`` is the value, ``hw.param("f_pe")`` the Param."""

    def __init__(self, target: str, table=None):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
        self.target = target
        self._table = TARGETS[target] if table is None else table
        for name, param in self._table.items():  # plain attributes: the cost rules read them often
            setattr(self, name, param.value)

    def with_values(self, source: str, **values) -> "HardwareParams":
        """A copy with some constants set to plain values (sensitivity runs, ``nki-lib bench --set``).

        Each keeps its unit and bounds; ``source`` says where the value comes from.
        """
        changes = {}
        for name, value in values.items():
            if name not in self._table:
                raise ValueError(f"no cost-model constant {name!r}; known: {', '.join(sorted(self._table))}")
            old = self._table[name]
            if not isinstance(old.value, (int, float)) or isinstance(old.value, bool):
                raise ValueError(f"{name}: only numeric constants can be set, this one is {old.value!r}")
            changes[name] = Param(type(old.value)(value) if isinstance(old.value, float) else value, old.unit,
                                  source, old.confidence)
        return self.replace(**changes)

    def replace(self, **changes: Param) -> "HardwareParams":
        """A copy with some constants replaced, e.g. by calibration on hardware (docs/cost-model.md §7.8).

        Each new value must be a :class:`Param` with its own source and confidence; the table
        in this module stays the reference for what is published.
        """
        for name, value in changes.items():
            if name not in self._table:
                raise ValueError(f"no cost-model constant {name!r}")
            if not isinstance(value, Param):
                raise TypeError(f"{name}: pass a Param(value, unit, source, confidence), got {type(value).__name__}")
        return HardwareParams(self.target, MappingProxyType({**self._table, **changes}))

    def __getattr__(self, name: str) -> Any:
        table = self.__dict__.get("_table")
        if table is None or name not in table:
            raise AttributeError(f"no cost-model constant {name!r}")
        return table[name].value

    def param(self, name: str) -> Param:
        return self._table[name]

    def items(self):
        return self._table.items()

    # ---- derived peaks (docs/cost-model.md §7.6), per physical core
    def pe_peak_flops(self, dtype: str = "bfloat16") -> float:
        """Dense TensorE peak in FLOP/s: 2 FLOPs per MAC * MACs/cycle(dtype) * f_pe."""
        macs = self.pe_macs_per_cycle
        key = dtype if dtype in macs else ("float8" if dtype.startswith("float8") else None)
        if key is None:
            raise ValueError(f"dtype {dtype!r} has no TensorE rate on {self.target}; known: {sorted(macs)}")
        return 2.0 * macs[key] * self.f_pe

    def dma_bandwidth(self) -> float:
        """Sustained HBM<->SBUF bandwidth of one core in B/ns = GB/s: min(16 * BW_e, HBM share)."""
        return min(self.dma_engines * self.dma_bw_per_engine, self.hbm_bw_share)


_CACHE: dict[str, HardwareParams] = {}


def params(target: str) -> HardwareParams:
    """The constants of ``target`` ("trn2" or "trn3")."""
    if target not in _CACHE:
        _CACHE[target] = HardwareParams(target)
    return _CACHE[target]


def low_confidence(hw: HardwareParams) -> dict[str, tuple]:
    """The low-confidence (``L``) constants of ``hw`` that have documented bounds: name -> (low, high)."""
    return {name: p.bounds for name, p in hw.items() if p.confidence == "L" and p.bounds is not None}
