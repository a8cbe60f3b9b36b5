"""The op registry: one declaration per op drives the contract tests, parity tests, the report
and the benchmarks, so a new op gets them for free.

Each op declares an :class:`OpSpec` in its op module (``<family>/<op>_op.py``) and calls
:func:`register`. The spec names the op's pieces by the project's grammar: the op module, the
reference (``<family>/<op>_reference.py``), the launchers (``launch_<op>_fwd`` / ``launch_<op>_bwd``
in ``<family>/kernels/<op>_fwd*.py`` / ``_bwd*.py``) and the ``@nki.jit`` kernels (``<op>_fwd_kernel``
/ ``<op>_bwd_kernel`` in ``<family>/kernels/<op>_fwd.py`` / ``_bwd.py``); ``tests/test_conventions.py``
checks every registered op against it. FLOP/byte/element formulas per op live in ``nki_lib.bench.flops`` (``cost_of(name, sample)``).
``naive`` is the plain, dense PyTorch formula with the op's signature; it
computes in the dtype of its inputs and is differentiable by autograd. Called on float64 inputs it
is the fp64 *oracle*; called on low-precision inputs it is the *baseline* ("plain PyTorch in the
same low precision") of the parity rule in :mod:`nki_lib.numerics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Sample:
    """One call: positional tensor arguments and keyword arguments, with a readable label."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    label: str = ""

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> "Sample":
        conv = lambda v: fn(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return Sample(tuple(conv(a) for a in self.args), {k: conv(v) for k, v in self.kwargs.items()}, self.label)


@dataclass(frozen=True)
class OpSpec:
    name: str                                         # torch.ops.nki.<name>
    naive: Callable[..., Any]                         # dense plain-PyTorch formula (oracle / baseline)
    samples: Callable[[torch.dtype, bool], list[Sample]]   # small cases: (dtype, requires_grad)
    report_samples: Callable[[], list[Sample]]        # representative shapes for the main job
    differentiable: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    backward_name: str | None = None                  # torch.ops.nki.<backward_name>, if any
    variants: tuple[str, ...] = ()                    # internal ops (torch.ops.nki.<variant>) serving this op's calls
    family: str = ""                                  # package under nki_lib: "attention", "moe"
    launchers: tuple[str, ...] = ()                   # dotted paths: ...kernels.<op>_fwd.launch_<op>_fwd, ...
    kernels: tuple[str, ...] = ()                     # dotted paths: ...kernels.<op>_fwd.<op>_fwd_kernel, ...

    @property
    def op(self):
        return getattr(torch.ops.nki, self.name)

    @property
    def op_module(self) -> str:
        """The module with the custom op, its fake, autograd and this spec."""
        return f"nki_lib.{self.family}.{self.name}_op"

    @property
    def reference_module(self) -> str:
        """The module with the PyTorch reference (and ``naive``)."""
        return f"nki_lib.{self.family}.{self.name}_reference"


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Register (idempotently: re-registering the same name replaces the entry)."""
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> OpSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; registered: {sorted(_REGISTRY)}") from None


def all_specs() -> list[OpSpec]:
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]
