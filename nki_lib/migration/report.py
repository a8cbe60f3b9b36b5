"""The dry-run reading: per-op rows, totals, a text table (``str``) and JSON (``to_json``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Specialization:
    """One distinct kernel launch signature: one compilation on a Neuron device."""

    kernel: str
    grid: int
    tensors: list          # dtype[shape] of each tensor argument, in order
    constants: list        # the non-tensor arguments (baked into the compiled kernel)

    def __str__(self) -> str:
        lnc = f"[lnc={self.grid}]" if self.grid != 1 else ""
        return f"{self.kernel}{lnc}({', '.join(self.tensors)})"


@dataclass
class OpReport:
    op: str
    calls: int
    paths: dict                    # path -> calls it served
    fallbacks: dict                # "path: reason" -> count
    kernel_launches: int
    specializations: list          # Specialization
    kernel_us: float               # all calls, program-order estimate
    dependency_bound_us: float     # all calls, dependency-bound estimate
    host_us: float                 # all calls, host-side preparation ops on the device
    host_ops: dict = field(default_factory=dict)   # aten op -> count
    host_hbm_bytes: int = 0

    def per_call(self, total_us: float) -> float:
        return total_us / self.calls if self.calls else 0.0


@dataclass
class DryRunReport:
    target: str
    ops: list                      # OpReport
    wall_s: float
    emulated_aten: dict = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        return sum(o.calls for o in self.ops)

    @property
    def total_us(self) -> float:
        """Estimated device time of the nki ops: kernels (program order) + host-side ops."""
        return sum(o.kernel_us + o.host_us for o in self.ops)

    @property
    def total_dependency_bound_us(self) -> float:
        return sum(o.dependency_bound_us + o.host_us for o in self.ops)

    @property
    def compilations(self) -> int:
        return sum(len(o.specializations) for o in self.ops)

    @property
    def fallback_calls(self) -> int:
        return sum(sum(o.fallbacks.values()) for o in self.ops)

    def share(self, op: OpReport) -> float:
        total = self.total_us
        return (op.kernel_us + op.host_us) / total if total else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        for row, op in zip(data["ops"], self.ops):
            row["kernel_us_per_call"] = op.per_call(op.kernel_us)
            row["dependency_bound_us_per_call"] = op.per_call(op.dependency_bound_us)
            row["host_us_per_call"] = op.per_call(op.host_us)
            row["share"] = self.share(op)
        data["totals"] = {"calls": self.total_calls, "fallback_calls": self.fallback_calls,
                          "compilations": self.compilations, "estimated_us": self.total_us,
                          "estimated_dependency_bound_us": self.total_dependency_bound_us}
        return data

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        header = ("op", "calls", "path", "compilations", "us/call", "us/call dep-bound", "host us/call",
                  "share", "fallbacks")
        rows = [header]
        for op in self.ops:
            paths = ", ".join(f"{p} {n}" for p, n in op.paths.items())
            reasons = "; ".join(f"{r} (x{n})" for r, n in op.fallbacks.items()) or "-"
            rows.append((op.op, str(op.calls), paths, str(len(op.specializations)),
                         f"{op.per_call(op.kernel_us + op.host_us):.1f}",
                         f"{op.per_call(op.dependency_bound_us + op.host_us):.1f}",
                         f"{op.per_call(op.host_us):.1f}", f"{100 * self.share(op):.0f}%", reasons))
        title = (f"nki dry run on {self.target} (estimated device time; kernels on the simulator, "
                 f"{self.wall_s:.1f} s here)")
        lines = [title]
        if len(rows) == 1:
            return lines[0] + "\nno nki op was called"
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        table.insert(1, "  ".join("-" * w for w in widths))
        lines += table
        lines.append(f"total: {self.total_calls} calls, {self.fallback_calls} fell back, {self.compilations} "
                     f"kernel compilations, {self.total_us:.1f} us estimated "
                     f"({self.total_dependency_bound_us:.1f} us dependency-bound)")
        lines.append("kernel specializations (one device compilation each):")
        for op in self.ops:
            for spec in op.specializations:
                lines.append(f"  {op.op}: {spec}")
        host = [(op.op, op.host_ops) for op in self.ops if op.host_ops]
        if host:
            lines.append("host-side preparation ops (run as device ops around the kernels):")
            for name, counts in host:
                lines.append(f"  {name}: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
        return "\n".join(lines)
