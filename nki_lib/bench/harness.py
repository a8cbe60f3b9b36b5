"""Run one benchmark case: simulate the op's kernels, estimate trn2/trn3 device time, time the CPU paths.

For a :class:`~nki_lib.bench.shapes.Case` the harness

1. plans the simulation (:func:`plan`): the real shape, or, where simulating it would take too
   long on this CPU, a representative part of it with an explicit extrapolation rule that is
   written into the result (``extrapolation``) and marked in the table. Rules:

   * attention (flash and decode): the (batch x kv-head) groups are independent; one group
     (``Hq / Hkv`` query heads sharing one kv head, real sequence lengths and head dim) is
     simulated and ``time = launch + groups x simulated makespan``; not for a paged decode
     cache (``block_size``), whose blocks hold every kv head (one gather may serve them all),
     nor for a token-major one (``layout="NHD"``: one kv head would make its layout head-major);
   * ``moe_experts`` (E > 2n, ``n = max(2, k)``): experts are independent blocks of work, but the
     kernel's prologue (the first group's row gathers) and its tail (the last scatters and the
     k-sum) are not per expert, so the case is measured at steady state: two calls are
     simulated, with ``n`` and ``2n`` experts, both with the real top-k (``k' = k``: every token's
     k rows in k experts, so the k-sum's loads are the real shape's runs) and the real tokens per
     expert (``T' = T E' / E``, balanced routing), and every figure (makespans, busy times,
     bounds, host bytes) is extrapolated linearly by the measured marginal cost of the extra
     experts: ``f(E) = f(n) + s (f(2n) - f(n))`` with
     ``s = (blocks(E) - blocks(n)) / (blocks(2n) - blocks(n))`` (``(E - n) / n`` for balanced
     routing). Both calls choose the real shape's tiling: they run inside
     :func:`nki_lib.moe.kernels.moe_experts_host.plan_tiling_for` with the real plan's block and
     expert counts, which the launchers' SBUF estimates count (blocks per group, the I chunk and
     dx span of the backward, the forward's staging). The prologue is charged once; the parts
     that grow with the assignments (the k-sum reads N x H) grow as they do on the real shape
     (docs/perf-log.md §14.5 checks this against full simulations);
   * everything else, and every case with ``extrapolate=False`` (the ``targets`` and ``aws``
     sweeps' attention and decode cases), is simulated at the real shape. The group rule
     leaves out the overlap of consecutive groups, so it overstates the time of batched decode
     (docs/perf-log.md §8: 97.9 / 83.8 us against 91.1 / 41.3 us at full shape): an extrapolated
     time is an upper bound in practice, not an exact figure;

2. calls ``torch.ops.nki.<op>`` (and its backward for ``train``) on the simulator path in
   strict mode, once per target, with ``NEURON_LOGICAL_NC_CONFIG`` set to the case's ``lnc``
   when it names one; the first trn2 call is the "first call" (kernel trace and
   build, the analogue of device compilation), a second trn2 call is the steady state; the
   ``RunReport`` of every kernel launched (``nki_lib.dispatch.collect_runs``) is estimated with
   :func:`nki_lib.simulator.profile.estimate` for its target;
3. times, on the same (simulated) shape, the op's reference path and the natural PyTorch
   baseline (:func:`nki_lib.bench.inputs.baseline`), first call and steady state;
4. computes TFLOP/s, MFU and both roofline fractions from the op's minimum-work formula
   (:mod:`nki_lib.bench.flops`) at the real shape;
5. records the host-side torch ops of the call (:mod:`nki_lib.bench.whole_op`) and charges each
   its HBM bytes (scaled like the makespan) plus one launch, beside the kernels (``host``,
   ``whole_op_us``, ``whole_op_dependency_bound_us``).

A case whose op is not registered, or whose call falls back to the reference (no kernel yet),
is reported with that status and no device estimate: nothing is filled in.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from nki_lib.bench import flops
from nki_lib.bench.inputs import baseline, make_call
from nki_lib.bench.shapes import Case
from nki_lib.bench.whole_op import host_cost, host_time_ns, record_host_ops

__all__ = ["SimPlan", "plan", "run_case", "CaseResult", "core_balance", "lnc_degree"]

MOE_SIM_EXPERTS = 2  # the least n: a moe_experts case is simulated at n = max(this, k) and 2n experts
HOTSPOTS = 5         # critical-path lines reported per case


@dataclass(frozen=True)
class SimPlan:
    dims: dict                 # dimensions actually simulated
    scale: float               # simulated makespan multiplier to the real shape
    extrapolation: str | None  # how the real-shape figure is obtained (None: simulated as is)
    marginal_dims: dict | None = None   # a second, larger simulation (two-point rule), or None
    marginal_scale: float = 0.0         # s: f = f(dims) + s (f(marginal_dims) - f(dims))
    tiling_plan: tuple | None = None    # moe_experts: (blocks, experts) of the real plan, tiled for


def plan(case: Case) -> SimPlan:
    d = dict(case.dims)
    if not case.extrapolate:
        return SimPlan(d, 1.0, None)
    if case.op in ("flash_attention", "decode_attention") and "block_size" not in d and d.get("layout") != "NHD":
        groups = d["B"] * d["Hkv"]
        if groups == 1:
            return SimPlan(d, 1.0, None)
        sim = {**d, "B": 1, "Hkv": 1, "Hq": d["Hq"] // d["Hkv"]}
        return SimPlan(sim, float(groups), f"simulated 1 of {groups} independent (batch x kv-head) groups "
                                           f"({sim['Hq']} query heads, real sequence lengths); "
                                           f"time = launch + {groups} x simulated makespan (an upper bound in practice: "
                                           f"the overlap of consecutive groups is left out)")
    if case.op == "moe_experts" and d["E"] > 2 * moe_sim_experts(d):
        return _moe_two_point(d)
    return SimPlan(d, 1.0, None)


def moe_sim_experts(d: dict) -> int:
    """n of the two-point rule: the fewest experts that hold every token's k rows, at least 2."""
    return max(MOE_SIM_EXPERTS, d["k"])


