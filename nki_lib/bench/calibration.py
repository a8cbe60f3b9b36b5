"""Calibration table: public Trainium measurements vs the cost model on the same cases.

Each :class:`Measured` case is a figure measured on a device and published (AWS documentation,
or a third-party probe where AWS gives nothing), with its source and generation. Where the case
is a small kernel, it is rebuilt here as an NKI kernel, run on the simulator, and the figure the
source reports is read off the cost model's schedule (``estimate(..., keep_timeline=True)``) or
its instruction costs, the same quantity the source measured (e.g. a DMA's transfer time without
its 1.3 us completion latency when the source's profiler shows that). ``rows()`` returns the
table; ``benchmarks/calibration.py`` writes it into ``docs/calibration.md``.

Nothing here adjusts a constant: the table shows where the model and the measurements differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from nki_lib.sizes import dtype_bytes

__all__ = ["Measured", "CASES", "rows", "markdown"]


@dataclass(frozen=True)
class Measured:
    """One published measurement and how to reproduce it on the model."""

    name: str
    quantity: str
    measured: float          # in ``unit``
    unit: str
    hardware: str
    source: str
    model: Callable[[], float]   # the model's figure for the same quantity, in ``unit``


def _kernels():
    """The probe kernels, built on first use (importing the simulator is not free)."""
    from nki_lib.simulator import isa as nisa
    from nki_lib.simulator import jit
    from nki_lib.simulator import language as nl

    def dma_load(src):
        """One HBM -> SBUF dma_copy of ``src`` (P, F), then a store back."""
        out = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.shared_hbm)
        tile_sb = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile_sb, src=src)
        nisa.dma_copy(dst=out, src=tile_sb)
        return out

    def add(a, b):
        """The nrtpy tutorial's kernel: out = a + b for (4, 3) fp16 (two loads, one add, one store)."""
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        a_sb = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        b_sb = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=a)
        nisa.dma_copy(dst=b_sb, src=b)
        sum_sb = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sum_sb, data1=a_sb, data2=b_sb, op=nl.add)
        nisa.dma_copy(dst=out, src=sum_sb)
        return out

    return {"dma_load": jit(dma_load), "add": jit(add)}


_KERNELS: dict = {}


def _kernel(name):
    if not _KERNELS:
        _KERNELS.update(_kernels())
    return _KERNELS[name]


def _run(kernel_name, *arrays):
    from nki_lib.simulator import last_run, simulate
    from nki_lib.simulator.profile import estimate

    simulate(_kernel(kernel_name))(*arrays)
    return estimate(last_run(), "trn2", keep_timeline=True)


