"""nki_lib.moe.MoE forward/backward on the reference and simulator paths, the aux-loss-free bias
update, and the losses against hand computation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import nki_lib
from nki_lib.moe import MoE, load_balancing_loss, router_z_loss
from nki_lib.numerics import parity, tolerance

H, I, E, K = 16, 8, 4, 2
# hand computations in float64: the table's float64 noise floor (in eps units)
FP64_REL = tolerance("output", torch.float64).floor_ulps * torch.finfo(torch.float64).eps


def make(dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    return MoE(H, I, E, K, block_size=4, **kwargs).to(dtype)


def run(module, x, path, strict=False):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with nki_lib.use_backend(path), nki_lib.strict(strict):
        y = module(x)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y * weights.to(y.dtype)).sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    return y.detach(), grads, module.last_topk_ids


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(score_func="sigmoid", num_groups=2, topk_groups=1, num_shared_experts=1, activation="gelu"),
    dict(aux_loss_free=True, renormalize=False),
    dict(weight_layout="in_out"),
])
def test_simulator_matches_fp64_oracle(kwargs):
    """Simulator path (strict) vs a float64 copy on the reference path, judged with the float32
    reference path as baseline (nki_lib.numerics parity rule); identical routing."""
    module = make(**kwargs)
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(2))
    y_sim, g_sim, ids_sim = run(module, x, "simulator", strict=True)
    y_base, g_base, _ = run(module, x, "reference")
    oracle = copy.deepcopy(module).double()
    y_ref, g_ref, ids_ref = run(oracle, x.double(), "reference")
    assert torch.equal(ids_sim, ids_ref)
    assert y_sim.shape == x.shape
    checks = [parity(y_sim, y_ref, y_base, kind="output", dtype=torch.float32, name="y")]
    checks += [parity(g_sim[n], g_ref[n], g_base[n], kind="grad", dtype=torch.float32, name=n) for n in g_ref]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_bf16_forward_backward_on_simulator():
    module = make(torch.bfloat16, num_shared_experts=1)
    x = torch.randn(10, H).to(torch.bfloat16)
    y, grads, ids = run(module, x, "simulator", strict=True)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and ids.shape == (10, K)
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads.values())


def test_keeps_router_statistics():
    module = make()
    x = torch.randn(2, 5, H)
    module(x)
    assert module.last_logits.shape == (10, E) and module.last_logits.requires_grad
    assert module.last_topk_ids.shape == (10, K)
    assert int(module.last_tokens_per_expert.sum()) == 10 * K


def test_aux_loss_free_bias_update():
    """bias += rate * sign(mean load - load) over the training forwards since the last update;
    the bias steers selection only (no gradient)."""
    module = make(aux_loss_free=True)
    x = torch.randn(12, H)
    module(x)
    module(x)
    load = 2 * module.last_tokens_per_expert.float()
    rate = 0.25
    module.update_expert_bias(rate)
    assert torch.equal(module.expert_bias, rate * torch.sign(load.mean() - load))
    assert module.expert_bias.dtype == torch.float32 and not module.expert_bias.requires_grad
    module.eval()
    module(x)
    module.update_expert_bias(rate)           # no training forward since: load 0, sign(0) = 0
    assert torch.equal(module.expert_bias, rate * torch.sign(load.mean() - load))
    with pytest.raises(RuntimeError, match="aux_loss_free"):
        make().update_expert_bias(rate)


def test_load_balancing_loss_by_hand():
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                          dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 1], [1, 2], [0, 1]], dtype=torch.int32)
    p = [[math.exp(v) for v in row] for row in logits.tolist()]
    p = [[v / sum(row) for v in row] for row in p]
    mean_p = [sum(row[e] for row in p) / 3 for e in range(4)]
    f = [2 / 6, 3 / 6, 1 / 6, 0.0]
    expected = 4 * sum(fe * pe for fe, pe in zip(f, mean_p))
    loss = load_balancing_loss(logits, ids, 4)
    assert math.isclose(float(loss.detach()), expected, rel_tol=FP64_REL)
    loss.backward()
    # d loss / d logits[t] = E / T * softmax_t * (f - <f, softmax_t>)
    for t in range(3):
        dot = sum(fe * pe for fe, pe in zip(f, p[t]))
        want = [4 / 3 * p[t][e] * (f[e] - dot) for e in range(4)]
        assert torch.allclose(logits.grad[t], torch.tensor(want, dtype=torch.float64), rtol=FP64_REL, atol=0)


def test_uniform_routing_gives_unit_balance_loss():
    logits = torch.zeros(8, 4)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(load_balancing_loss(logits, ids, 4)) == 1.0


def test_router_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    lse = [math.log(3.0), math.log(math.exp(1) + math.exp(2) + math.exp(3))]
    loss = router_z_loss(logits)
    assert math.isclose(float(loss.detach()), (lse[0] ** 2 + lse[1] ** 2) / 2, rel_tol=FP64_REL)
    loss.backward()
    want = torch.stack([lse[t] * torch.softmax(logits.detach()[t], -1) for t in range(2)])  # 2*lse/T * p
    assert torch.allclose(logits.grad, want, rtol=FP64_REL, atol=0)


def test_losses_gradcheck():
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (5, 2))
    assert torch.autograd.gradcheck(lambda z: load_balancing_loss(z, ids, 4), (logits,))
    assert torch.autograd.gradcheck(router_z_loss, (logits,))


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        MoE(H, I, E, 0)
    with pytest.raises(ValueError, match="activation"):
        MoE(H, I, E, K, activation="relu")
    with pytest.raises(ValueError, match="num_groups"):
        MoE(H, I, E, K, num_groups=3)
    with pytest.raises(ValueError, match="hidden_size"):
        MoE(0, I, E, K)
    with pytest.raises(ValueError, match="num_shared_experts"):
        MoE(H, I, E, K, num_shared_experts=-1)
    with pytest.raises(ValueError, match="weight_layout"):
        MoE(H, I, E, K, weight_layout="transposed")
    with pytest.raises(ValueError, match="x must have shape"):
        make()(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="num_experts"):
        load_balancing_loss(torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int32), 5)
    with pytest.raises(TypeError, match="logits"):
        router_z_loss(torch.zeros(3, 4, dtype=torch.int32))


def test_functional_wrappers_call_the_ops():
    from nki_lib import moe

    x, weight = torch.randn(6, H), torch.randn(E, H)
    for got, want in zip(moe.moe_router(x, weight, top_k=K, score_func="sigmoid"),
                         torch.ops.nki.moe_router(x, weight, top_k=K, score_func="sigmoid")):
        assert torch.equal(got, want)
    ids = torch.ops.nki.moe_router(x, weight, top_k=K)[2]
    for got, want in zip(moe.moe_plan(ids, num_experts=E, block_size=4),
                         torch.ops.nki.moe_plan(ids, num_experts=E, block_size=4)):
        assert torch.equal(got, want)


def test_module_compiles_fullgraph():
    module = make(aux_loss_free=True, num_shared_experts=1)
    x = torch.randn(2, 6, H)
    eager = module(x).detach()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    assert torch.equal(y.detach(), eager)
    assert module.router_weight.grad is not None and int(module._load.sum()) == 2 * 12 * K


def test_in_out_layout_stores_the_transposed_weights_and_computes_the_same():
    """MoE(weight_layout="in_out") holds (E, H, 2I) / (E, I, H) parameters; with the transposes of
    an out_in module's weights it gives the same y (bitwise, simulator forward) and the same
    gradients, the weight gradients transposed (bitwise; :func:`run`'s backward runs on the
    default path, the reference, which computes on out_in copies in either layout)."""
    out_in, in_out = make(), make(weight_layout="in_out")
    assert in_out.w_gate_up.shape == (E, H, 2 * I) and in_out.w_down.shape == (E, I, H)
    assert "weight_layout='in_out'" in repr(in_out)
    with torch.no_grad():
        in_out.load_state_dict({n: (p.transpose(1, 2) if n in ("w_gate_up", "w_down") else p)
                                for n, p in out_in.state_dict().items()})
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(2))
    y_a, g_a, _ = run(out_in, x, "simulator", strict=True)
    y_b, g_b, _ = run(in_out, x, "simulator", strict=True)
    assert torch.equal(y_a, y_b)
    for name, grad in g_a.items():
        other = g_b[name].transpose(1, 2) if name in ("w_gate_up", "w_down") else g_b[name]
        assert torch.equal(grad, other), name
