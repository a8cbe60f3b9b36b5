"""Minimum-work formulas and the model-shape registry of ``nki-lib bench``."""

import math

import pytest

from nki_lib.bench import flops
from nki_lib.bench.harness import op_cost, plan
from nki_lib.bench.shapes import MODELS, Case, sweep
from nki_lib.moe import moe_plan_reference


def _brute_visible(sq, sk, causal, wl, wr):
    off = sk - sq
    return sum(1 for i in range(sq) for j in range(sk)
               if (not causal or j <= i + off) and (wl < 0 or j >= i + off - wl) and (wr < 0 or j <= i + off + wr))


@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (5, 12), (12, 5), (33, 64)])
@pytest.mark.parametrize("causal,wl,wr", [(False, -1, -1), (True, -1, -1), (True, 3, -1), (False, 2, 4)])
def test_visible_pairs_match_the_mask(sq, sk, causal, wl, wr):
    assert flops.visible_pairs(sq, sk, causal=causal, window_left=wl, window_right=wr) == \
        _brute_visible(sq, sk, causal, wl, wr)


def test_visible_pairs_packed_documents():
    assert flops.visible_pairs(10, 10, causal=True, cu_seqlens=[0, 4, 4, 10]) == 4 * 5 // 2 + 6 * 7 // 2


