"""``nki.isa`` enums (docs/nki-semantics.md §7.5); re-exported by ``nki.isa`` and ``nki.isa.constants``."""

from __future__ import annotations

from enum import Enum

__all__ = ["engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine",
           "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine", "sync_engine"]


class engine(Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    error = 0
    skip = 1


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(Enum):
    """NeuronCore generation; members order (``>=``) as well as compare equal."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __ge__(self, other):
        return self.value >= other.value if isinstance(other, nc_version) else NotImplemented

    def __gt__(self, other):
        return self.value > other.value if isinstance(other, nc_version) else NotImplemented

    def __le__(self, other):
        return self.value <= other.value if isinstance(other, nc_version) else NotImplemented

    def __lt__(self, other):
        return self.value < other.value if isinstance(other, nc_version) else NotImplemented


class dma_engine(Enum):
    dma = 1
    gpsimd_dma = 2


# deprecated module-level aliases still used by kernels
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown
sync_engine = engine.sync
