"""Per-op work formulas (``OpCost``) and the two rooflines (``docs/cost-model.md`` §7.6).

Protocol for op authors
-----------------------
Beside each op, write a function ``<op>_cost(<the op's argument shapes>) -> OpCost`` that
returns the *minimum* work the algorithm must do, independent of how a kernel tiles it:

* ``flops``: useful matmul FLOPs (2 per multiply-add; no transposes, no padding).
* ``hbm_bytes``: bytes that must cross HBM at least once (inputs read once, outputs written once).
* ``pe_dtype``: the matmul input dtype, which sets the TensorE peak (``"bfloat16"``,
  ``"float32"``, ``"float8_double_row"``, ...).
* ``work``: element work that must stream through ScalarE/VectorE, as :class:`ElementWork`
  items: ``elems`` elements, the ``engines`` that may do it (``("scalar",)``, ``("vector",)``
  or both) and the ``kind`` that sets the rate on each engine:

  | kind | scalar rate (per lane per cycle) | vector rate |
  |---|---|---|
  | ``"exp"`` | ``act_width`` | ``dve_exponential_width`` (trn3 only; trn2 cannot) |
  | ``"psum_fp32"`` (read fp32 PSUM) | ``act_width`` | ``dve_width_psum_fp32`` |
  | ``"psum_16bit"`` (read 16-bit PSUM) | ``act_width`` | ``dve_width_16bit_other`` |
  | ``"sbuf_16bit"`` (copy/scale 16-bit SBUF) | ``act_width_16bit_copy`` | ``dve_width_16bit_sbuf`` |
  | ``"sbuf_fp32"`` | ``act_width`` | ``dve_width_fp32`` |

* ``executed_flops`` (optional): FLOPs the algorithm must execute including structural waste
  (e.g. MoE block padding); reported beside MFU, never mixed into it.

The formulas for flash attention, decode attention and the MoE ops live in
``nki_lib/bench/flops.py`` until their authors move them beside the ops.

Rooflines (per core, times ``cores`` for an LNC launch):

* classical: ``T = max(flops / P_pe(dtype), hbm_bytes / BW)``;
* engine-aware: ``max(classical, T_elem)`` where ``T_elem`` is the shortest time in which
  ScalarE and VectorE together can do ``work`` (each item split between its allowed engines;
  a two-machine fractional assignment, solved exactly by bisection + greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import HardwareParams, params

__all__ = ["ElementWork", "OpCost", "Roofline", "roofline"]

_KINDS = ("exp", "psum_fp32", "psum_16bit", "sbuf_16bit", "sbuf_fp32")


@dataclass(frozen=True)
class ElementWork:
    """``elems`` elements of kind ``kind`` that one of ``engines`` must stream."""

    elems: float
    engines: tuple[str, ...] = ("scalar", "vector")
    kind: str = "psum_fp32"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.engines or any(e not in ("scalar", "vector") for e in self.engines):
            raise ValueError(f"engines must be a non-empty subset of ('scalar', 'vector'), got {self.engines!r}")
        if self.elems < 0:
            raise ValueError(f"elems must be >= 0, got {self.elems}")


@dataclass(frozen=True)
class OpCost:
    """Minimum work of one op call (see the module docstring for the protocol)."""

    flops: float
    hbm_bytes: float
    pe_dtype: str = "bfloat16"
    work: tuple[ElementWork, ...] = ()
    executed_flops: float | None = None
    label: str = ""

    def __add__(self, other: "OpCost") -> "OpCost":
        """Work of two calls in sequence (e.g. forward + backward); TensorE dtypes must agree."""
        if self.pe_dtype != other.pe_dtype:
            raise ValueError(f"cannot add costs with pe_dtype {self.pe_dtype!r} and {other.pe_dtype!r}")
        executed = None
        if self.executed_flops is not None or other.executed_flops is not None:
            executed = (self.executed_flops if self.executed_flops is not None else self.flops) + \
                (other.executed_flops if other.executed_flops is not None else other.flops)
        label = " + ".join(x for x in (self.label, other.label) if x)
        return OpCost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.pe_dtype,
                      self.work + other.work, executed, label)

    @property
    def min_scalar_elems(self) -> float:
        return sum(w.elems for w in self.work if w.engines == ("scalar",))

    @property
    def min_vector_elems(self) -> float:
        return sum(w.elems for w in self.work if w.engines == ("vector",))


def _rates(hw: HardwareParams, kind: str) -> tuple[float, float]:
    """(ScalarE, VectorE) elements per ns for ``kind`` on 128 lanes; 0 = that engine cannot."""
    act = {"exp": hw.act_width, "psum_fp32": hw.act_width, "psum_16bit": hw.act_width,
           "sbuf_16bit": hw.act_width_16bit_copy, "sbuf_fp32": hw.act_width}[kind]
    dve = {"exp": hw.dve_exponential_width or 0, "psum_fp32": hw.dve_width_psum_fp32,
           "psum_16bit": hw.dve_width_16bit_other, "sbuf_16bit": hw.dve_width_16bit_sbuf,
           "sbuf_fp32": hw.dve_width_fp32}[kind]
    return hw.lanes * act * hw.f_act * 1e-9, hw.lanes * dve * hw.f_dve * 1e-9


def element_time_ns(work: tuple[ElementWork, ...], hw: HardwareParams, cores: int = 1) -> float:
    """Shortest ScalarE+VectorE time for ``work`` spread over ``cores`` cores."""
    jobs = []
    for item in work:
        r_act, r_dve = _rates(hw, item.kind)
        r_act = r_act if "scalar" in item.engines else 0.0
        r_dve = r_dve if "vector" in item.engines else 0.0
        if r_act == 0.0 and r_dve == 0.0:
            raise ValueError(f"{item} cannot run on {item.engines} on {hw.target}")
        if item.elems:
            jobs.append((item.elems / cores, r_act, r_dve))
    if not jobs:
        return 0.0

    def feasible(t: float) -> bool:
        act_left = dve_left = t
        flexible = []
        for elems, r_act, r_dve in jobs:
            if r_dve == 0.0:
                act_left -= elems / r_act
            elif r_act == 0.0:
                dve_left -= elems / r_dve
            else:
                flexible.append((r_act / r_dve, elems, r_act, r_dve))
        if act_left < 0 or dve_left < 0:
            return False
        for _, elems, r_act, r_dve in sorted(flexible, reverse=True):
            on_act = min(elems, act_left * r_act)
            act_left -= on_act / r_act
            dve_left -= (elems - on_act) / r_dve
        return dve_left >= -1e-9 * t

    hi = sum(e / max(ra, rd) for e, ra, rd in jobs) * 2 + 1.0
    lo = 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Roofline:
    """Roofline times (ns) of one op on one target."""

    target: str
    cores: int
    pe_ns: float
    hbm_ns: float
    element_ns: float

    @property
    def classical_ns(self) -> float:
        return max(self.pe_ns, self.hbm_ns)

    @property
    def engine_aware_ns(self) -> float:
        return max(self.pe_ns, self.hbm_ns, self.element_ns)

    @property
    def bound(self) -> str:
        """Which term sets the engine-aware roofline: ``"pe"``, ``"hbm"`` or ``"act/dve"``."""
        terms = {"pe": self.pe_ns, "hbm": self.hbm_ns, "act/dve": self.element_ns}
        return max(terms, key=terms.get)


def roofline(cost: OpCost, target: str | HardwareParams, cores: int = 1) -> Roofline:
    """The classical and engine-aware roofline times of ``cost`` on ``cores`` cores of ``target``."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    hw = target if isinstance(target, HardwareParams) else params(target)
    target = hw.target
    pe_ns = cost.flops / (hw.pe_peak_flops(cost.pe_dtype) * cores) * 1e9
    hbm_ns = cost.hbm_bytes / (hw.dma_bandwidth() * cores)
    return Roofline(target, cores, pe_ns, hbm_ns, element_time_ns(cost.work, hw, cores))