def _moe_two_point(d: dict) -> SimPlan:
    """The steady-state plan of a ``moe_experts`` case (see the module docstring)."""
    from nki_lib.moe.moe_plan_reference import num_blocks

    n = moe_sim_experts(d)
    points = [{**d, "T": max(1, round(d["T"] * e / d["E"])), "E": e} for e in (n, 2 * n)]
    blocks = [flops._expert_blocks(p["T"], p["E"], p["k"], d["block_size"]) for p in points]
    real_blocks = flops._expert_blocks(d["T"], d["E"], d["k"], d["block_size"])
    s = (real_blocks - blocks[0]) / (blocks[1] - blocks[0])
    plan_blocks = num_blocks(d["T"] * d["k"], d["E"], d["block_size"])
    text = (f"simulated {n} and {2 * n} of {d['E']} experts with the real top-k and tokens per expert "
            f"(T'={points[0]['T']} and {points[1]['T']}, k={d['k']}, balanced routing, {blocks[0]} and {blocks[1]} "
            f"blocks) and the real plan's tiling ({plan_blocks} plan blocks over {d['E']} experts); every figure "
            f"f = f({n}) + {s:.4g} x (f({2 * n}) - f({n})) ({real_blocks} blocks: the marginal cost of an expert at "
            f"steady state; fixed prologue charged once)")
    return SimPlan(points[0], 1.0, text, points[1], s, (plan_blocks, d["E"]))


def op_cost(case: Case) -> flops.OpCost:
    """Minimum work of the case at its real shape (forward, or forward + backward for ``train``)."""
    d, dt = case.dims, case.dtype
    if case.op == "flash_attention":
        args = (d["B"], d["Hq"], d["Hkv"], d["Sq"], d["Sk"], d["D"])
        kw = dict(dtype=dt, causal=d.get("causal", False), window_left=d.get("window_left", -1))
        cost = flops.flash_attention_fwd(*args, **kw)
        return cost + flops.flash_attention_bwd(*args, **kw) if case.mode == "train" else cost
    if case.op == "decode_attention":
        return flops.decode_attention(d["B"], d["Hq"], d["Hkv"], d["Sq"], [d["L"]] * d["B"], d["D"], dtype=dt,
                                      block_size=d.get("block_size"))
    if case.op == "moe_router":
        return flops.moe_router(d["T"], d["H"], d["E"], d["k"], dtype=dt)
    if case.op == "moe_experts":
        args = (d["T"], d["H"], d["I"], d["E"], d["k"])
        cost = flops.moe_experts_fwd(*args, block_size=d["block_size"], dtype=dt)
        return cost + flops.moe_experts_bwd(*args, block_size=d["block_size"], dtype=dt) if case.mode == "train" \
            else cost
    raise ValueError(f"case: no cost formula for op {case.op!r}")


