"""decode_attention on token-major caches (``kv_layout="NHD"``: the layout of flash-attn, vLLM and
Hugging Face's continuous batching): the same answer, bit for bit, as the head-major call on both
backends for paged pools (parity with the fp64 oracle for contiguous caches on the simulator, which
reads them as paged pools); the kernel reads a token-major pool in place on its single-chunk path with one block per
partition, and elsewhere the host copy grows with the block table, never with the pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nki_lib
from nki_lib.attention import decode_attention_op
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.bench.whole_op import record_host_ops
from nki_lib.dispatch import collect_runs
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

SPEC = decode_attention_op.SPEC
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _token_major(cache):
    """A head-major cache (rows, Hkv, tokens, D) stored token-major (rows, tokens, Hkv, D)."""
    return cache.transpose(1, 2).contiguous()


@st.composite
def layout_cases(draw):
    hkv = draw(st.integers(1, 3))
    sq = draw(st.integers(1, 3))
    b = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([None, 4, 16, 64]))
    cap = draw(st.integers(sq, 260))
    lengths = draw(st.lists(st.integers(sq, cap), min_size=b, max_size=b))
    return dict(b=b, hq=hkv * draw(st.integers(1, 2)), hkv=hkv, sq=sq, d=draw(st.sampled_from([16, 32, 64])),
                lengths=lengths, cap=cap, dtype=draw(st.sampled_from(DTYPES)), block_size=block_size,
                spare=draw(st.integers(0, 5)), sinks=draw(st.booleans()))


def _case(**over):
    base = dict(b=1, hq=2, hkv=1, sq=1, d=16, lengths=[1], cap=1, dtype=torch.bfloat16, block_size=None,
                spare=0, sinks=False)
    base.update(over)
    return base


def _sample(case, **kwargs):
    spare = case["spare"]
    num_blocks = None
    if case["block_size"] is not None:
        num_blocks = sum(-(-n // case["block_size"]) for n in case["lengths"]) + spare
    return make_sample(case["b"], case["hq"], case["hkv"], case["sq"], case["d"], case["lengths"], case["dtype"],
                       block_size=case["block_size"], num_blocks=num_blocks, capacity_=case["cap"],
                       sinks=case["sinks"], starts=case.get("starts"), **kwargs)


@settings(deadline=None, max_examples=25)
@given(layout_cases())
@example(_case())                                                              # contiguous, length 1
@example(_case(b=2, hq=4, hkv=2, sq=2, d=64, lengths=[512, 65], cap=512, block_size=64,  # paged, D = 64:
               spare=3, sinks=True))                                           # K^T of 2 slots per PE transpose
@example(_case(b=3, hq=6, hkv=3, sq=1, d=32, lengths=[4, 37, 9], cap=40, block_size=4,   # odd Hkv, unused
               dtype=torch.float32))                                           # table entries (-1)
def test_token_major_equals_head_major(case):
    """Bit for bit on both backends, but for a contiguous cache on the simulator: a token-major
    contiguous cache is read as a token-major paged pool (``_token_major_blocks``), a different kernel
    path from the head-major contiguous cache's (whose sums may round differently), so it is held to
    parity with the fp64 oracle instead."""
    sample = _sample(case)
    q, k_cache, v_cache, lengths, table, sinks, _ = sample.args
    for path in ("simulator", "reference"):
        if path == "simulator" and table is None:
            _token_major_parity(sample)
            continue
        with nki_lib.use_backend(path), nki_lib.strict():
            want = SPEC.op(*sample.args, **sample.kwargs)
            got = nki_lib.decode_attention(q, _token_major(k_cache), _token_major(v_cache), lengths,
                                           block_table=table, sinks=sinks, kv_layout="NHD", return_lse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), path


@st.composite
def in_place_cases(draw):
    """Calls whose token-major pool the kernel reads in place: one chunk of one block per partition
    (capacity 128 x block_size), on one core."""
    hkv = draw(st.integers(1, 4))
    sq = draw(st.integers(1, 2))
    b = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([2, 4, 8]))
    cap = 128 * block_size
    lengths = draw(st.lists(st.integers(sq, cap), min_size=b, max_size=b))
    return dict(b=b, hq=hkv * draw(st.integers(1, 3)), hkv=hkv, sq=sq, d=draw(st.sampled_from([16, 32, 64, 128])),
                lengths=lengths, cap=cap, dtype=draw(st.sampled_from(DTYPES)), block_size=block_size,
                spare=draw(st.integers(0, 3)), sinks=draw(st.booleans()),
                window_left=draw(st.sampled_from([-1, -1, 5])), softcap=draw(st.sampled_from([0.0, 0.0, 5.0])))


def _in_place(**over):
    base = dict(b=1, hq=2, hkv=2, sq=1, d=64, lengths=[512], cap=512, dtype=torch.bfloat16, block_size=4,
                spare=0, sinks=False, window_left=-1, softcap=0.0)
    base.update(over)
    return base


@settings(deadline=None, max_examples=12)
@given(in_place_cases())
@example(_in_place())                                                          # full chunk, 2 slots a transpose
@example(_in_place(b=2, hq=8, hkv=4, sq=2, lengths=[512, 37], sinks=True, window_left=5))   # edge chunk, window
@example(_in_place(b=3, hq=3, hkv=3, d=128, lengths=[9, 512, 200], dtype=torch.float32,     # odd Hkv: groups
                   spare=2, softcap=5.0))                                      # may split a sequence's heads
@example(_in_place(b=2, hq=16, hkv=8, d=64, block_size=8, cap=1024, lengths=[1024, 700]))  # gpt-oss's Hkv, G
@example(_in_place(b=2, hq=4, lengths=[512, 300], sinks=True, starts=[10, 250]))      # left-padded (cache_start)
@example(_in_place(b=5, hq=8, hkv=8, d=128, block_size=8, cap=1024, lengths=[1024, 1000, 77, 1024, 512],
                   dtype=torch.float32, sinks=True, window_left=100))        # groups of 14 units split sequences:
                                                                             # partial runs, strided gathers
def test_token_major_pool_is_read_in_place(case):
    """No host gather, and the same answer, bit for bit, as the head-major call."""
    kwargs = {k: case[k] for k in ("window_left", "softcap") if case[k] not in (-1, 0.0)}
    sample = _sample(case, **kwargs)
    q, k_cache, v_cache, lengths, table, sinks, starts = sample.args
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        want = SPEC.op(*sample.args, **sample.kwargs)
        with record_host_ops() as ops:
            got = nki_lib.decode_attention(q, _token_major(k_cache), _token_major(v_cache), lengths, block_table=table,
                                           sinks=sinks, cache_start=starts, kv_layout="NHD", return_lse=True, **kwargs)
    assert not [op for op in ops if op.name.startswith("aten.index_select")]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _token_major_parity(sample):
    """``sample``'s call with its caches stored token-major and passed as ``transpose(1, 2)`` views:
    asserts parity with the fp64 oracle (strict: the kernel ran) and returns the host ops."""
    q, k_cache, v_cache, lengths, table, sinks, starts = sample.args
    view = Sample((q, _token_major(k_cache).transpose(1, 2), _token_major(v_cache).transpose(1, 2), lengths, table,
                   sinks, starts), sample.kwargs, sample.label + " token-major")
    with record_host_ops() as ops:
        result = op_parity(SPEC, view, grads=False)
    assert result.ok, str(result)
    return ops


@st.composite
def multi_chunk_cases(draw):
    """Calls whose token-major pool the kernel reads in place on its multi-chunk path: tables wider
    than one chunk (capacity > 128 x block_size, or chunks of all kv heads shallower than a block)."""
    hkv = draw(st.integers(1, 4))
    sq = draw(st.integers(1, 2))
    b = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([4, 8, 16, 32]))
    cap = block_size * draw(st.integers(129, 300))
    lengths = draw(st.lists(st.integers(sq, cap), min_size=b, max_size=b))
    return dict(b=b, hq=hkv * draw(st.integers(1, 2)), hkv=hkv, sq=sq, d=draw(st.sampled_from([16, 64, 128])),
                lengths=lengths, cap=cap, dtype=draw(st.sampled_from(DTYPES)), block_size=block_size,
                spare=draw(st.integers(0, 3)), sinks=draw(st.booleans()),
                window_left=draw(st.sampled_from([-1, -1, 200])), softcap=draw(st.sampled_from([0.0, 0.0, 5.0])))


@settings(deadline=None, max_examples=10)
@given(multi_chunk_cases())
@example(_in_place(b=2, hq=4, hkv=2, d=64, block_size=16, cap=4096, lengths=[3000, 77], sinks=True))  # same M
@example(_in_place(b=1, hq=8, hkv=8, d=128, block_size=64, cap=32768, lengths=[20000]))   # M 64 -> 16: all heads
@example(_in_place(b=1, hq=16, hkv=8, d=64, block_size=64, cap=32768, lengths=[13000], sinks=True))  # one split:
                                                            # 3 interior chunks over two pairs, one edge chunk
@example(_in_place(b=3, hq=6, hkv=3, sq=2, d=32, block_size=8, cap=2048, lengths=[1500, 2048, 9],  # 3 ranges,
                   dtype=torch.float32, window_left=300))                       # a window
@example(_in_place(b=2, hq=8, hkv=4, d=32, block_size=16, cap=4096, lengths=[3000, 900], sinks=True,
                   starts=[1000, 0]))                                          # left-padded (cache_start)
@example(_in_place(b=1, hq=16, hkv=8, d=128, block_size=64, cap=32768, lengths=[21000]))  # 5 two-pair trips
                                                            # (next trip's ids prefetched), 1 more interior, 1 edge
def test_token_major_pool_is_read_in_place_on_the_multi_chunk_path(case):
    """No host gather, and parity with the fp64 oracle (the chunk depth may differ from the head-major
    call's, so the summation order does too)."""
    kwargs = {k: case[k] for k in ("window_left", "softcap") if case[k] not in (-1, 0.0)}
    sample = _sample(case, **kwargs)
    ops = _token_major_parity(sample)
    assert not [op for op in ops if op.name.startswith("aten.index_select")]



def test_two_pair_trips_prefetch_the_next_trip_s_ids():
    """llama3-8b's kv heads at L = 32768 in a 32k table, token-major: 16 interior chunks of 2048 keys
    (M = 16: a 32 KiB run of 8 heads x D = 128), 8 trips of two chunks. Each trip's ids are read one trip
    ahead (one DMA before the loop, one per trip), the last read runs past the table's end and is
    skipped (oob_mode.skip), and the answer matches the fp64 oracle. Each partition reads its trip's
    two columns as one run (chunk j takes units 2p + j, ``_paged_unit_ids``), not one 4-byte run per
    id."""
    sample = _sample(_in_place(b=1, hq=16, hkv=8, d=128, block_size=64, cap=32768, lengths=[32768]))
    with collect_runs() as runs:
        _token_major_parity(sample)
    trace = runs[-1][1].trace
    trip_ids = [e for e in trace if e.opcode == "dma_copy" and e.dtype == "int32" and e.shape == (32, 2)]
    assert len(trip_ids) == 8 + 1, [e.shape for e in trip_ids]
    assert [bool(e.attrs.get("skipped")) for e in trip_ids] == [False] * 8 + [True]
    assert all(e.attrs["contiguous_bytes"] == 2 * 4 for e in trip_ids)


@settings(deadline=None, max_examples=10)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([64, 128, 1000, 8192]), st.sampled_from([32, 64, 128]),
       st.sampled_from(DTYPES), st.data())
