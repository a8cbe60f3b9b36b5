"""Run statistics and the instruction trace recorded by the simulator (a cost model reads these)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Access", "TraceEntry", "RunReport"]


@dataclass(frozen=True)
class Access:
    buffer_id: int               # unique per allocation within one run
    memory: str                  # "hbm" | "shared_hbm" | "private_hbm" | "sbuf" | "psum"
    partitions: tuple            # [start, stop) partitions touched ((0, 1) for HBM)
    byte_range: tuple            # [start, stop) bounding byte range within each partition (HBM: flat buffer)
    shape: tuple                 # shape of the view
    dtype: str                   # numpy dtype name: "bfloat16", "float32", "int32", ...
    placed: bool = False         # on-chip tile placed with address=: partitions/byte_range are physical


@dataclass
class TraceEntry:
    index: int                   # position in program order (per program)
    program_id: int
    engine: str                  # "tensor" | "vector" | "scalar" | "gpsimd" | "dma" | "sync"
    opcode: str                  # nisa name, e.g. "nc_matmul"
    reads: tuple
    writes: tuple
    shape: tuple                 # iteration shape of the output; nc_matmul: PSUM result (M, N)
    dtype: str                   # output dtype
    elements: int                # output elements (partition x free)
    bytes: int                   # bytes written (DMA: bytes moved)
    attrs: dict = field(default_factory=dict)
    source: str = ""             # "file.py:LINE" of the kernel source line


@dataclass
class RunReport:
    kernel: str            # kernel function __qualname__
    target: str            # "trn2" | "trn3"
    grid: int              # LNC degree (1 or 2)
    instructions: int      # executed nisa instructions (all programs)
    peak_sbuf_bytes: int   # peak live SBUF bytes per partition (max over programs)
    peak_psum_bytes: int   # peak live PSUM bytes per partition
    peak_psum_banks: int   # peak number of PSUM banks in use
    trace: list | None     # None when recording is off
