"""The scale-out bench's byte formulas equal the bytes the implementations send (counted by
``collectives.count_traffic`` on 2 and 4 gloo ranks), forward and backward; plus the visible
fractions it scales kernel time by."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from nki_lib.attention import ring_attention
from nki_lib.bench.scaleout import (
    expert_parallel_traffic,
    ring_attention_traffic,
    visible_fractions,
)
from nki_lib.collectives import count_traffic
from nki_lib.moe import MoE, shard_moe

B, HQ, HKV, L, D = 1, 4, 2, 4, 8
H, I, E, K, T = 8, 4, 4, 2, 5


def _measure(rank, world):
    torch.manual_seed(rank)
    q, k, v = (torch.randn(B, h, L, D, requires_grad=True) for h in (HQ, HKV, HKV))
    with count_traffic() as ring_fwd:
        out = ring_attention(q, k, v, group=None, causal=True, split="zigzag")
    with count_traffic() as ring_bwd:
        out.sum().backward()
    torch.manual_seed(0)
    moe = shard_moe(MoE(H, I, E, K, block_size=4), None, capacity_factor=1.5)
    x = torch.randn(T, H, requires_grad=True)
    with count_traffic() as ep_fwd:
        y = moe(x)
    with count_traffic() as ep_bwd:
        y.sum().backward()
    return {"ring_fwd": ring_fwd["ring"], "ring_bwd": ring_bwd["ring"], "ep_fwd": ep_fwd["all_to_all"],
                "ep_bwd": ep_bwd["all_to_all"], "others": ring_fwd["all_to_all"] + ep_fwd["ring"]}


@pytest.mark.parametrize("world", [2, 4])
def test_formulas_match_the_bytes_sent(world):
    ring = ring_attention_traffic(batch=B, kv_heads=HKV, local_len=L, head_dim=D, world=world, dtype_bytes=4)
    ep = expert_parallel_traffic(tokens=T, hidden=H, top_k=K, world=world, dtype_bytes=4, capacity_factor=1.5)
    for counted in run_ranks(world, _measure):
        assert (counted["ring_fwd"], counted["ring_bwd"]) == (ring.forward, ring.backward)
        assert (counted["ep_fwd"], counted["ep_bwd"]) == (ep.forward, ep.backward)
        assert counted["others"] == 0 and ring.forward > 0 and ep.forward > 0


def test_visible_fractions():
    # causal contiguous: rank 0 sees only its own block, lower triangle incl. diagonal
    assert visible_fractions(world=4, local_len=4, causal=True, split="contiguous", rank=0) == [10 / 16, 0, 0, 0]
    assert visible_fractions(world=2, local_len=4, causal=False) == [1.0, 1.0]
    # zigzag balances: every rank computes the same total work
    totals = {round(sum(visible_fractions(world=4, local_len=4, causal=True, split="zigzag", rank=r)), 9)
              for r in range(4)}
    assert len(totals) == 1


def test_figures_compare_the_collective_with_the_chip_kernel_time(monkeypatch):
    from nki_lib.bench import scaleout
    from nki_lib.simulator.profile import params

    hw = params("trn2")
    monkeypatch.setattr(scaleout, "_kernel_us", lambda case: {"forward": 800.0, "backward": 1600.0})
    ring = scaleout.ring_figures(scaleout.SCALEOUT_CASES[0], hw)
    traffic = ring["traffic"]
    assert ring["forward"]["comm_us"] == traffic["forward"] / (hw.neuronlink_bw_chip / hw.neuronlink_links) * 1e-3
    assert ring["forward"]["chip_kernel_us"] == sum(ring["visible_fractions"]) * 800.0 / hw.cores_per_chip
    ep_case = next(c for c in scaleout.SCALEOUT_CASES if c.kind == "expert_parallel")
    ep = scaleout.ep_figures(ep_case, hw)
    assert ep["backward"]["comm_us"] == ep["traffic"]["backward"] / hw.neuronlink_bw_chip * 1e-3
    for fig in (ring["forward"], ring["backward"], ep["forward"], ep["backward"]):
        assert fig["bound"] == ("collective" if fig["comm_us"] > fig["chip_kernel_us"] else "kernel")
    assert "collective" in scaleout.table([{"label": "x", **ep, "forward": {**ep["forward"], "bound": "collective"}}])
