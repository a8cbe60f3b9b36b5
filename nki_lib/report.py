"""The kernel report (the main job): every registered op on representative shapes through the
simulator, in strict mode, with parity against the fp64 oracle and estimated device performance.

Per op and shape it prints the path taken, the worst check and its error ratio to plain PyTorch
in the same precision (pass/fail per the numerics table), the simulated instructions, the peak
SBUF/PSUM use, and from the trn2 cost model (``nki_lib.simulator.profile``) the estimated time of
the forward kernels, its fraction of the engine-aware roofline (``nki_lib.bench.flops``), and the
estimated time of the backward kernels. Exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import time

import nki_lib
from nki_lib import registry
from nki_lib.bench.whole_op import host_cost, record_host_ops
from nki_lib.dispatch import collect_runs
from nki_lib.numerics.oppar import op_parity

TARGET = "trn2"
COLUMNS = (("op", 18), ("case", 62), ("path", 9), ("worst", 11), ("ratio", 6), ("ok", 4),
           ("instr", 7), ("sbuf KiB/p", 10), ("psum bk", 7), ("fwd us", 8), ("fwd dep", 8), ("fwd roof", 8),
           ("bwd us", 8), ("bwd dep", 8), ("host us", 8), ("whole us", 8), ("wall s", 6))


def _row(values) -> str:
    return " ".join(str(v)[:w].ljust(w) if i < 4 else str(v).rjust(w)
                    for i, ((_, w), v) in enumerate(zip(COLUMNS, values)))


def _estimates(spec, sample, runs) -> tuple[str, ...]:
    """(forward us, forward dependency-bound us, forward engine-aware roofline fraction on the
    program-order estimate, backward us, backward dependency-bound us) from the cost model."""
    from nki_lib.bench.flops import cost_of
    from nki_lib.simulator.profile import estimate

    times = {spec.name: [0.0, 0.0], spec.backward_name: [0.0, 0.0]}
    for op, report in runs:
        if report is None or report.trace is None:
            return ("n/a",) * 5
        est = estimate(report, target=TARGET)
        total = times.setdefault(op, [0.0, 0.0])
        total[0] += est.time_us
        total[1] += est.dependency_bound_us
    fwd_us, fwd_dep = times[spec.name]
    cost = cost_of(spec.name, sample)
    fraction = "-"
    if cost is not None and fwd_us > 0:
        from nki_lib.simulator.profile import roofline
        fraction = f"{roofline(cost, TARGET).engine_aware_ns / (fwd_us * 1e3):.0%}"
    bwd = [f"{t:.1f}" for t in times[spec.backward_name]] if spec.backward_name else ["-", "-"]
    return f"{fwd_us:.1f}", f"{fwd_dep:.1f}", fraction, *bwd


def _with_whole_op(kernels: tuple, host: dict) -> tuple:
    """The kernel columns, the host ops' time and the whole op in program order (forward + backward
    kernels + host ops, ``nki_lib.bench.whole_op``)."""
    fwd_us, bwd_us = kernels[0], kernels[3]
    if fwd_us == "n/a":
        return (*kernels, f"{host['time_us']:.1f}", "n/a")
    whole = float(fwd_us) + (float(bwd_us) if bwd_us != "-" else 0.0) + host["time_us"]
    return (*kernels, f"{host['time_us']:.1f}", f"{whole:.1f}")


def run_report(ops: list[str] | None = None) -> bool:
    from nki_lib.simulator.profile import params

    specs = [s for s in registry.all_specs() if not ops or s.name in ops]
    header = _row([name for name, _ in COLUMNS])
    print(header)
    print("-" * len(header))
    all_ok = True
    for spec in specs:
        for sample in spec.report_samples():
            nki_lib.reset_coverage()
            start = time.perf_counter()
            try:
                with collect_runs() as runs, record_host_ops() as host_ops:
                    result = op_parity(spec, sample, path="simulator")
            except Exception as exc:  # a failing kernel is a report line, not a crash
                all_ok = False
                print(f"{spec.name:<18} {sample.label[:62]:<62} ERROR {type(exc).__name__}: {exc}")
                continue
            wall = time.perf_counter() - start
            cov = nki_lib.coverage()
            paths = sorted({p for op in cov.values() for p, st in op.items() if st.calls})
            worst = max(result.checks, key=lambda c: c.ratio, default=None)
            sims = [r for _, r in runs if r is not None]
            ok = result.ok and paths == ["simulator"]
            all_ok &= ok
            print(_row([spec.name, sample.label, ",".join(paths), worst.name if worst else "-",
                        f"{worst.ratio:.2f}" if worst else "-", "yes" if ok else "NO",
                        sum(r.instructions for r in sims),
                        f"{max((r.peak_sbuf_bytes for r in sims), default=0) / 1024:.1f}",
                        max((r.peak_psum_banks for r in sims), default=0),
                        *_with_whole_op(_estimates(spec, sample, runs), host_cost(host_ops, params(TARGET))),
                        f"{wall:.1f}"]))
            if not result.ok:
                print(result)
    print(f"\nratio: kernel error / error of plain PyTorch in the same dtype, both vs an fp64 oracle "
          f"(allowed: 2x outputs, 3x gradients, plus a noise floor). Times: {TARGET} cost-model "
          f"estimates (one NeuronCore), not measurements: 'us' in program order, 'dep' the "
          f"dependency-bound estimate (engines reorder freely subject to dependencies); 'fwd roof' = "
          f"engine-aware roofline time over the program-order forward time; 'host us' = the host-side "
          f"torch ops of the op calls (each one launch plus its HBM bytes at HBM bandwidth); 'whole us' = "
          f"the whole op in program order: forward and backward kernels plus the host ops.")
    print("\nall kernels pass" if all_ok else "\nFAILURES above")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nki-lib report", description=__doc__)
    parser.add_argument("--op", action="append", help="only this op (repeatable)")
    args = parser.parse_args(argv)
    return 0 if run_report(args.op) else 1
