"""The same checks as the emulated ones, on a real Trainium host (marked ``device``: skipped
without torch_neuronx and the real nki). Kernel results on hardware are compared with the parity
rule against the fp64 oracle (hardware arithmetic is not the simulator's bit for bit)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def neuron():
    import torch_neuronx  # noqa: F401  (renames PrivateUse1 to neuron)

    import nki_lib
    from nki_lib.neuron import ops

    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert ops.registered() >= set(ops.nki_opdefs())   # import nki_lib registered every neuron kernel
    return nki_lib


def _flash_sample():
    from nki_lib import registry

    spec = registry.get("flash_attention")
    return spec, spec.samples(torch.bfloat16, True)[1]


def test_eager_flash_attention_on_trainium_takes_the_device_path(neuron):
    from nki_lib.numerics import assert_parity

    spec, sample = _flash_sample()
    neuron.reset_coverage()
    moved = sample.map_tensors(lambda t: t.detach().to("neuron").requires_grad_())
    out, _ = spec.op(*moved.args, **moved.kwargs)
    assert out.device.type == "neuron"
    assert neuron.coverage()["flash_attention"]["device"].calls == 1
    oracle_in = sample.map_tensors(lambda t: t.detach().double())
    oracle, _ = spec.naive(*oracle_in.args, **oracle_in.kwargs)
    baseline, _ = spec.naive(*sample.map_tensors(lambda t: t.detach()).args, **sample.kwargs)
    assert_parity(out.cpu(), oracle, baseline, kind="output", dtype=torch.bfloat16, name="flash_attention")


def test_compiled_flash_attention_on_trainium_trains(neuron):
    """torch.compile(backend="neuron") lowers the traced body (the real backend cannot express an
    opaque nki:: node), forward and backward."""
    from nki_lib.numerics import assert_parity

    spec, sample = _flash_sample()

    def fn(q, k, v):
        return spec.op(q, k, v, **sample.kwargs)[0]

    moved = sample.map_tensors(lambda t: t.detach().to("neuron").requires_grad_())
    out = torch.compile(fn, backend="neuron", fullgraph=True)(*moved.args[:3])
    out.float().sum().backward()
    assert moved.args[0].grad is not None and moved.args[0].grad.device.type == "neuron"
    oracle = fn(*sample.map_tensors(lambda t: t.detach().double()).args[:3])
    baseline = spec.naive(*sample.map_tensors(lambda t: t.detach()).args, **sample.kwargs)[0]
    assert_parity(out.cpu(), oracle, baseline, kind="output", dtype=torch.bfloat16, name="compiled flash_attention")
