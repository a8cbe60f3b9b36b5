"""``estimate(report_or_trace, target=...) -> Estimate``: device time of a simulated kernel.

Two estimates of every run (docs/cost-model.md "Two estimates"):

* ``time_ns`` -- **program order**: the list schedule of :mod:`.schedule` over the recorded
  trace (each engine runs its instructions in kernel program order) plus the fixed launch cost;
* ``dependency_bound_ns`` -- **dependency bound**: the same instructions with the same
  services, but each engine takes them in any order subject to data dependencies (RAW, WAR,
  WAW on the bytes touched, placed tiles aliasing), engine occupancy, PSUM banks and barriers,
  as the Neuron compiler's scheduler may reorder them. It never exceeds ``time_ns`` (the
  compiler may keep program order). A performance claim holds only if it holds on both.

Also per-engine busy time and utilisation, the critical engine, and two bounds (docs/cost-model.md §7.4):
``lower_bound_ns = launch + max over engines of busy time`` (perfect overlap) and
``upper_bound_ns = launch + sum of all (service + latency)`` (fully serial).
For an LNC2 launch each program is one physical core: busy times are the maximum over cores,
rooflines use ``grid`` cores; ``core_makespans_ns`` / ``core_dependency_makespans_ns`` give each
core's own makespan (0 for a core with no instructions), to see whether a core idles.

Not modelled (limitations, docs/cost-model.md §7.4): HBM bank conflicts, DMA queue QoS, instruction fetch,
SBUF spills, the innermost-stride (> 16 B) port penalty, PE row/column
tiling concurrency and the trn3 background transpose.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .constants import HardwareParams, params
from .roofline import OpCost, Roofline, roofline
from .schedule import ENGINES, schedule_programs

__all__ = ["Estimate", "estimate"]


@dataclass
class Estimate:
    """Estimated device time (ns) of one kernel launch on ``target``."""

    kernel: str
    target: str
    grid: int
    time_ns: float
    makespan_ns: float
    launch_ns: float
    dependency_bound_ns: float
    dependency_makespan_ns: float
    lower_bound_ns: float
    upper_bound_ns: float
    busy_ns: dict
    instructions: dict
    act_table_loads: int
    throttle_ns: float
    unmodelled: dict = field(default_factory=dict)
    core_makespans_ns: tuple = ()               # per program (core), program order
    core_dependency_makespans_ns: tuple = ()    # per program (core), dependency bound
    timeline: list | None = None
    critical_path: list = field(default_factory=list, repr=False)
    hw: HardwareParams | None = field(default=None, repr=False)

    def hotspots(self, n: int = 5) -> list[tuple[str, str, str, float, float]]:
        """The kernel lines that make up the critical path, most time first.

        Each item is ``(source, opcode, waited_on, ns, share of the makespan)``, where
        ``waited_on`` is what the instructions of that line mostly waited for (``data``: a
        producer's result, ``engine``: their own engine, ``dma engines``, ``psum bank``, ...).
        """
        total: dict = defaultdict(float)
        reasons: dict = defaultdict(lambda: defaultdict(float))
        for entry, engine, ns, why in self.critical_path:
            key = ("<launch>", "-") if entry is None else (entry.source or "?", f"{entry.opcode} ({engine})")
            total[key] += ns
            reasons[key][why] += ns
        span = self.makespan_ns or 1.0
        ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
        return [(src, op, max(reasons[(src, op)], key=reasons[(src, op)].get), ns, ns / span)
                for (src, op), ns in ranked]

    @property
    def time_us(self) -> float:
        return self.time_ns * 1e-3

    @property
    def dependency_bound_us(self) -> float:
        return self.dependency_bound_ns * 1e-3

    @property
    def utilisation(self) -> dict:
        """Busy time over the makespan, per engine (DMA: over all 16 DMA engines)."""
        span = self.makespan_ns or 1.0
        return {e: b / span for e, b in self.busy_ns.items()}

    @property
    def critical_engine(self) -> str:
        """The engine with the most busy time."""
        return max(self.busy_ns, key=self.busy_ns.get)

    def roofline(self, cost: OpCost) -> Roofline:
        return roofline(cost, self.hw or self.target, self.grid)

    def tflops(self, cost: OpCost) -> float:
        """Useful TFLOP/s at the estimated time."""
        return cost.flops / self.time_ns * 1e-3

    def mfu(self, cost: OpCost) -> float:
        """Useful FLOPs over TensorE peak (dtype ``cost.pe_dtype``, ``grid`` cores) times time."""
        peak = (self.hw or params(self.target)).pe_peak_flops(cost.pe_dtype) * self.grid
        return cost.flops / (peak * self.time_ns * 1e-9)

    def roofline_fraction(self, cost: OpCost) -> float:
        """Classical roofline time ``max(FLOPs/peak, bytes/BW)`` over the estimated time."""
        return self.roofline(cost).classical_ns / self.time_ns

    def engine_roofline_fraction(self, cost: OpCost) -> float:
        """Engine-aware roofline time (also ScalarE/VectorE element work) over the estimated time."""
        return self.roofline(cost).engine_aware_ns / self.time_ns

    def summary(self) -> str:
        util = ", ".join(f"{e} {u:.0%}" for e, u in self.utilisation.items() if self.instructions.get(e))
        text = (f"{self.kernel} on {self.target} (grid {self.grid}): {self.time_ns / 1e3:.2f} us in program "
                f"order, {self.dependency_bound_ns / 1e3:.2f} us dependency-bound "
                f"[{self.lower_bound_ns / 1e3:.2f}, {self.upper_bound_ns / 1e3:.2f}], "
                f"bound by {self.critical_engine}; utilisation {util}")
        if self.unmodelled:
            text += f"; generic cost for {dict(self.unmodelled)}"
        return text


def _split_programs(trace) -> dict[int, list]:
    programs: dict[int, list] = defaultdict(list)
    for entry in trace:
        programs[entry.program_id].append(entry)
    for entries in programs.values():
        entries.sort(key=lambda e: e.index)
    return dict(sorted(programs.items()))


def estimate(report_or_trace, target: str | HardwareParams | None = None, *,
             keep_timeline: bool = False) -> Estimate:
    """Estimate the device time of a simulated kernel.

    ``report_or_trace`` is a ``RunReport`` recorded with tracing on (``report.trace`` not None)
    or a list of ``TraceEntry``. ``target`` defaults to the report's target (a bare trace needs
    it); a :class:`HardwareParams` (e.g. ``params("trn2").replace(...)`` with calibrated
    constants) is used as is. ``keep_timeline=True`` keeps ``(index, engine, opcode, start, end, done)`` per
    instruction of program 0 in ``Estimate.timeline``.
    """
    trace = getattr(report_or_trace, "trace", report_or_trace)
    if trace is None:
        raise ValueError("report_or_trace: the RunReport has no trace; run the simulator with recording on")
    if not isinstance(trace, (list, tuple)):
        raise TypeError(f"report_or_trace must be a RunReport or a list of TraceEntry, got {type(trace).__name__}")
    target = target or getattr(report_or_trace, "target", None)
    if target is None:
        raise ValueError("target: required when estimating a bare trace")
    hw = target if isinstance(target, HardwareParams) else params(target)
    target = hw.target
    programs = _split_programs(trace)
    results, free = schedule_programs(programs, hw, keep_timeline=keep_timeline, reordered=True) \
        if programs else ([], [])
    launch = hw.kernel_launch_ns
    busy = {e: max((r.busy_ns[e] for r in results), default=0.0) for e in ENGINES}
    counts = {e: sum(r.instructions[e] for r in results) for e in ENGINES}
    unmodelled: dict = defaultdict(int)
    for r in results:
        for op, n in r.unmodelled.items():
            unmodelled[op] += n
    makespan = max((r.makespan_ns for r in results), default=0.0)
    free_makespan = min(makespan, max((r.makespan_ns for r in free), default=0.0))
    grid = getattr(report_or_trace, "grid", None) or max(len(programs), 1)
    cores = {r.program_id: (r.makespan_ns, min(r.makespan_ns, f.makespan_ns)) for r, f in zip(results, free)}
    per_core = [cores.get(pid, (0.0, 0.0)) for pid in range(max(grid, len(programs)))]
    return Estimate(
        kernel=getattr(report_or_trace, "kernel", "<trace>"),
        target=target,
        grid=grid,
        time_ns=launch + makespan,
        makespan_ns=makespan,
        launch_ns=launch,
        dependency_bound_ns=launch + free_makespan,
        dependency_makespan_ns=free_makespan,
        lower_bound_ns=launch + max(busy.values(), default=0.0),
        upper_bound_ns=launch + sum(r.serial_ns for r in results),
        busy_ns=busy,
        instructions=counts,
        act_table_loads=sum(r.act_table_loads for r in results),
        throttle_ns=max((r.throttle_ns for r in results), default=0.0),
        unmodelled=dict(unmodelled),
        core_makespans_ns=tuple(m for m, _ in per_core),
        core_dependency_makespans_ns=tuple(d for _, d in per_core),
        timeline=results[0].timeline if results else None,
        critical_path=max(results, key=lambda r: r.makespan_ns).critical_path if results else [],
        hw=hw,
    )
