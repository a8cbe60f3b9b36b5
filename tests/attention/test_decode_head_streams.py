"""decode_attention's multi-chunk path over head-major paged pools with one block per partition
(block tables wider than one chunk: vLLM-style tables sized to the model's context): one stream of
several kv heads per (sequence, split), whose gathers move several heads per descriptor
(``decode_attention_fwd.stream_head_groups``). Parity with the fp64 oracle, the gathers' width, and
no garbage from unused blocks."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nki_lib.attention import decode_attention_op
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.attention.kernels import decode_attention_fwd, decode_attention_fwd_plan
from nki_lib.attention.kernels.decode_attention_fwd_io import CHUNK_BUFFER_BUDGET
from nki_lib.numerics.oppar import op_parity
from tests.attention.test_decode_kernel import _judge, _launch, launch_plan, poison_unneeded_keys

SPEC = decode_attention_op.SPEC
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _case(**over):
    base = dict(b=1, hq=8, hkv=4, sq=1, d=64, block_size=16, n_cols=200, lengths=[3000], dtype=torch.bfloat16,
                sinks=False, window_left=-1, softcap=0.0, starts=None)
    base.update(over)
    return base


@st.composite
def head_stream_cases(draw):
    hkv = draw(st.sampled_from([2, 3, 4, 8]))
    sq = draw(st.integers(1, 3))
    b = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([4, 8, 16, 32]))
    n_cols = draw(st.integers(129, 300))         # wider than one chunk of 128 blocks
    cap = block_size * n_cols
    lengths = draw(st.lists(st.integers(sq, cap), min_size=b, max_size=b))
    starts = draw(st.none() | st.lists(st.integers(0, 600), min_size=b, max_size=b))
    if starts is not None:
        starts = [min(s, n - sq) for s, n in zip(starts, lengths)]
    return _case(b=b, hq=hkv * draw(st.integers(1, 2)), hkv=hkv, sq=sq, d=draw(st.sampled_from([16, 32, 64, 128])),
                 block_size=block_size, n_cols=n_cols, lengths=lengths, dtype=draw(st.sampled_from(DTYPES)),
                 sinks=draw(st.booleans()), window_left=draw(st.sampled_from([-1, -1, 300])),
                 softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), starts=starts)


def _sample(case):
    kwargs = {k: case[k] for k in ("window_left", "softcap") if case[k] not in (-1, 0.0)}
    return make_sample(case["b"], case["hq"], case["hkv"], case["sq"], case["d"], case["lengths"], case["dtype"],
                       block_size=case["block_size"], capacity_=case["block_size"] * case["n_cols"],
                       sinks=case["sinks"], starts=case["starts"], **kwargs)


def _heads_per_gather(sample):
    """(kv heads each gather of the call moves, chunk depth M), from the launch's own plan (1 head:
    per-head streams)."""
    q, k = sample.args[:2]
    m = launch_plan(sample)["keys_per_partition"]
    _, per_gather = decode_attention_fwd.stream_head_groups(k.shape[1], False, True, k.shape[2], m, q.shape[3],
                                                            q.element_size(), 1, CHUNK_BUFFER_BUDGET)
    return per_gather, m


def _plan(sample):
    """The launch's (splits, kv heads per multi-chunk stream) for ``sample``."""
    q, k = sample.args[:2]
    plan = launch_plan(sample)
    rows = q.shape[1] // k.shape[1] * q.shape[2]
    heads, _ = decode_attention_fwd.stream_head_groups(k.shape[1], False, True, k.shape[2], plan["keys_per_partition"],
                                                       q.shape[3], q.element_size(), 1,
                                                       decode_attention_fwd.stream_budget(rows))
    return plan["n_split"], heads


def _gathers(report):
    return [e for e in report.trace if e.opcode == "dma_copy" and e.attrs.get("indirect") == "vector"]


@settings(deadline=None, max_examples=12)
@given(head_stream_cases())
@example(_case())                                                            # 2 chunks, 1 split, 4 heads a gather
@example(_case(hq=4, hkv=2, n_cols=300, lengths=[4000]))                     # 3 chunks, 3 splits, 2 heads a gather
@example(_case(b=2, hq=6, hkv=3, sq=2, d=128, block_size=32, n_cols=300, lengths=[9000, 40],  # odd Hkv, 3 ranges
               dtype=torch.float32, sinks=True, window_left=300))
