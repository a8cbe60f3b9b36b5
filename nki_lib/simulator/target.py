"""Hardware targets (trn2 = NeuronCore-v3 / gen3, trn3 = NeuronCore-v4 / gen4) and ``tile_size``."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["TargetSpec", "set_target", "get_target", "target_spec", "tile_size", "TARGETS"]

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class TargetSpec:
    name: str                 # "trn2" | "trn3"
    gen: int                  # nc_version value: 3 (trn2) or 4 (trn3)
    sbuf_size_bytes: int      # whole SBUF
    sbuf_usable_bytes: int    # usable bytes per partition (docs/nki-semantics.md §3.2)
    pmax: int = 128
    psum_bank_bytes: int = 2 * KIB
    psum_num_banks: int = 8
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    matmul_fp32_nmax: int = 512     # max moving free size with an fp32 PSUM result
    matmul_bf16_nmax: int = 0       # max moving free size with a bf16 PSUM result (0: not allowed)
    bn_stats_fmax: int = 512

    @property
    def psum_partition_bytes(self) -> int:
        return self.psum_bank_bytes * self.psum_num_banks


TARGETS = {
    "trn2": TargetSpec("trn2", 3, 28 * MIB, 212_984),
    "trn3": TargetSpec("trn3", 4, 32 * MIB, 245_752, matmul_fp32_nmax=4096, matmul_bf16_nmax=8192),
}
_ALIASES = {"trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}

_state = threading.local()
_global = {"target": None}


def _normalise(name) -> str:
    key = str(getattr(name, "name", name)).strip().lower()
    if key not in _ALIASES:
        raise ValueError(f"target must be one of 'trn2'/'gen3' or 'trn3'/'gen4', got {name!r}")
    return _ALIASES[key]


def set_target(name) -> None:
    """Select the hardware target for later ``simulate`` calls in this process."""
    _global["target"] = _normalise(name)


def get_target() -> str:
    """The target in force: the running kernel's, else ``set_target``'s, else the environment, else trn2."""
    running = getattr(_state, "running", None)
    if running is not None:
        return running
    if _global["target"] is not None:
        return _global["target"]
    env = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    return _normalise(env) if env else "trn2"


def set_running_target(name: str | None) -> None:
    """Pin the target of the calling (kernel) thread for the duration of a run."""
    _state.running = name


def target_spec() -> TargetSpec:
    return TARGETS[get_target()]


class _TileSize:
    """``nl.tile_size``: hardware tile limits of the current target (docs/nki-semantics.md §3.3)."""

    @property
    def pmax(self) -> int:
        return target_spec().pmax

    @property
    def psum_bank_fmax(self) -> int:
        return target_spec().psum_bank_bytes // 4

    psum_fmax = psum_bank_fmax

    @property
    def psum_bank_fmax_bytes(self) -> int:
        return target_spec().psum_bank_bytes

    @property
    def psum_num_banks(self) -> int:
        return target_spec().psum_num_banks

    @property
    def gemm_stationary_fmax(self) -> int:
        return target_spec().gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self) -> int:
        return target_spec().gemm_moving_fmax

    @property
    def bn_stats_fmax(self) -> int:
        return target_spec().bn_stats_fmax

    @property
    def sbuf_size_bytes(self) -> int:
        return target_spec().sbuf_size_bytes

    @property
    def sbuf_fmax_bytes(self) -> int:
        return target_spec().sbuf_usable_bytes

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self) -> int:
        return target_spec().sbuf_usable_bytes // 4

    psum_min_align = 4
    sbuf_min_align = 4

    def __repr__(self) -> str:
        return f"tile_size(target={get_target()!r})"


tile_size = _TileSize()
