"""Expert-parallel MoE on 2 and 4 gloo ranks equals the single-process MoE with the same weights
and tokens (output and every gradient) within the numerics table; skewed routing, shared
experts, the counted drop policy and the checkpoint helpers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

import nki_lib
from nki_lib.moe import MoE, gather_moe, shard_moe
from nki_lib.numerics import parity

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 16, 8, 8, 2, 6   # TOKENS per rank


def _module(seed, *, shared, skewed, world, dtype=torch.float32):
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, INTER, EXPERTS, TOP_K, block_size=4, num_shared_experts=int(shared),
              aux_loss_free=skewed)
    if skewed:  # the bias steers selection only: every token picks rank 0's experts
        with torch.no_grad():
            moe.expert_bias[: EXPERTS // world] = 100.0
    return moe.to(dtype)


def _tokens(seed, world):
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(world * TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    w_y = torch.randn(world * TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    return x, w_y


def _run(moe, x, w_y, path="reference"):
    """Output and gradients (x, then every parameter by name) of ``sum(y * w_y)`` on ``path``
    (strict on the simulator: a fallback fails the test)."""
    leaf = x.detach().to(moe.router_weight.dtype).requires_grad_(True)
    with nki_lib.use_backend(path), nki_lib.strict(path == "simulator"):
        y = moe(leaf)
        (y.to(torch.float64) * w_y).sum().backward()
    grads = {"x": leaf.grad}
    grads.update({name: p.grad for name, p in moe.named_parameters()})
    return y.detach(), grads


def _all_reduce(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _all_gather_cat(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _ep_rank(rank, world, cases, path="reference"):
    verdicts = []
    for seed, case in enumerate(cases):
        single = _module(seed, shared=case["shared"], skewed=case["skewed"], world=world)
        sharded = shard_moe(single, None, capacity_factor=None)
        x, w_y = _tokens(seed, world)
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        y_local, grads_local = _run(sharded, x[rows], w_y[rows], path)
        stats = sharded.ep_stats()
        y = _all_gather_cat(y_local)
        grads = {"x": _all_gather_cat(grads_local["x"])}
        for name, g in grads_local.items():
            if name in MoE.EXPERT_PARAMETERS:
                grads[name] = _all_gather_cat(g)      # each rank's own experts
            elif name != "x":
                grads[name] = _all_reduce(g)          # replicated: the sum of the ranks' shares
        if rank != 0:
            continue
        assert stats["last_dropped"] == 0 and stats["capacity"] == TOKENS * TOP_K, stats
        baseline = _run(single, x, w_y, path)
        oracle = _run(_module(seed, shared=case["shared"], skewed=case["skewed"], world=world,
                              dtype=torch.float64), x, w_y)
        checks = [("y", y, baseline[0], oracle[0], "output")]
        checks += [(n, grads[n], baseline[1][n], oracle[1][n], "grad") for n in oracle[1]]
        for name, got, base, want, kind in checks:
            verdict = parity(got, want, base, kind=kind, dtype=torch.float32, name=f"{case} {name}")
            verdicts.append((verdict.ok, str(verdict)))
        if case["skewed"]:
            counts = single.last_tokens_per_expert
            verdicts.append((int(counts[EXPERTS // world:].sum()) == 0, f"skewed routing: {counts.tolist()}"))
    return verdicts


CASES = [{"shared": False, "skewed": False}, {"shared": True, "skewed": False},
         {"shared": True, "skewed": True}]


def _check(world, cases, path="reference"):
    verdicts = run_ranks(world, _ep_rank, cases, path)[0]
    assert len(verdicts) >= 4 * len(cases)
    failed = [text for ok, text in verdicts if not ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world):
    _check(world, CASES)


def test_expert_parallel_matches_single_process_simulator_path():
    """The router, plan and expert kernels (forward and backward) on the simulator, strict."""
    _check(2, CASES[2:], "simulator")


def _expected_drops(topk_ids, world, capacity):
    """Reference drop rule, written independently: per source rank and destination, the first
    ``capacity`` assignments in token-major order are kept."""
    keep = torch.ones(topk_ids.shape, dtype=torch.bool)
    for src in range(world):
        used = [0] * world
        for t in range(src * TOKENS, (src + 1) * TOKENS):
            for j in range(TOP_K):
                dest = int(topk_ids[t, j]) // (EXPERTS // world)
                keep[t, j] = used[dest] < capacity
                used[dest] += 1
    return keep


def _drop_rank(rank, world, factor):
    single = _module(7, shared=True, skewed=True, world=world)
    sharded = shard_moe(single, None, capacity_factor=factor)
    x, _ = _tokens(7, world)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    with torch.no_grad():
        y = _all_gather_cat(sharded(x[rows].float()))
        dropped = _all_reduce(torch.tensor(sharded.ep_stats()["last_dropped"]))
        capacity = sharded.ep_stats()["capacity"]
        if rank != 0:
            return None
        single(x.float())
        keep = _expected_drops(single.last_topk_ids, world, capacity)
        _, weights, ids = torch.ops.nki.moe_router(x.float(), single.router_weight, single.expert_bias,
                                                   **single.router_flags)
        assert torch.equal(ids, single.last_topk_ids)
        plan = torch.ops.nki.moe_plan(ids, num_experts=EXPERTS, block_size=single.block_size)
        want = torch.ops.nki.moe_experts(x.float(), weights * keep, plan[0], plan[1], single.w_gate_up,
                                         single.w_down, activation=single.activation)
        want = want + single._shared(x.float())
        expect_dropped = int((~keep).sum())
    return (int(dropped), expect_dropped, capacity,
            parity(y, want.double(), want, kind="output", dtype=torch.float32, name="dropped y"))


@pytest.mark.parametrize("world", [2, 4])
def test_capacity_drops_are_counted_and_contribute_nothing(world):
    dropped, expected, capacity, verdict = run_ranks(world, _drop_rank, 0.5)[0]
    assert capacity == -(-TOKENS * TOP_K // (2 * world))   # ceil(0.5 * T k / P)
    assert dropped == expected > 0
    assert verdict.ok, str(verdict)


def _checkpoint_rank(rank, world):
    single = _module(3, shared=True, skewed=False, world=world)
    sharded = shard_moe(single, None)
    local = {n: p.shape for n, p in sharded.named_parameters()}
    back = gather_moe(sharded)
    same = all(torch.equal(a, b) for a, b in zip(single.state_dict().values(), back.state_dict().values()))
    errors = []
    for build in (lambda: MoE(HIDDEN, INTER, world + 1, 1, ep_group=None),
                  lambda: MoE(HIDDEN, INTER, EXPERTS * world + 1, 1, ep_group=dist.group.WORLD),
                  lambda: shard_moe(sharded, None), lambda: gather_moe(single),
                  lambda: MoE(HIDDEN, INTER, EXPERTS, 1, ep_group=dist.group.WORLD, ep_capacity_factor=0)):
        try:
            build()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    on_mesh = MoE(HIDDEN, INTER, EXPERTS, TOP_K, ep_group=mesh["ep"])
    local["mesh w_down"] = tuple(on_mesh.w_down.shape)
    clone = copy.deepcopy(sharded)
    shares_group = clone.expert_parallel.group is sharded.expert_parallel.group
    return local, same and shares_group, list(single.state_dict()) == list(back.state_dict()), errors


def _bias_rank(rank, world):
    """aux-loss-free balancing moves the replicated bias by the group's load, the same on every rank."""
    torch.manual_seed(5)
    moe = shard_moe(MoE(HIDDEN, INTER, EXPERTS, TOP_K, block_size=4, aux_loss_free=True), None,
                    capacity_factor=None)
    x, _ = _tokens(rank, world)      # different tokens per rank
    moe.train()
    moe(x[:TOKENS].float())
    load = _all_reduce(moe._load.clone())
    moe.update_expert_bias(0.5)
    return _all_gather_cat(moe.expert_bias[None]), load


def test_expert_bias_update_uses_the_group_load():
    (biases, load), _ = run_ranks(2, _bias_rank)
    assert torch.equal(biases[0], biases[1])
    assert torch.equal(biases[0], 0.5 * torch.sign(load.mean() - load))


@pytest.mark.parametrize("world", [2])
def test_shard_and_gather_round_trip(world):
    local, same, same_keys, errors = run_ranks(world, _checkpoint_rank)[0]
    assert local["w_gate_up"] == (EXPERTS // world, 2 * INTER, HIDDEN)
    assert local["w_down"] == local["mesh w_down"] == (EXPERTS // world, HIDDEN, INTER)
    assert local["router_weight"] == (EXPERTS, HIDDEN)
    assert same and same_keys
    assert errors[0] is None
    assert "multiple of the ep_group size" in errors[1]
    assert "already sharded" in errors[2] and "expert-parallel" in errors[3]
    assert "ep_capacity_factor" in errors[4]