@dataclass
class CaseResult:
    """One output row (see benchmarks/README.md for the schema)."""

    label: str
    op: str
    mode: str
    model: str
    family: str
    dims: dict
    dtype: str
    status: str = "ok"                 # "ok" | "fallback: <reason>" | "not registered" | "error: <msg>"
    sim_dims: dict = field(default_factory=dict)
    extrapolation: str | None = None
    kernels: list = field(default_factory=list)
    specializations: int = 0
    instructions: int = 0
    flops: float = 0.0
    hbm_bytes: float = 0.0
    executed_flops: float | None = None
    estimates: dict = field(default_factory=dict)   # target -> figures
    cpu_s: dict = field(default_factory=dict)        # wall times on this CPU

    def to_json(self) -> dict:
        return asdict(self)


def _call(op: str, args: tuple, kwargs: dict, mode: str):
    out = getattr(torch.ops.nki, op)(*args, **kwargs)
    if mode == "train":
        first = out[0] if isinstance(out, (tuple, list)) else out
        grad = torch.ones_like(first)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        torch.autograd.grad(first, leaves, grad, allow_unused=True)
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summarise(estimates: list, scale: float, cost: flops.OpCost | None, target) -> dict:
    """Figures of the launches of one op call, the makespans scaled to the real shape.

    Without a ``cost`` (no formula for that part) only the time figures are given.
    """
    from nki_lib.simulator.profile import roofline

    launch = sum(e.launch_ns for e in estimates)
    span = sum(e.makespan_ns for e in estimates) * scale
    time_ns = launch + span
    dep_ns = launch + sum(e.dependency_makespan_ns for e in estimates) * scale
    busy = {eng: scale * sum(e.busy_ns[eng] for e in estimates) for eng in estimates[0].busy_ns}
    grid = max(e.grid for e in estimates)
    slowest = max(estimates, key=lambda e: e.makespan_ns)
    balance = core_balance([e.core_makespans_ns for e in estimates])
    dep_balance = core_balance([e.core_dependency_makespans_ns for e in estimates])
    out = {
        "time_us": time_ns * 1e-3,
        "dependency_bound_us": dep_ns * 1e-3,
        "lower_bound_us": (launch + scale * sum(e.lower_bound_ns - e.launch_ns for e in estimates)) * 1e-3,
        "upper_bound_us": (launch + scale * sum(e.upper_bound_ns - e.launch_ns for e in estimates)) * 1e-3,
        "launches": len(estimates),
        "grid": grid,
        "busy_us": {k: v * 1e-3 for k, v in busy.items()},
        "utilisation": {k: (v / span if span else 0.0) for k, v in busy.items()},
        "bound_engine": max(busy, key=busy.get),
        "core_balance": balance,
        "dependency_bound": {"time_us": dep_ns * 1e-3, "core_balance": dep_balance},
        "act_table_loads": sum(e.act_table_loads for e in estimates),
        "unmodelled": {k: v for e in estimates for k, v in e.unmodelled.items()},
        "hotspots": [{"kernel": slowest.kernel, "source": src, "opcode": op, "waited_on": why, "share": share}
                     for src, op, why, _, share in slowest.hotspots(HOTSPOTS)],
    }
    if cost is not None:
        roof = roofline(cost, target, grid)
        out.update(time_figures(cost, target, grid, time_ns))
        out["dependency_bound"].update(time_figures(cost, target, grid, dep_ns))
        out.update({
            "roofline_bound": roof.bound,
            "roofline_us": {"pe": roof.pe_ns * 1e-3, "hbm": roof.hbm_ns * 1e-3, "act_dve": roof.element_ns * 1e-3},
        })
    return out


def core_balance(launch_cores: list) -> float:
    """The least busy core's summed makespan over the busiest core's, over launches (each a tuple
    of per-core makespans): 1.0 when the cores finish together (or one core), 0.0 when one idles."""
    totals: list = []
    for cores in launch_cores:
        totals += [0.0] * (len(cores) - len(totals))
        for i, ns in enumerate(cores):
            totals[i] += ns
    return min(totals) / max(totals) if totals and max(totals) > 0 else 1.0