def _first_dma_transfer_ns(rows: int, row_bytes: int) -> float:
    """Service time (start to end of the transfer, no completion latency) of one HBM->SBUF DMA."""
    src = np.ones((rows, row_bytes // 2), dtype=np.float16)
    est = _run("dma_load", src)
    _, _, _, start, end, _ = next(r for r in est.timeline if r[2] == "dma_copy")
    return end - start


def _dma_efficiency(row_bytes: int) -> float:
    """Fraction of the 16-engine peak one 128-partition DMA of ``row_bytes`` per partition reaches."""
    from nki_lib.simulator.profile import params

    hw = params("trn2")
    ideal = 128 * row_bytes / (hw.dma_engines * min(hw.dma_bw_per_engine, hw.hbm_bw_share / hw.dma_engines))
    return ideal / _first_dma_transfer_ns(128, row_bytes)


def _add_kernel_us() -> float:
    a = np.ones((4, 3), dtype=np.float16)
    return _run("add", a, a.copy()).time_ns * 1e-3


def _instruction(engine: str, opcode: str, shape, dtype: str, reads_psum: bool = False, **attrs):
    """Service and completion latency of one hand-made instruction (ns)."""
    from nki_lib.simulator.profile import instruction_cost, params
    from nki_lib.simulator.trace import Access, TraceEntry

    size = dtype_bytes(dtype)
    free = int(np.prod(shape[1:]))
    src = Access(1, "psum" if reads_psum else "sbuf", (0, shape[0]), (0, free * size), tuple(shape), dtype)
    dst = Access(2, "sbuf", (0, shape[0]), (0, free * size), tuple(shape), dtype)
    entry = TraceEntry(0, 0, engine, opcode, (src,), (dst,), tuple(shape), dtype, int(np.prod(shape)),
                       int(np.prod(shape)) * size, attrs)
    cost = instruction_cost(entry, params("trn2"))
    return cost.service_ns, cost.latency_ns


def _fp32_matmul(which: str) -> float:
    from nki_lib.simulator.profile import instruction_cost, params
    from nki_lib.simulator.trace import Access, TraceEntry

    stat = Access(1, "sbuf", (0, 128), (0, 512), (128, 128), "float32")
    mov = Access(2, "sbuf", (0, 128), (0, 512), (128, 128), "float32")
    out = Access(3, "psum", (0, 128), (0, 512), (128, 128), "float32")
    entry = TraceEntry(0, 0, "tensor", "nc_matmul", (stat, mov), (out,), (128, 128), "float32", 128 * 128,
                       128 * 128 * 4, {"M": 128, "N": 128})
    cost = instruction_cost(entry, params("trn2"))
    return cost.service_ns if which == "service" else cost.service_ns + cost.latency_ns


def _const(name: str) -> float:
    from nki_lib.simulator.profile import params

    return float(getattr(params("trn2"), name))


_VOYAGER = "Voyager (third-party trn2 probes, docs/cost-model.md §3)"
_DMA_FIG = "dma-overview throughput-vs-size figure, read off the unlabeled plot (docs/cost-model.md §2.6)"

CASES = (
    Measured("DMA, one engine, 32 KiB (8 partitions x 4 KiB)", "transfer time (profiler duration)", 1416.0, "ns",
             "trn2", "dma-overview: one engine moved 32 KiB in 1,416 ns (docs/cost-model.md §2.6)",
             lambda: _first_dma_transfer_ns(8, 4096)),
    *(Measured(f"DMA, 128 partitions x {b} B", "fraction of peak DMA throughput", m, "fraction", "trn2", _DMA_FIG,
               lambda b=b: _dma_efficiency(b))
      for b, m in ((512, 0.21), (1024, 0.42), (2048, 0.81), (4096, 0.97))),
    Measured("nrtpy tutorial add kernel, (4, 3) fp16", "device time, mean of 100", 3.2, "us",
             "not stated", "nrtpy tutorial-validate-benchmark: mean 0.0032 ms, min 0.0030 ms "
             "(docs/cost-model.md §2.7)", _add_kernel_us),
    Measured("fp32 matmul 128 x 128 x 128", "TensorE service", 213.0, "ns", "trn2", _VOYAGER,
             lambda: _fp32_matmul("service")),
    Measured("fp32 matmul 128 x 128 x 128", "issue to result consumable", 808.0, "ns", "trn2", _VOYAGER,
             lambda: _fp32_matmul("consumable")),
    Measured("VectorE fp32 tensor_scalar, 128 x 2048", "service", 2048 / 2 / 0.96, "ns", "trn2",
             _VOYAGER + ": half the documented N cycles at 0.96 GHz",
             lambda: _instruction("vector", "tensor_scalar", (128, 2048), "float32")[0]),
    Measured("VectorE dependent instruction", "completion intercept", 160.0, "ns", "trn2", _VOYAGER,
             lambda: _instruction("vector", "tensor_scalar", (128, 2048), "float32")[1]),
    Measured("ScalarE fp32 SBUF copy, 128 x 2048", "service (0.83 ns per element)", 0.83 * 2048, "ns", "trn2",
             _VOYAGER, lambda: _instruction("scalar", "tensor_copy", (128, 2048), "float32")[0]),
    Measured("ScalarE copy", "completion intercept", 190.0, "ns", "trn2", _VOYAGER,
             lambda: _instruction("scalar", "tensor_copy", (128, 2048), "float32")[1]),
    Measured("ACT_TABLE_LOAD", "duration", 1283.0, "ns", "trn2", _VOYAGER, lambda: _const("act_table_load_ns")),
)


def rows() -> list[dict]:
    """One dict per case: the published figure, the model's, and their ratio (model / measured)."""
    out = []
    for case in CASES:
        model = float(case.model())
        out.append({"case": case.name, "quantity": case.quantity, "hardware": case.hardware, "unit": case.unit,
                    "measured": case.measured, "model": model, "ratio": model / case.measured,
                    "source": case.source})
    return out


def markdown(table: list[dict]) -> str:
    """The table as Markdown (figures with 3 significant digits)."""
    lines = ["| case | quantity | hardware | measured | model | model / measured | source |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        unit = "" if r["unit"] == "fraction" else f" {r['unit']}"
        lines.append(f"| {r['case']} | {r['quantity']} | {r['hardware']} | {_num(r['measured'])}{unit} | "
                     f"{_num(r['model'])}{unit} | {r['ratio']:.2f} | {r['source']} |")
    return "\n".join(lines)


def _num(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:,.0f}"
