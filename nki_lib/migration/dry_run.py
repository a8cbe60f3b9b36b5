"""``nki_lib.dry_run(fn, *args, **kwargs)``: a migration reading of a user's own step.

Runs ``fn`` once with every ``torch.ops.nki`` op served by its NKI kernels on the simulator
(non-strict: a call the kernels cannot serve falls back to the reference and the reason is
recorded), and reads, per op: calls, paths, fallback reasons with counts, the distinct kernel
specializations with their shapes (each one a device compilation on Neuron), the estimated device
time per call in both cost-model estimates (program order; dependency-bound schedule) plus the
host-side preparation ops around the kernels (``nki_lib.bench.whole_op``), and each op's share
of the estimated total. Plain torch ops of ``fn`` outside the nki ops are not estimated (they are
not our kernels; on Neuron TorchNeuron runs them).
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from nki_lib.migration.report import DryRunReport, OpReport, Specialization

__all__ = ["dry_run"]


def _progress():
    """A progress counter of nki op calls on stderr (tqdm; nothing when tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(desc="nki dry run", unit=" op calls", file=sys.stderr, leave=False, dynamic_ncols=True)


def _describe_spec(key: tuple) -> Specialization:
    name, grid, args, kwargs = key
    shapes = [f"{dtype.replace('torch.', '')}{list(shape)}" for kind, *rest in
              (a for a in args if isinstance(a, tuple) and a and a[0] == "tensor") for shape, dtype in [rest]]
    constants = [a for a in args if not (isinstance(a, tuple) and a and a[0] == "tensor")]
    constants += [f"{k}={v}" for k, v in kwargs]
    return Specialization(kernel=name, grid=grid, tensors=shapes, constants=[str(c) for c in constants])


def dry_run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DryRunReport:
    """Run ``fn(*args, **kwargs)`` once with the nki ops on the simulator and return the reading.

    The estimates are for the simulator's current target (``nki_lib.simulator.get_target()``).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    import nki_lib
    from nki_lib.bench.whole_op import host_cost, record_host_ops
    from nki_lib.coverage import LEDGER
    from nki_lib.dispatch import collect_runs
    from nki_lib.simulator import get_target
    from nki_lib.simulator.profile import estimate, params

    target = get_target()
    bar = _progress()
    started = time.perf_counter()
    with LEDGER.scope() as scoped, LEDGER.on_call(lambda op, path: bar.update(1) if bar is not None else None), \
            nki_lib.use_backend("simulator"), nki_lib.strict(False), collect_runs() as runs, \
            record_host_ops() as host_ops:
        result = fn(*args, **kwargs)
    wall_s = time.perf_counter() - started
    if bar is not None:
        bar.close()
    del result
    coverage, spec_keys = scoped.snapshot(), scoped.specialization_keys()

    kernel_us: dict = defaultdict(float)
    bound_us: dict = defaultdict(float)
    launches: Counter = Counter()
    for op, report in runs:
        if report is None or report.trace is None:
            continue
        est = estimate(report, target)
        kernel_us[op] += est.time_ns * 1e-3
        bound_us[op] += est.dependency_bound_ns * 1e-3
        launches[op] += 1
    host_by_op = defaultdict(list)
    for host in host_ops:
        host_by_op[host.op].append(host)
    hw = params(target)

    ops = []
    for op in sorted(coverage):
        paths = coverage[op]
        calls = sum(s.calls for s in paths.values())
        fallbacks = Counter()
        for path, stats in paths.items():
            for reason, n in stats.fallbacks.items():
                fallbacks[f"{path}: {reason}"] += n
        host = host_cost(host_by_op.get(op, []), hw)
        ops.append(OpReport(
            op=op, calls=calls, paths={p: s.calls for p, s in sorted(paths.items()) if s.calls},
            fallbacks=dict(fallbacks), kernel_launches=launches[op],
            specializations=[_describe_spec(k) for k in sorted(spec_keys.get(op, ()), key=repr)],
            kernel_us=kernel_us[op], dependency_bound_us=bound_us[op], host_us=host["time_us"],
            host_ops=dict(sorted(host["ops"].items())), host_hbm_bytes=int(host["hbm_bytes"])))
    return DryRunReport(target=target, ops=ops, wall_s=wall_s,
                        emulated_aten=dict(coverage.emulated_aten))
