"""decode_attention: parity of the NKI kernel on the simulator (strict) against the fp64 oracle,
equivalence with flash_attention on the dense problem, paged == contiguous, and input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib
from nki_lib.attention import decode_attention_op
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.numerics import parity
from nki_lib.numerics.oppar import op_parity

SPEC = decode_attention_op.SPEC
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@st.composite
def decode_cases(draw):
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    sq = draw(st.integers(1, 5))
    b = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([None, 1, 4, 16, 64]))
    cap = draw(st.integers(sq, 300))
    lengths = draw(st.lists(st.integers(sq, cap), min_size=b, max_size=b))
    return dict(b=b, hq=hkv * group, hkv=hkv, sq=sq, d=draw(st.sampled_from([8, 16, 40, 64])),
                lengths=lengths, cap=cap, dtype=draw(st.sampled_from(DTYPES)), block_size=block_size,
                window_left=draw(st.sampled_from([-1, -1, 0, 3, 17])),
                softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), sinks=draw(st.booleans()))


def _sample(case, seed=0):
    kwargs = {k: case[k] for k in ("window_left", "softcap") if case[k] not in (-1, 0.0)}
    return make_sample(case["b"], case["hq"], case["hkv"], case["sq"], case["d"], case["lengths"],
                       case["dtype"], block_size=case["block_size"], capacity_=case["cap"],
                       sinks=case["sinks"], seed=seed, **kwargs)


def _case(**over):
    base = dict(b=1, hq=2, hkv=1, sq=1, d=16, lengths=[1], cap=1, dtype=torch.bfloat16,
                block_size=None, window_left=-1, softcap=0.0, sinks=False)
    base.update(over)
    return base


@given(decode_cases())
@example(_case())                                                        # length 1, capacity 1
@example(_case(sq=1, lengths=[1, 5], cap=8, block_size=4, b=2))           # length 1 paged
@example(_case(sq=3, lengths=[32, 32], cap=32, block_size=16, b=2))       # full last block
@example(_case(sq=2, lengths=[33, 7, 20], cap=48, block_size=16, b=3,     # partly filled, differing
               sinks=True, window_left=5, softcap=5.0))
@example(_case(hq=8, hkv=2, sq=16, lengths=[16, 40], cap=40, b=2, dtype=torch.float32))  # spec. verify
@example(_case(sq=4, lengths=[700], cap=1100, block_size=64, dtype=torch.float16))  # 2 chunks, 1 split
@example(_case(d=64, lengths=[16384], cap=16384, sinks=True))            # multi-chunk K^T, 2 slots a row: L_b at a chunk edge
@example(_case(d=32, sq=2, lengths=[9001], cap=16384, window_left=17))   # D = 32, 4 slots a row: a window
@example(_case(d=64, lengths=[200], cap=200, b=1))                       # multi-chunk M = 1: PE transposes
@example(_case(b=2, hq=4, hkv=2, sq=2, d=64, lengths=[512, 65], cap=512, block_size=4,   # paged, M = block:
               sinks=True, window_left=17))                               # K^T of 2 slots per PE transpose
@example(_case(b=2, hq=6, hkv=2, sq=1, d=32, lengths=[4, 509], cap=512, block_size=4, dtype=torch.float32,
               softcap=5.0))                                              # 4 slots per transpose, fp32
@example(_case(b=2, hq=2, d=16, lengths=[1, 700], cap=1024, block_size=8))   # paged, M = block, D = 16: one slot
                                                                          # a PE transpose (no 16-row PE tiles)
def test_decode_parity_simulator(case):
    result = op_parity(SPEC, _sample(case), grads=False)
    assert result.ok, str(result)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_registry_samples_simulator(dtype):
    for sample in SPEC.samples(dtype, False):
        result = op_parity(SPEC, sample, grads=False)
        assert result.ok, str(result)


def test_registry_samples_simulator_lnc2(monkeypatch):
    """The op on two logical cores (NEURON_LOGICAL_NC_CONFIG=2): same parity."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    for sample in SPEC.samples(torch.bfloat16, False):
        result = op_parity(SPEC, sample, grads=False)
        assert result.ok, str(result)


