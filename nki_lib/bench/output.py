"""Benchmark output: a progress bar, a readable table, JSON lines and roofline plots."""

from __future__ import annotations

import json
import sys

from nki_lib.bench.harness import CaseResult

__all__ = ["Progress", "table", "targets_report", "write_jsonl", "plot_rooflines", "SCHEMA"]

SCHEMA = "nki-lib-bench/1"


class Progress:
    """``[#####-----] 3/10 label`` on stderr, redrawn in place."""

    WIDTH = 30

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr

    def step(self, label: str) -> None:
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:70]:<70}")
        self.stream.flush()
        self.done += 1

    def close(self) -> None:
        self.stream.write(f"\r[{'#' * self.WIDTH}] {self.total}/{self.total} done{' ' * 70}\n")
        self.stream.flush()


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


COLUMNS = (("case", 58), ("status", 8), ("trn2 us", 9), ("trn2 dep", 9), ("+host", 8), ("trn3 us", 9), ("trn3 dep", 9),
           ("TFLOP/s", 8), ("MFU", 6),
           ("roof", 6), ("eng-roof", 8), ("bound", 7), ("ref ms", 8), ("torch ms", 8), ("sim s", 7),
           ("kinstr/s", 8))


def table(results: list[CaseResult]) -> str:
    """The readable table. Figures are trn2 unless the column says trn3; ``*`` = extrapolated."""
    lines = ["  ".join(f"{name:<{w}}" if i == 0 else f"{name:>{w}}" for i, (name, w) in enumerate(COLUMNS))]
    lines.append("-" * len(lines[0]))
    for r in results:
        t2, t3 = r.estimates.get("trn2", {}), r.estimates.get("trn3", {})
        status = "ok" if r.status == "ok" else r.status.split(":")[0]
        label = ("* " if r.extrapolation else "  ") + r.label
        cells = [
            label[:58], status,
            _fmt(t2.get("time_us"), ".1f"), _fmt(t2.get("dependency_bound_us"), ".1f"),
            _fmt(t2.get("host", {}).get("time_us"), ".1f"),
            _fmt(t3.get("time_us"), ".1f"), _fmt(t3.get("dependency_bound_us"), ".1f"),
            _fmt(t2.get("tflops"), ".1f"), _fmt(t2.get("mfu"), ".0%"),
            _fmt(t2.get("roofline_fraction"), ".0%"), _fmt(t2.get("engine_roofline_fraction"), ".0%"),
            t2.get("bound_engine", "-"),
            _fmt(_ms(r.cpu_s.get("reference_steady")), ".1f"), _fmt(_ms(r.cpu_s.get("baseline_steady")), ".1f"),
            _fmt(r.cpu_s.get("simulator_steady", r.cpu_s.get("simulator_first")), ".1f"),
            _fmt(_k(r.cpu_s.get("simulator_instr_per_s")), ".1f"),
        ]
        lines.append("  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w)) in
                               enumerate(zip(cells, COLUMNS))))
    notes = [r for r in results if r.status != "ok"]
    if notes:
        lines.append("")
        lines.append("cases without a device estimate:")
        lines += [f"  {r.label}: {r.status}" for r in notes]
    extrapolated = [r for r in results if r.extrapolation and r.status == "ok"]
    if extrapolated:
        lines.append("")
        lines.append("* extrapolated (the real shape was not simulated in full):")
        lines += [f"  {r.label}: {r.extrapolation}" for r in extrapolated]
    hot = [r for r in results if r.estimates.get("trn2", {}).get("hotspots")]
    if hot:
        lines.append("")
        lines.append("trn2 critical path, top kernel lines (share of the makespan, what they waited on):")
        for r in hot:
            spots = r.estimates["trn2"]["hotspots"][:3]
            lines.append(f"  {r.label}:")
            lines += [f"      {h['share']:5.1%}  {h['source']}  {h['opcode']}  waited on {h['waited_on']}"
                      for h in spots]
    sens = [r for r in results if r.estimates.get("trn2", {}).get("sensitivity")]
    if sens:
        lines.append("")
        lines.append("trn2 sensitivity: each figure's range with every low-confidence constant at each documented "
                     "bound (docs/cost-model.md §7.9), and the constant at each end:")
        for r in sens:
            lines.append(f"  {r.label}:")
            for key in (None, "dependency_bound"):
                rng = _range_of_total(r, key)
                name = "in order" if key is None else "dependency bound"
                lines.append(f"      {name:<16} {rng[0]:9.1f} us ({rng[2]}) .. {rng[1]:9.1f} us ({rng[3]})")
    specs: dict = {}
    for r in results:
        if r.status == "ok":
            specs[r.op] = specs.get(r.op, 0) + r.specializations
    if specs:
        lines.append("")
        lines.append("kernel specializations (distinct static shapes = device compilations) per op over this sweep: "
                     + ", ".join(f"{op} {n}" for op, n in sorted(specs.items())))
    lines.append("")
    lines.append("trn2/trn3 us: estimated device time in program order (cost model, nki_lib.simulator.profile); "
                 "dep: the dependency-bound estimate (engines reorder freely subject to data dependencies, "
                 "engine occupancy and buffer hazards); +host: the host-side torch ops of the call (whole-op "
                 "estimate: each op one launch plus its HBM bytes at HBM bandwidth, trn2), to add to either; "
                 "TFLOP/s, MFU, "
                 "roof (classical roofline fraction), eng-roof (engine-aware roofline fraction) and bound "
                 "(critical engine) are trn2. ref/torch ms: this CPU, steady state, our reference path vs the "
                 "natural PyTorch baseline on the simulated shape; sim s: simulator wall time.")
    return "\n".join(lines)