def test_flash_attention_formulas():
    b, hq, hkv, s, d = 2, 8, 2, 256, 128
    full = flops.flash_attention_fwd(b, hq, hkv, s, s, d)
    assert full.flops == 4 * b * hq * s * s * d
    assert full.hbm_bytes == 2 * (2 * b * hq * s * d + 2 * b * hkv * s * d) + 4 * b * hq * s
    causal = flops.flash_attention_fwd(b, hq, hkv, s, s, d, causal=True)
    assert causal.flops == 4 * b * hq * (s * (s + 1) // 2) * d
    bwd = flops.flash_attention_bwd(b, hq, hkv, s, s, d, causal=True)
    assert bwd.flops == 2.5 * causal.flops
    exp = [w for w in causal.work if w.kind == "exp"]
    assert exp[0].elems == b * hq * s * (s + 1) // 2
    assert flops.flash_attention_fwd(1, 1, 1, 8, 8, 4, dtype="float32").pe_dtype == "float32"


def test_decode_and_moe_formulas():
    dec = flops.decode_attention(2, 8, 2, 1, [100, 300], 64)
    assert dec.flops == 4 * 8 * 64 * 400
    assert dec.hbm_bytes >= 2 * 2 * 2 * 64 * 400  # the cache is read once
    win = flops.decode_attention(1, 8, 2, 1, [1000], 64, window_left=127)
    assert win.flops == 4 * 8 * 64 * 128
    moe = flops.moe_experts_fwd(1024, 512, 256, 8, 2, block_size=128)
    assert moe.flops == 6 * 1024 * 2 * 512 * 256
    assert moe.executed_flops == moe.flops  # 256 assignments per expert = 2 full blocks
    padded = flops.moe_experts_fwd(100, 512, 256, 8, 2, block_size=128)
    assert padded.executed_flops == 6 * 8 * 128 * 512 * 256 > padded.flops
    assert flops.moe_experts_bwd(1024, 512, 256, 8, 2).flops == 2 * moe.flops
    assert flops.moe_router(64, 32, 8, 2).flops == 2 * 64 * 32 * 8
    paged = flops.decode_attention(2, 8, 2, 1, [100, 300], 64, block_size=64)
    assert paged.hbm_bytes - dec.hbm_bytes == 4 * (2 + 5)  # the int32 table entries of the needed blocks
    assert paged.flops == dec.flops
    with pytest.raises(ValueError, match="seqlens"):
        flops.decode_attention(2, 8, 2, 1, [100], 64)
    with pytest.raises(ValueError, match="dtype"):
        flops.dtype_bytes("float64")


def test_model_registry():
    assert set(MODELS) == {"llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"}
    for m in MODELS.values():
        assert m.heads % m.kv_heads == 0 and m.source
        assert m.is_moe == (m.experts > 0) and (not m.is_moe or 1 <= m.top_k <= m.experts)
    assert MODELS["qwen3-30b-a3b"].experts == 128 and MODELS["qwen3-30b-a3b"].top_k == 8
    for name in ("default", "full", "smoke", "targets"):
        cases = sweep(name)
        assert cases and len({c.label for c in cases}) == len(cases)
    with pytest.raises(ValueError, match="sweep"):
        sweep("nope")


def test_extrapolation_plans_are_explicit():
    attn = Case("flash_attention", "prefill", "m", dict(B=2, Hq=32, Hkv=8, Sq=512, Sk=512, D=128, causal=True))
    p = plan(attn)
    assert p.scale == 16 and p.dims["Hq"] == 4 and p.dims["Hkv"] == 1 and "16" in p.extrapolation
    assert plan(Case("flash_attention", "prefill", "m", dict(B=1, Hq=4, Hkv=1, Sq=64, Sk=64, D=64))).extrapolation \
        is None
    moe = Case("moe_experts", "prefill", "m", dict(T=1024, H=256, I=128, E=64, k=4, block_size=128))
    p = plan(moe)
    # two points, k = 4 and 2k = 8 experts, with the real top-k and tokens per expert
    # (1024*4/64 == 64*4/4 == 128*4/8), tiled for the real plan (its blocks and experts)
    assert (p.dims["E"], p.dims["k"], p.dims["T"]) == (4, 4, 64)
    assert (p.marginal_dims["E"], p.marginal_dims["k"], p.marginal_dims["T"]) == (8, 4, 128)
    for d in (p.dims, p.marginal_dims):
        assert d["T"] * d["k"] / d["E"] == 1024 * 4 / 64
    assert p.tiling_plan == (moe_plan_reference.num_blocks(1024 * 4, 64, 128), 64)
    # f = f(4) + s (f(8) - f(4)) with s = (64 - 4) / 4 for balanced routing
    assert p.scale == 1.0 and p.marginal_scale == pytest.approx((64 - 4) / 4) and "f(8) - f(4)" in p.extrapolation
    top2 = plan(Case("moe_experts", "prefill", "m", dict(T=1024, H=256, I=128, E=8, k=2, block_size=128)))
    assert (top2.dims["E"], top2.marginal_dims["E"], top2.dims["k"]) == (2, 4, 2)   # n = max(2, k)
    for dims in (dict(E=4, k=2, T=256), dict(E=16, k=8, T=1024)):   # E <= 2 max(2, k): simulated in full
        few = plan(Case("moe_experts", "prefill", "m", dict(H=256, I=128, block_size=128, **dims)))
        assert few.extrapolation is None and few.marginal_dims is None and few.tiling_plan is None
    train = Case("flash_attention", "train", "m", dict(B=1, Hq=2, Hkv=1, Sq=64, Sk=64, D=64, causal=True))
    assert op_cost(train).flops == pytest.approx(3.5 * flops.flash_attention_fwd(1, 2, 1, 64, 64, 64,
                                                                                 causal=True).flops)
    assert math.isfinite(op_cost(moe).flops)


def test_cost_of_reads_the_registry_samples():
    """The Sample -> OpCost adapters match the argument layout of every registered op."""
    import importlib

    from nki_lib import registry

    for name in ("nki_lib.attention.decode_attention_op", "nki_lib.moe"):
        importlib.import_module(name)
    checked = 0
    for spec in registry.all_specs():
        for sample in spec.report_samples():
            cost = flops.cost_of(spec.name, sample)
            if cost is None:
                continue
            checked += 1
            assert cost.flops >= 0 and cost.hbm_bytes > 0, (spec.name, sample.label)
    assert checked > 0
    assert flops.cost_of("no_such_op", None) is None


def test_paged_decode_inputs_hold_the_contiguous_problem():
    """A ``block_size`` decode case's paged caches, read through their permuted table (the
    reference's ``dense_kv``), are a dense cache; the baseline and the op's reference agree on them."""
    import torch

    import nki_lib
    from nki_lib.attention.decode_attention_reference import dense_kv
    from nki_lib.bench.inputs import baseline, make_call

    dims = dict(B=2, Hq=4, Hkv=2, Sq=1, L=100, D=16, block_size=32)
    args, kwargs = make_call("decode_attention", dims, torch.float32)
    q, k_cache, v_cache, seqlens, block_table, sinks = args
    assert k_cache.shape == (8, 2, 32, 16) and block_table.shape == (2, 4) and sinks is None
    assert sorted(block_table.flatten().tolist()) == list(range(8))   # every block owned once
    b, blk = 1, 2
    keys, _ = dense_kv(k_cache, v_cache, block_table, b, 100)
    assert keys.shape == (2, 100, 16)
    assert torch.equal(keys[:, 64:96], k_cache[block_table[b, blk]])
    with nki_lib.use_backend("reference"):
        out = torch.ops.nki.decode_attention(*args, **kwargs)[0]
    torch.testing.assert_close(out, baseline("decode_attention", args, kwargs))


@pytest.mark.parametrize("dims", [
    dict(B=2, Hq=4, Hkv=2, Sq=1, L=90, D=16, C=100),                            # a static cache, 10 slots unused
    dict(B=2, Hq=4, Hkv=2, Sq=1, L=70, D=16, C=128, block_size=16, layout="NHD"),  # a wide table, token-major pool
    dict(B=1, Hq=4, Hkv=2, Sq=2, L=60, D=16, C=60, layout="NHD"),               # flash-attn's (B, S, Hkv, D) cache
])
def test_serving_decode_inputs(dims):
    """A decode case's capacity ``C`` and ``layout``: the caches (or the block table) hold ``C`` keys,
    the unused table columns are 0, a token-major cache is the ``transpose(1, 2)`` of contiguous
    token-major memory, and the op's reference agrees with the baseline on the first ``L`` keys."""
    import torch

    import nki_lib
    from nki_lib.bench.inputs import baseline, make_call

    args, kwargs = make_call("decode_attention", dims, torch.float32)
    q, k_cache, v_cache, seqlens, block_table, _ = args
    bs = dims.get("block_size")
    assert seqlens.tolist() == [dims["L"]] * dims["B"]
    if bs is None:
        assert block_table is None and k_cache.shape == (dims["B"], dims["Hkv"], dims["C"], dims["D"])
    else:
        used = -(-dims["L"] // bs)
        assert block_table.shape == (dims["B"], dims["C"] // bs) and not block_table[:, used:].any()
        assert sorted(block_table[:, :used].flatten().tolist()) == list(range(dims["B"] * used))
    for cache in (k_cache, v_cache):
        assert cache.transpose(1, 2).is_contiguous() == (dims.get("layout") == "NHD")
    with nki_lib.use_backend("reference"):
        out = torch.ops.nki.decode_attention(*args, **kwargs)[0]
    torch.testing.assert_close(out, baseline("decode_attention", args, kwargs))
    with pytest.raises(ValueError, match="capacity"):
        make_call("decode_attention", {**dims, "C": dims["L"] - 1}, torch.float32)


def test_token_major_decode_cases_are_simulated_whole():
    """A token-major decode case is never cut to one (batch x kv-head) group: with one kv head its
    layout would be head-major (the same memory), not the case's."""
    nhd = Case("decode_attention", "decode", "m", dict(B=1, Hq=8, Hkv=2, Sq=1, L=256, D=64, layout="NHD"))
    hnd = Case("decode_attention", "decode", "m", dict(B=1, Hq=8, Hkv=2, Sq=1, L=256, D=64, C=300))
    assert plan(nhd).extrapolation is None and plan(nhd).dims == nhd.dims
    assert plan(hnd).scale == 2 and plan(hnd).dims["C"] == 300
