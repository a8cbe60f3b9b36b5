"""Registry-driven contract tests: every registered op gets them with no new test code.

opcheck (all four sub-tests), fake vs real metadata, torch.compile(fullgraph=True) with
aot_eager and inductor (static and dynamic shapes, forward and backward), torch.export
save/load round trip, gradcheck in float64 on the reference path, the reference path's own
parity against the fp64 oracle, non-contiguous inputs, and bitwise determinism on the simulator.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nki_lib
from nki_lib import registry
from nki_lib.numerics import GRADCHECK
from nki_lib.numerics.oppar import op_parity

SPECS = registry.all_specs()
IDS = [s.name for s in SPECS]


def _detached(sample, requires_grad=False):
    def conv(t):
        out = t.detach().clone()
        return out.requires_grad_(requires_grad and t.requires_grad and out.is_floating_point())
    return sample.map_tensors(conv)


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _loss(outputs):
    """A scalar touching every floating output (non-finite entries masked)."""
    total = 0.0
    for i, o in enumerate(outputs):
        if o.is_floating_point():
            finite = torch.where(torch.isfinite(o), o, torch.zeros_like(o))
            total = total + (finite * (i + 1)).sin().sum()
    return total


def _grad_leaves(sample):
    return [a for a in sample.args if isinstance(a, torch.Tensor) and a.requires_grad]


def _fwd_bwd(fn, sample, differentiable):
    outs = _outputs(fn(*sample.args, **sample.kwargs))
    grads = []
    if differentiable and _grad_leaves(sample):
        grads = torch.autograd.grad(_loss(outs), _grad_leaves(sample), allow_unused=True)
    return [o.detach() for o in outs], [None if g is None else g.detach() for g in grads]


def _assert_same(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a is None or e is None:
            assert a is None and e is None, f"{what}[{i}]: one gradient is None"
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{i}]: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=f"{what}[{i}] differs")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(spec, requires_grad):
    if requires_grad and not spec.differentiable:
        pytest.skip("op is not differentiable")
    for sample in spec.samples(torch.float32, requires_grad):
        torch.library.opcheck(spec.op, sample.args, sample.kwargs)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fake_matches_real(spec):
    for sample in spec.samples(torch.float32, False):
        real = _outputs(spec.op(*sample.args, **sample.kwargs))
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_sample = sample.map_tensors(mode.from_tensor)
            fake = _outputs(spec.op(*fake_sample.args, **fake_sample.kwargs))
        for r, f in zip(real, fake):
            assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride()), sample.label
            assert r.is_contiguous()


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_outputs_are_fresh(spec):
    for sample in spec.samples(torch.float32, False):
        outs = _outputs(spec.op(*sample.args, **sample.kwargs))
        inputs = [a for a in (*sample.args, *sample.kwargs.values()) if isinstance(a, torch.Tensor)]
        for o in outs:
            for t in inputs:
                assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or o.numel() == 0


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(spec, compile_backend, dynamic):
    torch._dynamo.reset()
    fn = torch.compile(lambda *a, **k: spec.op(*a, **k), backend=compile_backend, fullgraph=True,
                       dynamic=dynamic)
    samples = spec.samples(torch.float32, spec.differentiable)
    if compile_backend == "inductor":
        samples = samples[:2]  # inductor compiles are slow on 2 cores; aot_eager covers every sample
    for sample in samples:
        eager = _fwd_bwd(spec.op, _detached(sample, True), spec.differentiable)
        compiled = _fwd_bwd(fn, _detached(sample, True), spec.differentiable)
        for (e, c, what) in ((eager[0], compiled[0], "outputs"), (eager[1], compiled[1], "grads")):
            for i, (a, b) in enumerate(zip(c, e)):
                if a is None or b is None:
                    assert a is None and b is None
                    continue
                torch.testing.assert_close(a, b, equal_nan=True, msg=f"{sample.label}: {what}[{i}]")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_export_round_trip(spec):
    sample = _detached(spec.samples(torch.float32, False)[0])

    class Wrapper(torch.nn.Module):
        def forward(self, *args):
            return spec.op(*args, **sample.kwargs)

    args = tuple(sample.args)
    exported = torch.export.export(Wrapper(), args)
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    expected = _outputs(spec.op(*args, **sample.kwargs))
    actual = _outputs(loaded.module()(*args))
    _assert_same(actual, expected, f"{spec.name} export")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_gradcheck_reference_float64(spec):
    if not spec.differentiable:
        pytest.skip("op is not differentiable")
    with nki_lib.use_backend("reference"):
        for sample in spec.samples(torch.float64, True)[:3]:
            leaves = _grad_leaves(sample)
            positions = [i for i, a in enumerate(sample.args) if any(a is leaf for leaf in leaves)]

            def fn(*tensors, sample=sample, positions=positions):
                args = list(sample.args)
                for pos, t in zip(positions, tensors):
                    args[pos] = t
                outs = _outputs(spec.op(*args, **sample.kwargs))
                return tuple(torch.where(torch.isfinite(o), o, torch.zeros_like(o))
                             for o in outs if o.is_floating_point())

            assert torch.autograd.gradcheck(fn, tuple(leaves), fast_mode=True, **GRADCHECK), sample.label


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_reference_parity(spec, dtype):
    """The reference path (what CPU/CUDA users run) against the fp64 oracle, outputs and grads."""
    for sample in spec.samples(dtype, spec.differentiable):
        result = op_parity(spec, sample, path="reference")
        assert result.ok, str(result)


def _strided(t):
    """The same values in a non-contiguous view (last-dim stride 2)."""
    if t.dim() < 1 or t.numel() <= 1:
        return t.clone()
    view = torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_non_contiguous_inputs(spec):
    """Strided inputs are accepted: same result up to float32 rounding on the reference path
    (BLAS may pick another summation order for strided operands), bitwise on the simulator."""
    for sample in spec.samples(torch.float32, False):
        nc = sample.map_tensors(_strided)
        expected = _outputs(spec.op(*sample.args, **sample.kwargs))
        actual = _outputs(spec.op(*nc.args, **nc.kwargs))
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, equal_nan=True)
    sample = spec.samples(torch.bfloat16, False)[0]
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        expected = _outputs(spec.op(*sample.args, **sample.kwargs))
        nc = sample.map_tensors(_strided)
        actual = _outputs(spec.op(*nc.args, **nc.kwargs))
    _assert_same(actual, expected, "simulator outputs")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_simulator_deterministic(spec):
    """Two simulator runs of the same call are bitwise equal (outputs and gradients)."""
    sample = spec.samples(torch.bfloat16, spec.differentiable)[0]
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        first = _fwd_bwd(spec.op, _detached(sample, True), spec.differentiable)
        second = _fwd_bwd(spec.op, _detached(sample, True), spec.differentiable)
    _assert_same(first[0], second[0], "outputs")
    _assert_same(first[1], second[1], "grads")