@example(_case(b=2, hq=16, hkv=8, d=64, block_size=8, n_cols=160, lengths=[1280, 700], softcap=5.0,
               starts=[100, 0]))                                             # left-padded (cache_start)
@example(_case(hq=8, hkv=4, block_size=4, n_cols=700, lengths=[2700], sinks=True))  # 5 interior chunks: one trip
@example(_case(b=2, hq=16, hkv=8, block_size=4, n_cols=1100, lengths=[4300, 3000], starts=[600, 0],  # of IDS_AHEAD
               window_left=300))                                             # and more, off a window's start
@example(_case(hq=64, hkv=8, d=64, block_size=64, n_cols=512, lengths=[8192], sinks=True))  # gpt-oss-120b 8k in a
def test_head_major_pool_streams_several_heads(case):                       # 32k table: 4 heads a gather
    """Parity with the fp64 oracle; every gather moves the planned number of kv heads (as many as fit
    a chunk buffer: 4 at gpt-oss-120b's D = 64 and blocks of 64; fp32 at D = 128 and blocks of 32, one)
    of one block per partition."""
    sample = _sample(case)
    outs, report = _launch(sample)
    _judge(sample, outs)
    per_gather, m = _heads_per_gather(sample)
    widths = {e.shape for e in _gathers(report)}
    assert widths == {(128, per_gather * m * case["d"])}, widths


def test_unused_blocks_never_reach_the_output():
    """NaN in every block the table does not name for a needed key (spare blocks, the slots past L_b
    of the last block, blocks before the window) never reaches out or lse."""
    length, sq, window_left, bs = 3000, 2, 2200, 16
    sample = make_sample(1, 8, 4, sq, 64, [length], torch.bfloat16, block_size=bs, num_blocks=260,
                         capacity_=bs * 200, window_left=window_left, sinks=True)
    poisoned = poison_unneeded_keys(sample, length, sq, window_left)
    outs, report = _launch(poisoned)
    assert _heads_per_gather(poisoned)[0] == 4
    assert not any(torch.isnan(o).any() for o in outs)
    result = op_parity(SPEC, poisoned, grads=False)
    assert result.ok, str(result)


def test_two_cores_keep_per_head_streams():
    """LNC2 shards (b, kv head) units over the cores: each stream stays one kv head's."""
    sample = _sample(_case())
    outs, report = _launch(sample, grid=2)
    _judge(sample, outs)
    widths = {e.shape for e in _gathers(report)}
    assert widths == {(128, 16 * 64)}, widths


@example(hkv=8, d=64, n_split=1)        # gpt-oss-120b: one stream of 8 heads
@example(hkv=8, d=128, n_split=1)       # llama3-8b: two streams of 4 heads
@example(hkv=2, d=128, n_split=4)       # two heads a stream: four splits (one per chunk of the 32k table)
@given(hkv=st.sampled_from([1, 2, 4, 8]), d=st.sampled_from([64, 128]), n_split=st.just(None))
@settings(deadline=None, max_examples=8)
def test_lockstep_head_streams_take_one_split(hkv, d, n_split):
    """A B = 1 sequence in a 32k table of blocks of 64 (4 chunks): streams of >= LOCKSTEP_STREAM_HEADS kv
    heads take one split, streams of fewer keep plan_splits's (enough (b, hk, split) streams for the
    DMA engines, one chunk each at least)."""
    sample = _sample(_case(hq=2 * hkv, hkv=hkv, d=d, block_size=64, n_cols=512, lengths=[8192]))
    splits, heads = _plan(sample)
    wanted = 1 if heads >= decode_attention_fwd_plan.LOCKSTEP_STREAM_HEADS else min(4, 16 // hkv)
    assert splits == wanted, (splits, heads)
    if n_split is not None:
        assert splits == n_split, (splits, heads)


def test_interior_chunk_ids_load_ids_ahead_at_a_time():
    """A head stream's interior chunks take their unit ids IDS_AHEAD chunks per DMA (then one per chunk
    for the rest): gpt-oss-120b at L = 32768 in a 32k table, four interior chunks, one ids DMA."""
    sample = _sample(_case(hq=64, hkv=8, d=64, block_size=64, n_cols=512, lengths=[32768], sinks=True))
    outs, report = _launch(sample)
    _judge(sample, outs)
    ids = [e.shape for e in report.trace if e.opcode == "dma_copy" and e.shape[0] == 128 and
           e.attrs.get("indirect") != "vector" and e.dtype == "int32"]
    assert ids == [(128, decode_attention_fwd.IDS_AHEAD)], ids