def time_figures(cost: flops.OpCost, target, grid: int, time_ns: float) -> dict:
    """The figures of one estimate that follow from its time: TFLOP/s, MFU, roofline fractions.

    ``target``: a target name or a :class:`~nki_lib.simulator.profile.HardwareParams`.
    """
    from nki_lib.simulator.profile import HardwareParams, params, roofline

    hw = target if isinstance(target, HardwareParams) else params(target)
    roof = roofline(cost, hw, grid)
    peak = hw.pe_peak_flops(cost.pe_dtype) * grid
    return {
        "time_us": time_ns * 1e-3,
        "tflops": cost.flops / time_ns * 1e-3,
        "mfu": cost.flops / (peak * time_ns * 1e-9),
        "roofline_fraction": roof.classical_ns / time_ns,
        "engine_roofline_fraction": roof.engine_aware_ns / time_ns,
        "hbm_roofline_fraction": roof.hbm_ns / time_ns,
    }


def part_cost(case: Case, op_name: str) -> flops.OpCost | None:
    """Minimum work of one op of a case's call (``train``: the forward and backward ops apart)."""
    d, dt = case.dims, case.dtype
    if case.op == "flash_attention" and op_name in ("flash_attention", "flash_attention_backward"):
        args = (d["B"], d["Hq"], d["Hkv"], d["Sq"], d["Sk"], d["D"])
        kw = dict(dtype=dt, causal=d.get("causal", False), window_left=d.get("window_left", -1))
        fn = flops.flash_attention_fwd if op_name == "flash_attention" else flops.flash_attention_bwd
        return fn(*args, **kw)
    if case.op == "moe_experts" and op_name in ("moe_experts", "moe_experts_backward"):
        fn = flops.moe_experts_fwd if op_name == "moe_experts" else flops.moe_experts_bwd
        return fn(d["T"], d["H"], d["I"], d["E"], d["k"], block_size=d["block_size"], dtype=dt)
    if op_name == case.op and case.mode != "train":
        return op_cost(case)
    return None


@contextlib.contextmanager
def lnc_degree(lnc: int | None):
    """``NEURON_LOGICAL_NC_CONFIG`` set to ``lnc`` inside the block (None: left as it is)."""
    if lnc is None:
        yield
        return
    key = "NEURON_LOGICAL_NC_CONFIG"
    previous = os.environ.get(key)
    os.environ[key] = str(lnc)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[key]
        else:
            os.environ[key] = previous


def tiling_context(tiling_plan: tuple | None):
    """The launchers' tiling chosen for ``tiling_plan`` = (blocks, experts) of a real moe plan
    (:func:`nki_lib.moe.kernels.moe_experts_host.plan_tiling_for`), or nothing when None."""
    if tiling_plan is None:
        return contextlib.nullcontext()
    from nki_lib.moe.kernels.moe_experts_host import plan_tiling_for

    return plan_tiling_for(*tiling_plan)


def _simulate(case: Case, args, kwargs, target: str, tiling_plan: tuple | None = None):
    """One strict simulator call on ``target``: (wall seconds, runs, coverage snapshot, host ops)."""
    import nki_lib
    from nki_lib.dispatch import collect_runs
    from nki_lib.simulator import get_target, set_target

    previous = get_target()
    set_target(target)
    nki_lib.reset_coverage()
    try:
        with lnc_degree(case.lnc), tiling_context(tiling_plan), nki_lib.use_backend("simulator"), nki_lib.strict(True), \
                collect_runs() as runs, record_host_ops() as host_ops:
            wall = _timed(lambda: _call(case.op, args, kwargs, case.mode))
    finally:
        set_target(previous)
    return wall, list(runs), nki_lib.coverage(), list(host_ops)


def _linear(a: float, b: float, s: float) -> float:
    return a + s * (b - a)


