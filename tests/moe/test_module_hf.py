"""``MoE.from_hf`` / ``MoE.to_hf`` on the MoE blocks of tiny transformers models (Mixtral,
Qwen3-MoE, gpt-oss; random weights, no downloads): the MoE computes the block's output and
router logits (numerics parity rule against the block in float64), the round trip restores every
parameter exactly, and ``load_balancing_loss(convention="hf")`` is transformers'
``load_balancing_loss_func``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import nki_lib
from nki_lib.moe import MoE, load_balancing_loss
from nki_lib.numerics import parity

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from test_transformers_moe import tiny_model  # noqa: E402

KINDS = ["mixtral", "qwen3_moe", "gpt_oss"]


def block_of(kind):
    model = tiny_model(kind, layers=1)
    model.set_experts_implementation("eager")          # the modeling file's own loop (float64 too)
    return model.model.layers[0].mlp


def block_forward(block, x):
    """(y, router logits) of an HF block on x (B, S, H)."""
    router = getattr(block, "gate", None) or block.router
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    return y, router(x.reshape(-1, x.shape[-1]))[0]


def moe_forward(moe, x, path):
    with nki_lib.use_backend(path), nki_lib.strict(path != "reference"):
        y = moe(x)
    return y, moe.last_logits


@pytest.mark.parametrize("path", ["reference", "simulator"])
@pytest.mark.parametrize("kind", KINDS)
def test_from_hf_computes_the_block(kind, path):
    block = block_of(kind).float()
    moe = MoE.from_hf(block, block_size=8)
    x = torch.randn(2, 5, moe.hidden_size, generator=torch.Generator().manual_seed(4))
    oracle = block_forward(copy.deepcopy(block).double(), x.double())
    base = block_forward(block, x)
    mine = moe_forward(moe, x, path)
    assert torch.equal(moe.last_topk_ids.long().sort(-1).values,
                       torch.topk(oracle[1], moe.top_k, -1).indices.sort(-1).values)
    checks = [parity(m, o, b, kind="output", dtype=torch.float32, name=n)
              for n, m, o, b in zip(("y", "router_logits"), mine, oracle, base)]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_restores_every_parameter(kind):
    block = block_of(kind)
    moe = MoE.from_hf(block)
    target = copy.deepcopy(block)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    moe.to_hf(target)
    for (name, mine), theirs in zip(target.named_parameters(), block.parameters()):
        assert torch.equal(mine, theirs), name
    again = MoE.from_hf(target)
    for (name, a), b in zip(again.named_parameters(), moe.parameters()):
        assert torch.equal(a, b), name


def test_gpt_oss_block_maps_biases_and_gate():
    moe = MoE.from_hf(block_of("gpt_oss"))
    assert moe.activation == "clamped_swiglu" and moe.router_bias is not None and moe.down_bias is not None
    assert moe.gate_flags["swiglu_limit"] == block_of("gpt_oss").experts.limit


@pytest.mark.parametrize("kind", KINDS)
def test_from_hf_keeps_the_blocks_layout_or_takes_the_one_asked(kind):
    """gpt-oss stores its experts transposed: from_hf keeps that layout ("in_out"; its down_proj
    is the MoE's w_down as it is), the others keep nn.Linear's; either can be asked for, and both
    compute the same and round-trip every parameter."""
    block = block_of(kind).float()
    native = "in_out" if kind == "gpt_oss" else "out_in"
    moe = MoE.from_hf(block, block_size=8)
    assert moe.weight_layout == native
    if kind == "gpt_oss":
        assert torch.equal(moe.w_down, block.experts.down_proj)
    other = MoE.from_hf(block, weight_layout="out_in" if native == "in_out" else "in_out", block_size=8)
    assert torch.equal(other.w_down.transpose(1, 2), moe.w_down)
    x = torch.randn(2, 5, moe.hidden_size, generator=torch.Generator().manual_seed(4))
    assert torch.equal(moe_forward(moe, x, "simulator")[0], moe_forward(other, x, "simulator")[0])
    target = copy.deepcopy(block)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    other.to_hf(target)
    for (name, mine), theirs in zip(target.named_parameters(), block.parameters()):
        assert torch.equal(mine, theirs), name


def test_unmappable_blocks_name_the_reason():
    block = block_of("mixtral")
    block.jitter_noise = 0.1
    with pytest.raises(ValueError, match="jitter"):
        MoE.from_hf(block)
    with pytest.raises(ValueError, match="activation"):
        MoE.from_hf(block_of("mixtral")).to_hf(block_of("gpt_oss"))


@pytest.mark.parametrize("masked", [False, True])
def test_hf_convention_is_transformers_loss(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(5)
    layers, batch, seq, experts, top_k = 3, 2, 7, 6, 2
    logits = [torch.randn(batch * seq, experts, generator=gen, dtype=torch.float64) for _ in range(layers)]
    mask = None
    if masked:
        mask = torch.ones(batch, seq)
        mask[0, :3] = 0
    oracle = load_balancing_loss_func(tuple(logits), experts, top_k, mask)     # transformers in float64
    base = load_balancing_loss_func(tuple(t.float() for t in logits), experts, top_k, mask)
    stacked = torch.cat(logits).float()
    ids = torch.topk(torch.softmax(stacked, -1), top_k, -1).indices
    token_mask = None if mask is None else mask.reshape(-1).repeat(layers)
    mine = load_balancing_loss(stacked, ids, experts, convention="hf", token_mask=token_mask)
    check = parity(mine, oracle, base, kind="output", dtype=torch.float32, name="aux loss")
    assert check.ok, str(check)
    switch = load_balancing_loss(stacked, ids, experts, token_mask=token_mask)   # "hf" = k * "switch"
    check = parity(top_k * switch, oracle, base, kind="output", dtype=torch.float32, name="k * switch")
    assert check.ok, str(check)
