"""``experts_implementation="nki"`` on tiny transformers MoE models (Mixtral, Qwen3-MoE, gpt-oss)
built from configs with random weights (no downloads): logits and gradients against the model's
own eager experts (parity rule of nki_lib.numerics, fp64 eager oracle), router-logit capture and
the auxiliary loss, on the reference and the simulator paths."""

from __future__ import annotations

import copy

import pytest
import torch

import nki_lib
from nki_lib.integrations import transformers_moe
from nki_lib.numerics import parity

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 6, 2
SWIGLU_LIMIT = 0.3     # small enough that gpt-oss's clamps engage on these tiny random weights


def tiny_model(kind: str, layers: int = 2):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, router_aux_loss_coef=0.02)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                            **common)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=False,
                                             mlp_only_layers=[], **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.GptOssConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                           layer_types=["sliding_attention", "full_attention"][:layers],
                                           sliding_window=4, swiglu_limit=SWIGLU_LIMIT, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                           **common)
        model = transformers.GptOssForCausalLM(config)
    _randomize_biases(model)
    return model.eval()


def _randomize_biases(model):
    """gpt-oss initialises its router and expert biases to zero: make them matter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def run(model, impl, dtype, path="reference", strict=False, autocast=None):
    """(logits, {param: grad}, outputs) of one forward/backward of a copy of ``model`` (in
    ``dtype``, inside ``torch.autocast(dtype=autocast)`` when given)."""
    m = copy.deepcopy(model).to(dtype)
    m.set_experts_implementation(impl)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with nki_lib.use_backend(path), nki_lib.strict(strict), \
            torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = m(ids, output_router_logits=True, labels=ids)
        (out.logits * probe.to(out.logits.dtype)).sum().backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, out


@pytest.fixture(scope="module", autouse=True)
def _registered():
    transformers_moe.register()


def check_model(kind, dtype, path, strict=False):
    model = tiny_model(kind)
    logits, grads, out = run(model, "nki", dtype, path, strict)
    base_logits, base_grads, base_out = run(model, "eager", dtype)
    oracle_logits, oracle_grads, oracle_out = run(model, "eager", torch.float64)
    checks = [parity(logits, oracle_logits, base_logits, kind="output", dtype=dtype, name="logits")]
    checks += [parity(out.aux_loss, oracle_out.aux_loss, base_out.aux_loss, kind="output", dtype=dtype,
                      name="aux_loss")]
    # HF's router stays in charge: one captured router-logit tensor per layer, the first layer's
    # bit-equal to the eager run's (same inputs), every layer's within the parity rule
    assert len(out.router_logits) == len(oracle_out.router_logits) == model.config.num_hidden_layers
    assert torch.equal(out.router_logits[0], base_out.router_logits[0])
    checks += [parity(mine, oracle, base, kind="output", dtype=dtype, name=f"router_logits[{i}]")
               for i, (mine, oracle, base) in enumerate(zip(out.router_logits, oracle_out.router_logits,
                                                            base_out.router_logits))]
    assert set(grads) == set(oracle_grads)
    checks += [parity(grads[n], oracle_grads[n], base_grads[n], kind="grad", dtype=dtype, name=n)
               for n in oracle_grads]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_reference_path_matches_eager(kind, dtype):
    check_model(kind, dtype, "reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_simulator_path_matches_eager(kind, dtype):
    """The NKI kernels (strict: no fallback anywhere in the experts) on the simulator."""
    check_model(kind, dtype, "simulator", strict=True)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_autocast_matches_eager(kind):
    """A float32 model under bf16 autocast: the experts op casts its operands like SDPA (no dtype
    error between fp32 activations and bf16 routing weights) and matches the eager experts under
    the same autocast (parity rule, bf16; fp64 oracle without autocast)."""
    model = tiny_model(kind)
    logits, grads, _ = run(model, "nki", torch.float32, "simulator", strict=True, autocast=torch.bfloat16)
    base_logits, base_grads, _ = run(model, "eager", torch.float32, autocast=torch.bfloat16)
    oracle_logits, oracle_grads, _ = run(model, "eager", torch.float64)
    checks = [parity(logits, oracle_logits, base_logits, kind="output", dtype=torch.bfloat16, name="logits")]
    checks += [parity(grads[n], oracle_grads[n], base_grads[n], kind="grad", dtype=torch.bfloat16, name=n)
               for n in oracle_grads]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_unsupported_gate_is_a_recorded_fallback():
    model = tiny_model("mixtral", layers=1)
    experts = model.model.layers[0].mlp.experts
    experts.has_post_expert_norm = True          # a layout the op cannot serve
    nki_lib.reset_coverage()
    logits, _, _ = run(model, "nki", torch.float32)
    base_logits, _, _ = run(model, "eager", torch.float32)
    assert torch.equal(logits, base_logits)
    stats = nki_lib.coverage()["moe_experts"][transformers_moe.FALLBACK_PATH]
    assert stats.fallbacks["post-expert norm"] >= 1
    with pytest.raises(nki_lib.NKIFallbackError, match="post-expert norm"):
        run(model, "nki", torch.float32, strict=True)


def test_integration_register_enables_experts():
    """``nki_lib.integrations.transformers.register()`` (the public entry point) also registers the
    experts implementation, and a model built with it routes its experts through the nki op."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from nki_lib.integrations import transformers as integration

    integration.register()
    assert ALL_EXPERTS_FUNCTIONS["nki"] is transformers_moe.nki_experts_forward
    nki_lib.reset_coverage()
    run(tiny_model("mixtral", layers=1), "nki", torch.float32)
    assert nki_lib.coverage()["moe_experts"]["reference"].calls >= 1
