"""Parity of one op call against its fp64 oracle, with the low-precision baseline as yardstick.

Used by the parity tests and by the report, so both judge the same way:

* kernel:   the op on the requested path (simulator, strict: a fallback is an error),
* oracle:   ``spec.naive`` on the inputs upcast to float64,
* baseline: ``spec.naive`` on the inputs as given (plain PyTorch in the same low precision).

Gradients are taken of ``sum(w_i * out_i)`` over the floating outputs with fixed random weights
``w_i`` (non-finite output entries, e.g. ``lse = -inf`` of empty rows, get weight 0 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nki_lib import backend
from nki_lib.numerics import Parity, parity
from nki_lib.registry import OpSpec, Sample


@dataclass
class OpParity:
    sample: Sample
    checks: list[Parity]
    exact_mismatches: list[str]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks) and not self.exact_mismatches

    def __str__(self) -> str:
        lines = [f"{self.sample.label}: {'ok' if self.ok else 'FAIL'}"]
        lines += [f"  {c}" for c in self.checks] + [f"  {m}" for m in self.exact_mismatches]
        return "\n".join(lines)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _leaf(sample: Sample, dtype_fn, requires_grad: bool) -> Sample:
    def conv(t: torch.Tensor) -> torch.Tensor:
        out = dtype_fn(t.detach())
        if requires_grad and t.requires_grad and out.is_floating_point():
            out.requires_grad_(True)
        return out
    return sample.map_tensors(conv)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.is_floating_point() else t.clone()


def _grad_inputs(sample: Sample) -> list[tuple[str, torch.Tensor]]:
    named = [(f"arg{i}", a) for i, a in enumerate(sample.args)]
    return [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(fn, sample: Sample, weights, want_grads: bool):
    outs = _as_tuple(fn(*sample.args, **sample.kwargs))
    grads = []
    if want_grads:
        inputs = [t for _, t in _grad_inputs(sample)]
        terms = [(torch.where(torch.isfinite(o), o, torch.zeros_like(o)) * w.to(o.dtype)).sum()
                 for o, w in zip(outs, weights) if w is not None]
        grads = list(torch.autograd.grad(sum(terms), inputs, allow_unused=True))
    return [o.detach() for o in outs], grads


def op_parity(spec: OpSpec, sample: Sample, *, path: str = "simulator", grads: bool | None = None,
              seed: int = 0) -> OpParity:
    """Run ``sample`` through the op on ``path`` (strict) and judge outputs and gradients."""
    want_grads = spec.differentiable if grads is None else grads
    want_grads = want_grads and bool(_grad_inputs(sample))
    # The precision the call runs in: that of its first floating input (integer-only ops such as
    # moe_plan have integer outputs only, compared exactly).
    dtype = next((a.dtype for a in sample.args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                 torch.float32)
    with torch.no_grad():
        probe = _as_tuple(spec.naive(*sample.args, **sample.kwargs))
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) if o.is_floating_point() else None
               for o in probe]

    with backend.use_backend(path), backend.strict(True):
        k_outs, k_grads = _run(spec.op, _leaf(sample, lambda t: t.clone(), want_grads), weights, want_grads)
    o_outs, o_grads = _run(spec.naive, _leaf(sample, _upcast, want_grads), weights, want_grads)
    b_outs, b_grads = _run(spec.naive, _leaf(sample, lambda t: t.clone(), want_grads), weights, want_grads)

    checks, mismatches = [], []
    for i, (k, o, b) in enumerate(zip(k_outs, o_outs, b_outs)):
        if k.shape != o.shape or k.dtype != b.dtype:
            mismatches.append(f"out{i}: kernel {tuple(k.shape)} {k.dtype} vs expected {tuple(o.shape)} {b.dtype}")
        elif k.is_floating_point():
            checks.append(parity(k, o, b, kind="output", dtype=dtype, name=f"out{i}"))
        elif not torch.equal(k, o):
            mismatches.append(f"out{i}: integer output differs from the oracle in "
                              f"{int((k != o).sum())} of {k.numel()} entries")
    names = [n for n, _ in _grad_inputs(sample)]
    for name, k, o, b in zip(names, k_grads, o_grads, b_grads):
        if k is None or o is None:
            if (k is None) != (o is None):
                mismatches.append(f"grad {name}: kernel {'None' if k is None else 'tensor'} vs oracle "
                                  f"{'None' if o is None else 'tensor'}")
            continue
        checks.append(parity(k, o, b if b is not None else torch.zeros_like(o), kind="grad",
                             dtype=dtype, name=f"grad {name}"))
    return OpParity(sample, checks, mismatches)
