"""The kernel report (the main job): every registered op on representative shapes through the
simulator, in strict mode, with parity against the fp64 oracle and the simulator's statistics.

Per op and shape it prints the path taken, the max error and its ratio to the error of plain
PyTorch in the same precision (pass/fail per the numerics table), the number of simulated
instructions, the peak SBUF/PSUM use and, when the cost model is available, the estimated trn2
time of the kernels launched. Exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import time

import nki_lib
from nki_lib import registry
from nki_lib.dispatch import collect_runs
from nki_lib.numerics.oppar import op_parity


def _estimate_us(runs) -> str:
    try:
        from nki_lib.simulator.profile import estimate
    except ImportError:
        return "n/a"
    total = 0.0
    for _, report in runs:
        if report is None or report.trace is None:
            return "n/a"
        total += estimate(report, target="trn2").time_us
    return f"{total:.1f}"


def run_report(ops: list[str] | None = None) -> bool:
    specs = [s for s in registry.all_specs() if not ops or s.name in ops]
    header = f"{'op':<22} {'case':<64} {'path':<9} {'worst':<14} {'ratio':>6} {'ok':<4} {'instr':>8} {'sbuf KiB/p':>10} {'psum banks':>10} {'trn2 us':>9} {'wall s':>7}"
    print(header)
    print("-" * len(header))
    all_ok = True
    for spec in specs:
        for sample in spec.report_samples():
            nki_lib.reset_coverage()
            start = time.perf_counter()
            try:
                with collect_runs() as runs:
                    result = op_parity(spec, sample, path="simulator")
            except Exception as exc:  # a failing kernel is a report line, not a crash
                all_ok = False
                print(f"{spec.name:<22} {sample.label[:64]:<64} ERROR {type(exc).__name__}: {exc}")
                continue
            wall = time.perf_counter() - start
            cov = nki_lib.coverage()
            paths = sorted({p for op in cov.values() for p, st in op.items() if st.calls})
            worst = max(result.checks, key=lambda c: c.ratio, default=None)
            sims = [r for _, r in runs if r is not None]
            instr = sum(r.instructions for r in sims)
            sbuf = max((r.peak_sbuf_bytes for r in sims), default=0) / 1024
            banks = max((r.peak_psum_banks for r in sims), default=0)
            ok = result.ok and paths == ["simulator"]
            all_ok &= ok
            print(f"{spec.name:<22} {sample.label[:64]:<64} {','.join(paths):<9} "
                  f"{(worst.name if worst else '-'):<14} {(worst.ratio if worst else 0):>6.2f} "
                  f"{'yes' if ok else 'NO':<4} {instr:>8} {sbuf:>10.1f} {banks:>10} "
                  f"{_estimate_us(runs):>9} {wall:>7.1f}")
            if not result.ok:
                print(result)
    print("\nall kernels pass" if all_ok else "\nFAILURES above")
    return all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nki-lib report", description=__doc__)
    parser.add_argument("--op", action="append", help="only this op (repeatable)")
    args = parser.parse_args(argv)
    return 0 if run_report(args.op) else 1