@example(2, 2, 8192, 64, torch.bfloat16, None)       # 128 blocks of 64: the single-chunk path, one block a partition
@example(1, 4, 1000, 32, torch.float32, None)        # blocks of 4 keys (the largest power of two dividing 1000)
def test_a_token_major_contiguous_cache_is_read_as_a_pool(b, hkv, smax, d, dtype, data):
    """flash-attn's (B, Smax, Hkv, D) cache through ``kv_layout="NHD"``: read in place as a token-major
    paged pool (no host op moves a cache's bytes), parity with the fp64 oracle."""
    lengths = [smax] * b if data is None else data.draw(st.lists(st.integers(1, smax), min_size=b, max_size=b))
    sample = make_sample(b, 2 * hkv, hkv, 1, d, lengths, dtype, capacity_=smax, sinks=True)
    ops = _token_major_parity(sample)
    k_cache = sample.args[1]
    cache_bytes = k_cache.numel() * k_cache.element_size()
    assert all(op.hbm_bytes < cache_bytes for op in ops)


def test_token_major_on_two_cores_gathers_the_table_s_blocks(monkeypatch):
    """LNC2 splits a sequence's kv heads between the cores (no whole blocks): the host gather, same answer."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    sample = _sample(_in_place(b=1, hq=4, hkv=2, lengths=[300]))
    q, k_cache, v_cache, lengths, table, sinks, _ = sample.args
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        want = SPEC.op(*sample.args)
        with record_host_ops() as ops:
            got = nki_lib.decode_attention(q, _token_major(k_cache), _token_major(v_cache), lengths, block_table=table,
                                           kv_layout="NHD", return_lse=True)
    assert len([op for op in ops if op.name.startswith("aten.index_select")]) == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_token_major_pool_is_never_copied_whole():
    """A pool of 400 blocks, a table of 10 entries (6 used, 4 unused -1): the host ops move the
    table's 10 blocks (K and V, read and written once, plus the ids) and a few bytes of table, not
    the pool."""
    sample = make_sample(2, 4, 2, 1, 16, [40, 9], torch.bfloat16, block_size=8, num_blocks=400)
    q, k_cache, v_cache, lengths, table, _, _ = sample.args
    block_bytes = k_cache[0].numel() * k_cache.element_size()
    with nki_lib.use_backend("simulator"), nki_lib.strict(), record_host_ops() as ops:
        nki_lib.decode_attention(q, _token_major(k_cache), _token_major(v_cache), lengths, block_table=table,
                                 kv_layout="NHD")
    gathers = [op for op in ops if op.name.startswith("aten.index_select")]
    ids_bytes = table.numel() * table.element_size()
    assert len(gathers) == 2                                   # K and V, once each
    assert all(op.bytes_written == table.numel() * block_bytes for op in gathers)
    assert all(op.bytes_read == table.numel() * block_bytes + ids_bytes for op in gathers)
    assert sum(op.hbm_bytes for op in ops) < 2 * block_bytes * k_cache.shape[0]


def test_head_major_pool_has_no_host_copy():
    sample = make_sample(2, 4, 2, 1, 16, [40, 9], torch.bfloat16, block_size=8, num_blocks=400)
    with nki_lib.use_backend("simulator"), nki_lib.strict(), record_host_ops() as ops:
        SPEC.op(*sample.args, **sample.kwargs)
    assert not [op for op in ops if op.name.startswith("aten.index_select")]


@pytest.mark.parametrize("layout", ["NHD ", "nhd", "BHSD", None])
def test_bad_kv_layout_names_the_argument(layout):
    sample = make_sample(1, 2, 1, 1, 8, [3], torch.float32)
    q, k_cache, v_cache, lengths = sample.args[:4]
    with pytest.raises(ValueError, match="kv_layout"):
        nki_lib.decode_attention(q, k_cache, v_cache, lengths, kv_layout=layout)


def test_a_token_major_cache_of_the_wrong_rank_is_the_op_s_error():
    sample = make_sample(1, 2, 1, 1, 8, [3], torch.float32)
    q, k_cache, v_cache, lengths = sample.args[:4]
    with pytest.raises(ValueError, match="k_cache"):
        nki_lib.decode_attention(q, k_cache[0], v_cache, lengths, kv_layout="NHD")