def extrapolate_estimate(small, large, s: float):
    """The :class:`~nki_lib.simulator.profile.Estimate` of one launch at ``f = f(small) + s (f(large)
    - f(small))`` for every time figure (makespans, per-core makespans, bounds, busy times; the
    launch overhead, the same in both, stays once); the rest (critical path, instruction counts)
    is the larger simulation's, its critical-path times scaled so that each line keeps its share
    of the makespan."""
    from dataclasses import replace

    times = ("time_ns", "makespan_ns", "launch_ns", "dependency_bound_ns", "dependency_makespan_ns",
             "lower_bound_ns", "upper_bound_ns", "throttle_ns")
    span = _linear(small.makespan_ns, large.makespan_ns, s)
    ratio = span / large.makespan_ns if large.makespan_ns else 1.0
    return replace(large, **{k: _linear(getattr(small, k), getattr(large, k), s) for k in times},
                   critical_path=[(entry, eng, ns * ratio, why) for entry, eng, ns, why in large.critical_path],
                   busy_ns={e: _linear(small.busy_ns[e], large.busy_ns[e], s) for e in large.busy_ns},
                   core_makespans_ns=tuple(_linear(a, b, s) for a, b in zip(small.core_makespans_ns,
                                                                            large.core_makespans_ns)),
                   core_dependency_makespans_ns=tuple(_linear(a, b, s) for a, b in zip(
                       small.core_dependency_makespans_ns, large.core_dependency_makespans_ns)))


def _estimates(runs: list, hw, marginal=None) -> list:
    """(op name, Estimate) per launch; with ``marginal`` = (the larger simulation's runs, s), each
    launch extrapolated by :func:`extrapolate_estimate` (the two calls launch the same kernels)."""
    from nki_lib.simulator.profile import estimate

    ests = [(op_name, estimate(r, hw)) for op_name, r in runs if r is not None]
    if marginal is None:
        return ests
    large_runs, s = marginal
    large = _estimates(large_runs, hw)
    if [op for op, _ in large] != [op for op, _ in ests]:
        raise RuntimeError("two-point extrapolation: the two simulations launched different kernels")
    return [(op, extrapolate_estimate(e, big, s)) for (op, e), (_, big) in zip(ests, large)]


def _figures(case: Case, runs: list, scale: float, cost: flops.OpCost, hw, marginal=None) -> dict:
    """The figures of one op call's launches on the target table ``hw`` (per op in ``parts``)."""
    ests = _estimates(runs, hw, marginal)
    out = _summarise([e for _, e in ests], scale, cost, hw)
    ops = sorted({op_name for op_name, _ in ests})
    if len(ops) > 1:
        out["parts"] = {op_name: _summarise([e for o, e in ests if o == op_name], scale,
                                            part_cost(case, op_name), hw) for op_name in ops}
    return out


def _host(host_ops: list, hw, scale: float, marginal=None) -> dict:
    """host_cost of the call; with ``marginal`` = (the larger simulation's host ops, s) its bytes
    extrapolated like the kernels, and its launches the larger call's: the op count does not grow
    with the experts (a data-dependent branch, e.g. idle blocks in one call only, would otherwise be
    multiplied by s)."""
    small = host_cost(host_ops, hw, scale)
    if marginal is None:
        return small
    large_ops, s = marginal
    large = host_cost(large_ops, hw, scale)
    nbytes = _linear(small["hbm_bytes"], large["hbm_bytes"], s)
    return {**large, "hbm_bytes": nbytes, "time_us": host_time_ns(large["launches"], nbytes, hw) * 1e-3}


def _add_host(figures: dict, host_ops: list, scale: float, hw, marginal=None) -> None:
    """The host-side torch ops of the call (whole-op estimate, nki_lib.bench.whole_op) beside the
    kernels: ``host`` figures, ``whole_op_us`` and ``whole_op_dependency_bound_us`` (per op too)."""
    host = _host(host_ops, hw, scale, marginal)
    figures["host"] = host
    figures["whole_op_us"] = figures["time_us"] + host["time_us"]
    figures["whole_op_dependency_bound_us"] = figures["dependency_bound_us"] + host["time_us"]
    for op, part in figures.get("parts", {}).items():
        part_marginal = None if marginal is None else ([o for o in marginal[0] if o.op == op], marginal[1])
        _add_host(part, [o for o in host_ops if o.op == op], scale, hw, part_marginal)


_COMPACT = ("time_us", "dependency_bound_us", "lower_bound_us", "core_balance", "tflops", "mfu", "roofline_fraction", "engine_roofline_fraction",
            "hbm_roofline_fraction", "dependency_bound", "bound_engine")