def _dense_flash(sample, dtype):
    """flash_attention (reference path) per sequence on the dense keys [start_b, L_b), in ``dtype``."""
    q, k_cache, v_cache, seqlens, table, sinks, starts = sample.args
    starts = [0] * q.shape[0] if starts is None else starts.tolist()
    outs, lses = [], []
    for b, length in enumerate(seqlens.tolist()):
        if table is None:
            k, v = k_cache[b, :, :length], v_cache[b, :, :length]
        else:
            bs = k_cache.shape[2]
            rows = [(int(table[b, p // bs]), p % bs) for p in range(length)]
            k = torch.stack([k_cache[blk, :, r] for blk, r in rows], dim=1)
            v = torch.stack([v_cache[blk, :, r] for blk, r in rows], dim=1)
        k, v = k[:, starts[b]:], v[:, starts[b]:]
        conv = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        s = None if sinks is None else sinks.to(torch.float64 if dtype == torch.float64 else torch.float32)
        with nki_lib.use_backend("reference"):
            out, lse = torch.ops.nki.flash_attention(
                conv(q[b:b + 1]), conv(k[None]), conv(v[None]), s, causal=True,
                window_left=sample.kwargs.get("window_left", -1), scale=sample.kwargs.get("scale"),
                softcap=sample.kwargs.get("softcap", 0.0))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("block_size", [None, 8])
def test_equals_flash_attention_on_dense_problem(block_size):
    sample = make_sample(2, 4, 2, 3, 16, [40, 9], torch.bfloat16, block_size=block_size, capacity_=48,
                         sinks=True, window_left=6, softcap=3.0)
    flash_out, flash_lse = _dense_flash(sample, torch.bfloat16)
    oracle = _dense_flash(sample, torch.float64)
    for path in ("reference", "simulator"):
        with nki_lib.use_backend(path), nki_lib.strict():
            out, lse = SPEC.op(*sample.args, **sample.kwargs)
        for name, got, want, base in (("out", out, oracle[0], flash_out), ("lse", lse, oracle[1], flash_lse)):
            check = parity(got, want, base, kind="output", dtype=torch.bfloat16, name=f"{path} {name}")
            assert check.ok, str(check)


def _paged_copy(sample, block_size, seed):
    """The same cache contents as a paged cache with a shuffled block table (plus spare blocks)."""
    q, k_cache, v_cache, seqlens, _, sinks = sample.args[:6]
    b, hkv, smax, d = k_cache.shape
    per_seq = smax // block_size
    n_blocks = b * per_seq + 3
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))[:b * per_seq]
    table = order.reshape(b, per_seq).to(torch.int32)
    k_paged = torch.randn(n_blocks, hkv, block_size, d).to(k_cache.dtype)
    v_paged = torch.randn(n_blocks, hkv, block_size, d).to(v_cache.dtype)
    for i in range(b):
        for c in range(per_seq):
            blk = int(table[i, c])
            k_paged[blk] = k_cache[i, :, c * block_size:(c + 1) * block_size]
            v_paged[blk] = v_cache[i, :, c * block_size:(c + 1) * block_size]
    return (q, k_paged, v_paged, seqlens, table, sinks)


@pytest.mark.parametrize("block_size", [16, 64])
def test_shuffled_block_table_matches_contiguous(block_size):
    sample = make_sample(2, 4, 1, 2, 32, [513, 70], torch.bfloat16, capacity_=1024, sinks=True)
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        expected = SPEC.op(*sample.args, **sample.kwargs)
        for seed in (0, 1):
            actual = SPEC.op(*_paged_copy(sample, block_size, seed), **sample.kwargs)
            assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


# --------------------------------------------------------------------------- errors

def _args(**over):
    sample = make_sample(2, 4, 2, 2, 8, [5, 12], torch.float32, block_size=4, capacity_=16)
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "sinks", "cache_start")
    args = dict(zip(names, sample.args))
    args.update(over)
    return args


def _call(args, **kwargs):
    return torch.ops.nki.decode_attention(*args.values(), **kwargs)


@pytest.mark.parametrize("over, error, needle", [
    (dict(block_table=torch.tensor([[0, 1, -1, -1], [2, 3, 9, -1]], dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.tensor([[0, 1, 0, 0], [2, -1, 4, 0]], dtype=torch.int32)), ValueError, "block_table"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.float32)), TypeError, "block_table"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table"),
    (dict(cache_seqlens=torch.tensor([5, 17], dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([1, 12], dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([5, 12], dtype=torch.int16)), TypeError, "cache_seqlens"),
    (dict(cache_start=torch.tensor([0, 11], dtype=torch.int64)), ValueError, r"cache_start must lie in \[0, cache_seqlens - Sq\]"),
    (dict(cache_start=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, "cache_start must lie"),
    (dict(cache_start=torch.tensor([0], dtype=torch.int32)), ValueError, "cache_start must have shape"),
    (dict(cache_start=torch.tensor([0.0, 1.0])), TypeError, "cache_start must have dtype"),
    (dict(cache_seqlens=torch.tensor([5], dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(k_cache=torch.zeros(5, 2, 4)), ValueError, "k_cache"),
    (dict(k_cache=torch.zeros(5, 2, 4, 16), v_cache=torch.zeros(5, 2, 4, 16)), ValueError, "k_cache"),
    (dict(v_cache=torch.zeros(5, 2, 8, 8)), ValueError, "v_cache"),
    (dict(k_cache=torch.zeros(5, 3, 4, 8), v_cache=torch.zeros(5, 3, 4, 8)), ValueError, "k_cache"),
    (dict(v_cache=torch.zeros(5, 2, 4, 8, dtype=torch.float16)), TypeError, "v_cache"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
])
def test_bad_inputs_name_the_argument(over, error, needle):
    with pytest.raises(error, match=needle):
        _call(_args(**over))


def test_contiguous_layout_with_wrong_batch():
    args = _args(block_table=None, k_cache=torch.zeros(3, 2, 16, 8), v_cache=torch.zeros(3, 2, 16, 8))
    with pytest.raises(ValueError, match="k_cache must have the contiguous layout"):
        _call(args)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(window_left=-2), "window_left"), (dict(softcap=-1.0), "softcap"),
    (dict(scale=float("nan")), "scale"),
])
def test_bad_flags(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _call(_args(), **kwargs)


@pytest.mark.parametrize("name", ["q", "k_cache", "sinks"])
def test_requires_grad_is_a_clear_error(name):
    args = _args(sinks=torch.zeros(4))
    args[name] = args[name].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"inference-only.*{name}"):
        _call(args)
    with torch.no_grad():
        out, _ = _call(args)
    assert not out.requires_grad


def test_empty_batch():
    sample = make_sample(1, 2, 1, 1, 8, [3], torch.float32)
    q, k, v = sample.args[0][:0], sample.args[1][:0], sample.args[2][:0]
    out, lse = torch.ops.nki.decode_attention(q, k, v, torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 2, 1, 8) and lse.shape == (0, 2, 1)


def test_cache_start_equals_the_trimmed_cache():
    """A left-padded cache (valid positions [start, L)) gives what the same keys stored from
    position 0 give, even with garbage (NaN) in the padding."""
    sample = make_sample(3, 4, 2, 2, 8, [9, 20, 14], torch.float32, capacity_=24, window_left=5)
    q, k, v, lengths = sample.args[:4]
    starts = torch.tensor([3, 0, 12])
    k_pad, v_pad = k.clone(), v.clone()
    trimmed_k, trimmed_v = torch.zeros_like(k), torch.zeros_like(v)
    for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        k_pad[b, :, :s] = float("nan")
        v_pad[b, :, :s] = float("nan")
        trimmed_k[b, :, :n - s], trimmed_v[b, :, :n - s] = k[b, :, s:n], v[b, :, s:n]
    got = torch.ops.nki.decode_attention(q, k_pad, v_pad, lengths, None, None, starts, window_left=5)
    want = torch.ops.nki.decode_attention(q, trimmed_k, trimmed_v, lengths - starts.to(lengths.dtype),
                                          None, None, window_left=5)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [None, 4])
def test_cache_start_on_the_simulator_matches_the_reference(block_size):
    """Left-padded caches on the decode kernel (NaN in the padding must not leak)."""
    sample = make_sample(3, 4, 2, 2, 8, [9, 20, 14], torch.bfloat16, capacity_=24, starts=[3, 0, 12],
                         block_size=block_size)
    q, k, v, lengths, table, sinks, starts = sample.args
    if block_size is None:
        for b, s in enumerate(starts.tolist()):
            k[b, :, :s] = float("nan")
            v[b, :, :s] = float("nan")
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        got = SPEC.op(q, k, v, lengths, table, sinks, starts)
    oracle = decode_attention_op.decode_attention_reference.naive(
        *(t.double() if t is not None and t.is_floating_point() else t for t in (q, k, v)),
        lengths, table, sinks, starts)
    baseline = decode_attention_op.decode_attention_reference.naive(q, k, v, lengths, table, sinks, starts)
    for i, kind in enumerate(("output", "output")):
        result = parity(got[i], oracle[i], baseline[i], kind=kind, dtype=torch.bfloat16)
        assert result.ok, str(result)
