"""Error metrics and the one tolerance table of nki-lib.

The parity rule (flash-attn's): against an fp64 oracle, the kernel's max abs error may be at most
``factor`` times the error of plain PyTorch computing the same thing in the same low precision
(the *baseline*), plus a noise floor of ``floor_ulps`` units of the dtype's epsilon at the
oracle's magnitude. ``factor`` is 2 for outputs and 3 for gradients. Every test and the report
take their tolerances from :data:`TOLERANCES`; no test carries a literal tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "TOLERANCES", "GRADCHECK", "Parity", "max_abs_error", "parity", "assert_parity", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    factor: float       # allowed multiple of the baseline's error
    floor_ulps: float   # noise floor, in eps(dtype) at the oracle's max magnitude


# (kind, dtype) -> Tolerance. kind: "output" or "grad". float64 only occurs on the reference path
# (NKI has no float64), where the reference must match the fp64 oracle to rounding.
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    ("output", torch.float32): Tolerance(factor=2.0, floor_ulps=8.0),
    ("output", torch.bfloat16): Tolerance(factor=2.0, floor_ulps=1.0),
    ("output", torch.float16): Tolerance(factor=2.0, floor_ulps=1.0),
    ("output", torch.float64): Tolerance(factor=2.0, floor_ulps=1e4),
    ("grad", torch.float32): Tolerance(factor=3.0, floor_ulps=16.0),
    ("grad", torch.bfloat16): Tolerance(factor=3.0, floor_ulps=2.0),
    ("grad", torch.float16): Tolerance(factor=3.0, floor_ulps=2.0),
    ("grad", torch.float64): Tolerance(factor=3.0, floor_ulps=1e4),
}


# torch.autograd.gradcheck in float64 (finite differences vs the analytical backward).
GRADCHECK = {"atol": 1e-6, "rtol": 1e-5}


def tolerance(kind: str, dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[(kind, dtype)]
    except KeyError:
        raise ValueError(f"no tolerance for kind={kind!r}, dtype={dtype}") from None


def max_abs_error(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max abs difference in float64; matching infinities (same sign) count as equal, NaN vs
    anything but NaN counts as infinite error."""
    a = actual.detach().to(torch.float64).cpu()
    o = oracle.detach().to(torch.float64).cpu()
    if a.shape != o.shape:
        raise ValueError(f"shape mismatch: actual {tuple(a.shape)} vs oracle {tuple(o.shape)}")
    if a.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(o)
    same_inf = torch.isinf(a) & torch.isinf(o) & (torch.sign(a) == torch.sign(o))
    diff = (a - o).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return float(diff.max())


@dataclass(frozen=True)
class Parity:
    name: str
    error: float          # kernel vs oracle
    baseline_error: float # plain low-precision PyTorch vs oracle
    allowed: float
    ok: bool

    @property
    def ratio(self) -> float:
        """Kernel error over baseline error (inf if the baseline is exact and the kernel not)."""
        if self.baseline_error == 0.0:
            return 0.0 if self.error == 0.0 else float("inf")
        return self.error / self.baseline_error

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{self.name}: err={self.error:.3e} baseline={self.baseline_error:.3e} "
                f"ratio={self.ratio:.2f} allowed={self.allowed:.3e} {verdict}")


def parity(actual: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor, *, kind: str,
           dtype: torch.dtype, name: str = "") -> Parity:
    """Judge ``actual`` against the fp64 ``oracle`` with the ``baseline`` error as yardstick."""
    tol = tolerance(kind, dtype)
    finite = oracle.detach().to(torch.float64)
    finite = finite[torch.isfinite(finite)]
    magnitude = float(finite.abs().max()) if finite.numel() else 0.0
    err = max_abs_error(actual, oracle)
    base = max_abs_error(baseline, oracle)
    eps = torch.finfo(dtype).eps
    allowed = tol.factor * base + tol.floor_ulps * eps * magnitude
    return Parity(name, err, base, allowed, err <= allowed)


def assert_parity(actual, oracle, baseline, *, kind: str, dtype: torch.dtype, name: str = "") -> Parity:
    result = parity(actual, oracle, baseline, kind=kind, dtype=dtype, name=name)
    if not result.ok:
        raise AssertionError(str(result))
    return result