def _compact(figures: dict) -> dict:
    """The time-derived figures of a sensitivity corner (per op too)."""
    out = {k: figures[k] for k in _COMPACT if k in figures}
    if "parts" in figures:
        out["parts"] = {op: _compact(f) for op, f in figures["parts"].items()}
    return out


def run_case(case: Case, targets=("trn2", "trn3"), *, steady: bool = True, cpu_paths: bool = True,
             hw: dict | None = None, sensitivity: bool = False) -> CaseResult:
    """Benchmark one case (see the module docstring).

    ``hw``: target -> :class:`~nki_lib.simulator.profile.HardwareParams` replacing the published
    table (``nki-lib bench --set``). ``sensitivity``: also estimate the first target with each
    low-confidence constant at each documented bound (``estimates[target]["sensitivity"]``:
    corner label -> figures).
    """
    import nki_lib
    from nki_lib import registry
    from nki_lib.dispatch import NKIFallbackError
    from nki_lib.simulator.profile import corners, params

    hw = hw or {}

    sim = plan(case)
    cost = op_cost(case)
    res = CaseResult(case.label, case.op, case.mode, case.model, case.family, dict(case.dims), case.dtype,
                     sim_dims=sim.dims, extrapolation=sim.extrapolation, flops=cost.flops,
                     hbm_bytes=cost.hbm_bytes, executed_flops=cost.executed_flops)
    try:
        registry.get(case.op)
    except ValueError:
        res.status = "not registered"
        return res
    dtype = getattr(torch, case.dtype)
    train = case.mode == "train"
    try:
        args, kwargs = make_call(case.op, sim.dims, dtype, requires_grad=train)
        large_call = None if sim.marginal_dims is None else \
            make_call(case.op, sim.marginal_dims, dtype, requires_grad=train)
        for i, target in enumerate(targets):
            try:
                wall, runs, cov, host_ops = _simulate(case, args, kwargs, target, sim.tiling_plan)
                marginal = host_marginal = None
                if large_call is not None:   # the two-point rule's second simulation
                    _, large_runs, _, large_host = _simulate(case, *large_call, target, sim.tiling_plan)
                    marginal, host_marginal = (large_runs, sim.marginal_scale), (large_host, sim.marginal_scale)
            except NKIFallbackError as exc:
                res.status = f"fallback: {exc}"
                break
            if i == 0:
                res.cpu_s["simulator_first"] = wall
                res.specializations = sum(cov.specializations.values())
                if steady:
                    wall, runs, _, host_ops = _simulate(case, args, kwargs, target, sim.tiling_plan)
                    res.cpu_s["simulator_steady"] = wall
                res.kernels = sorted({r.kernel for _, r in runs if r is not None})
                res.instructions = sum(r.instructions for _, r in runs if r is not None)
                res.cpu_s["simulator_instr_per_s"] = res.instructions / wall if wall else 0.0
            reports = [r for _, r in runs if r is not None]
            if not reports or any(r.trace is None for r in reports):
                res.status = "no trace recorded"
                break
            target_hw = hw.get(target) or params(target)
            res.estimates[target] = _figures(case, runs, sim.scale, cost, target_hw, marginal)
            _add_host(res.estimates[target], host_ops, sim.scale, target_hw, host_marginal)
            if sensitivity and i == 0:
                res.estimates[target]["sensitivity"] = {
                    corner.label: _compact(_figures(case, runs, sim.scale, cost, corner.hw, marginal))
                    for corner in corners(target_hw)}
        if cpu_paths:
            with nki_lib.use_backend("reference"):
                res.cpu_s["reference_first"] = _timed(lambda: _call(case.op, args, kwargs, case.mode))
                res.cpu_s["reference_steady"] = _timed(lambda: _call(case.op, args, kwargs, case.mode))
            base = lambda: _baseline(case, args, kwargs)  # noqa: E731
            res.cpu_s["baseline_first"] = _timed(base)
            res.cpu_s["baseline_steady"] = _timed(base)
    except Exception as exc:  # one failing case is a result row, not the end of the sweep
        res.status = f"error: {type(exc).__name__}: {exc}"
    return res


def _baseline(case: Case, args, kwargs):
    out = baseline(case.op, args, kwargs)
    if case.mode == "train":
        first = out[0] if isinstance(out, (tuple, list)) else out
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        torch.autograd.grad(first, leaves, torch.ones_like(first), allow_unused=True)
    return out