def _value(value: float, is_time: bool) -> str:
    return f"{value:.1f} us" if is_time else f"{value:.1%}"


def _check_line(check, is_time: bool) -> str:
    sign = "<=" if check.at_most else ">="
    text = f"{check.estimate} {_value(check.value, is_time)} (target {sign} {_value(check.limit, is_time)}"
    if check.low is not None:
        text += (f"; over the documented ranges {_value(check.low[0], is_time)} at {check.low[1]} .. "
                 f"{_value(check.high[0], is_time)} at {check.high[1]}")
    return text + ")" + ("" if check.ok else "  <- short")


def _verdict_lines(v) -> list[str]:
    """One target: the verdict and name, each limited figure, the whole op, the bound engine."""
    if v.status == "n/a":
        return [f"  n/a   {v.target.name}: {v.reason}"]
    lines = [f"  {v.status:<5} {v.target.name} [{v.target.metric} of {v.target.part}]"]
    lines += [f"          {_check_line(c, v.target.is_time)}" for c in v.checks]
    fig = v.figures
    host = fig.get("host", {}).get("time_us")
    if host is not None:
        lines.append(f"          +host {host:.1f} us: whole op {fig['whole_op_us']:.1f} us in order, "
                     f"{fig['whole_op_dependency_bound_us']:.1f} us dependency bound (shown, not judged)")
    top = (fig.get("hotspots") or [{}])[0]
    lines.append(f"          kernels {fig.get('time_us', 0.0):.1f} / {fig.get('dependency_bound_us', 0.0):.1f} / "
                 f"{fig.get('lower_bound_us', 0.0):.1f} us (in order / dependency bound / lower bound); bound by "
                 f"{fig.get('bound_engine', '?')}; top critical-path line {top.get('source', '?')} "
                 f"{top.get('opcode', '')} waited on {top.get('waited_on', '?')}")
    return lines


def targets_report(results: list[CaseResult]) -> str:
    """Issue 13's targets (nki_lib.bench.targets): PASS only when every limited estimate meets its
    limit, and with sensitivity corners only at the worst end of each range."""
    from nki_lib.bench.targets import TUNING_TARGETS, judge  # noqa: PLC0415

    by_label = {r.label: r for r in results}
    verdicts = [judge(t, by_label[t.case.label]) for t in TUNING_TARGETS if t.case.label in by_label]
    if not verdicts:
        return ""
    counts = {s: sum(v.status == s for v in verdicts) for s in ("PASS", "SHORT", "n/a")}
    lines = ["tuning targets (trn2, cost-model estimates; a target PASSes only if every limited estimate meets "
             "its limit, and with --sensitivity only at every documented bound of every low-confidence "
             "constant): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    for v in verdicts:
        lines += _verdict_lines(v)
    return "\n".join(lines)


def _range_of_total(result: CaseResult, estimate: str | None):
    """Sensitivity range of the whole call's time (all its ops)."""
    from nki_lib.simulator.profile import figure_range  # noqa: PLC0415

    est = result.estimates["trn2"]

    def total(fig):
        return fig["time_us"] if estimate is None else fig["dependency_bound_us"]

    return figure_range(total(est), {label: total(fig) for label, fig in est["sensitivity"].items()})


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _k(rate):
    return None if rate is None else rate * 1e-3


def write_jsonl(path, results: list[CaseResult], header: dict) -> None:
    """First line: ``{"schema": ..., **header}``; then one line per case."""
    with open(path, "w") as f:
        f.write(json.dumps({"schema": SCHEMA, **header}) + "\n")
        for r in results:
            f.write(json.dumps(r.to_json(), default=str) + "\n")


def plot_rooflines(results: list[CaseResult], out_dir) -> list[str]:
    """One PNG per kernel family: achieved TFLOP/s vs arithmetic intensity under both targets' roofs."""
    import matplotlib  # noqa: PLC0415 - optional dependency (the `bench` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from nki_lib.simulator.profile import params  # noqa: PLC0415

    written = []
    for family in sorted({r.family for r in results}):
        rows = [r for r in results if r.family == family and r.estimates and r.hbm_bytes]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5.5))
        intensities = [r.flops / r.hbm_bytes for r in rows if r.flops]
        lo, hi = min(intensities + [1.0]) / 2, max(intensities + [1e3]) * 2
        for target, style in (("trn2", "-"), ("trn3", "--")):
            hw = params(target)
            peak = hw.pe_peak_flops("bfloat16") * 1e-12
            bw = hw.dma_bandwidth() * 1e-3  # TB/s
            xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
            ax.plot(xs, [min(peak, x * bw) for x in xs], style, color="gray", label=f"{target} roof (1 core, bf16)")
        kinds = sorted({(r.op, r.mode) for r in rows})
        colors = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}
        for target, marker in (("trn2", "o"), ("trn3", "^")):
            for r in rows:
                est = r.estimates.get(target)
                if est and r.flops:
                    x, y = r.flops / r.hbm_bytes, est["tflops"] / est["grid"]
                    ax.scatter(x, y, marker=marker, color=colors[(r.op, r.mode)], alpha=0.8)
                    if target == "trn2":
                        ax.annotate(r.model, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        for (op, mode), color in colors.items():
            ax.scatter([], [], marker="s", color=color, label=f"{op} {mode}")
        ax.scatter([], [], marker="o", color="black", label="trn2 estimate")
        ax.scatter([], [], marker="^", color="black", label="trn3 estimate")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
        ax.set_ylabel("estimated TFLOP/s per core")
        ax.set_title(f"{family}: estimated performance vs roofline (cost model)")
        ax.legend(fontsize=7)
        path = f"{out_dir}/roofline_{family}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
