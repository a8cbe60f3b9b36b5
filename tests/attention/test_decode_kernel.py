"""decode kernel internals on the simulator: split-KV merge, reads limited to the needed cache
units, work that follows the lengths (not the capacity), GQA sharing of every K/V load, row and
head-dim tiling, and the Unsupported cases."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch

import nki_lib
from nki_lib._nki import nl
from nki_lib.attention import decode_attention_op
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.attention.kernels import (
    decode_attention_fwd,
    decode_attention_fwd_gathers,
    decode_attention_fwd_packed,
    decode_attention_fwd_plan,
    decode_attention_fwd_steps,
)
from nki_lib.dispatch import NKIFallbackError, collect_runs, dispatch
from nki_lib.numerics import parity
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

SPEC = decode_attention_op.SPEC


def _launch(sample, num_splits=None, grid=1):
    """Run the launcher directly (strict simulator path); returns ((out, lse), RunReport)."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    starts = sample.args[6] if len(sample.args) > 6 else None
    flags = dict(scale=sample.kwargs.get("scale"), window_left=sample.kwargs.get("window_left", -1),
                 softcap=sample.kwargs.get("softcap", 0.0), cache_start=starts)
    with collect_runs() as runs, nki_lib.use_backend("simulator"), nki_lib.strict():
        outs = dispatch("decode_attention", (q, k, v, sinks), reference=None,
                        launch=lambda: decode_attention_fwd_plan.launch_decode_attention_fwd(q, k, v, seqlens, table, sinks,
                                                              num_splits=num_splits, grid=grid, **flags))
    return outs, runs[-1][1]


def launch_plan(sample, num_splits=None, grid=1):
    """The kernel arguments of the launcher's launch for ``sample``, by name."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    launch = decode_attention_fwd_plan.launch_decode_attention_fwd(
        q, k, v, seqlens, table, sinks, scale=None, window_left=-1, softcap=0.0, num_splits=num_splits, grid=grid)
    return inspect.signature(launch.kernel).bind(*launch.args).arguments


def _judge(sample, outs):
    dtype = sample.args[0].dtype
    up = sample.map_tensors(lambda t: t.to(torch.float64) if t.is_floating_point() else t)
    oracle = SPEC.naive(*up.args, **up.kwargs)
    baseline = SPEC.naive(*sample.args, **sample.kwargs)
    for i, name in enumerate(("out", "lse")):
        check = parity(outs[i], oracle[i], baseline[i], kind="output", dtype=dtype, name=name)
        assert check.ok, f"{sample.label}: {check}"


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_kv_merge(num_splits):
    sample = make_sample(2, 4, 2, 2, 32, [1500, 130], torch.bfloat16, block_size=16, capacity_=2048,
                         sinks=True, window_left=700)
    outs, report = _launch(sample, num_splits)
    _judge(sample, outs)


def _poison(t, keep):
    """``t`` with NaN everywhere ``keep`` is False."""
    return torch.where(keep, t, torch.full_like(t, float("nan")))


@pytest.mark.parametrize("window_left", [-1, 10])
def test_contiguous_reads_stop_at_needed_units(window_left):
    """NaN outside the 128-key units that hold a needed key would leak into out (0 * NaN)."""
    lengths, sq = [700, 100], 2
    sample = make_sample(2, 4, 1, sq, 16, lengths, torch.float32, capacity_=1024, window_left=window_left)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    unit = decode_attention_fwd_plan.CONTIGUOUS_UNIT_KEYS
    pos = torch.arange(k.shape[2])
    keep = torch.zeros(k.shape[0], 1, k.shape[2], 1, dtype=torch.bool)
    for b, length in enumerate(lengths):
        first = max(0, length - sq - window_left) if window_left >= 0 else 0
        keep[b, 0, :, 0] = (pos >= first // unit * unit) & (pos < -(-length // unit) * unit)
    poisoned = Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                      sample.label + " poisoned")
    result = op_parity(SPEC, poisoned, grads=False)
    assert result.ok, str(result)
    assert not any(torch.isnan(o).any() for o in _launch(poisoned)[0])


def poison_unneeded_keys(sample, length, sq, window_left):
    """``sample`` (one sequence of ``length`` keys, a paged cache) with NaN in every key no new token
    needs: spare blocks, the slots past L_b of the last block, the keys before the window."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    bs = k.shape[2]
    first = length - sq - window_left
    keep = torch.zeros(k.shape[0], 1, bs, 1, dtype=torch.bool)
    for col in range(-(-length // bs)):
        pos = col * bs + torch.arange(bs)
        keep[int(table[0, col]), 0, :, 0] = (pos >= first) & (pos < length)
    return Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                  sample.label + " poisoned")


def test_paged_long_chunk_steps_skip_unused_data():
    """A 16384-key chunk of 2 softmax steps (K gathered per step): NaN in spare blocks, in the slots
    past L_b of the last block and before the window never reaches the output."""
    length, sq, window_left, bs = 9000, 2, 5000, 128
    sample = make_sample(1, 8, 1, sq, 16, [length], torch.bfloat16, block_size=bs, num_blocks=80,
                         capacity_=16384, window_left=window_left)
    poisoned = poison_unneeded_keys(sample, length, sq, window_left)
    outs, report = _launch(poisoned)
    assert sum(e.attrs.get("dge_mode") == "swdge" for e in report.trace if e.opcode == "dma_copy") == 3
    assert not any(torch.isnan(o).any() for o in outs)
    result = op_parity(SPEC, poisoned, grads=False)
    assert result.ok, str(result)


def test_dominant_key_in_an_early_softmax_step():
    """A key of the first softmax step scores ~160 (exp overflows fp32), the rest of the chunk ~0:
    every later step must rescale against that maximum, never against a stale smaller one."""
    sample = make_sample(1, 8, 1, 1, 16, [16384], torch.bfloat16)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    q, k = torch.full_like(q, 2.0), k.clone()
    k[0, 0, 37 * 128 + 5] = 20.0                     # partition 37, slot 5: the first step
    boosted = Sample((q, k, v, seqlens, table, sinks), sample.kwargs, sample.label + " dominant key")
    outs, _ = _launch(boosted)
    assert all(torch.isfinite(o).all() for o in outs)
    result = op_parity(SPEC, boosted, grads=False)
    assert result.ok, str(result)


def test_paged_reads_only_used_blocks():
    """Spare blocks and table entries past the used blocks point at NaN blocks: never read."""
    sample = make_sample(2, 4, 2, 3, 16, [40, 9], torch.bfloat16, block_size=8, num_blocks=12,
                         capacity_=64, sinks=True)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    used = {int(x) for b, n in enumerate((5, 2)) for x in table[b, :n]}
    nan_blocks = [i for i in range(k.shape[0]) if i not in used]
    keep = torch.ones(k.shape[0], 1, 1, 1, dtype=torch.bool)
    keep[nan_blocks] = False
    table = table.clone()
    table[table < 0] = nan_blocks[0]
    poisoned = Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                      sample.label + " poisoned")
    result = op_parity(SPEC, poisoned, grads=False)
    assert result.ok, str(result)


@pytest.mark.parametrize("window_left, cap, length", [(-1, 24576, 20000), (22000, 40960, 38000)])
def test_contiguous_interior_chunks_use_hwdge_dmas(window_left, cap, length):
    """Chunks made only of needed units load with hardware-DGE DMAs (no gather); edge chunks gather."""
    sample = make_sample(2, 4, 1, 2, 128, [length, 130], torch.bfloat16, capacity_=cap,
                         window_left=window_left)
    outs, report = _launch(sample, num_splits=2)
    _judge(sample, outs)
    modes = [e.attrs.get("dge_mode") for e in report.trace if e.opcode == "dma_copy"]
    assert "hwdge" in modes and "swdge" in modes


def test_work_follows_lengths_not_capacity():
    """Same lengths, 2x the capacity: the same instructions run (device loops over needed chunks;
    capacities of several chunks, past the single-chunk path's SINGLE_CHUNK_KEYS)."""
    counts = []
    for cap in (16384, 32768):
        sample = make_sample(1, 2, 1, 1, 16, [300], torch.bfloat16, block_size=64, capacity_=cap)
        _, report = _launch(sample, num_splits=1)
        counts.append(report.instructions)
    longer = make_sample(1, 2, 1, 1, 16, [9000], torch.bfloat16, block_size=64, capacity_=32768)
    _, report = _launch(longer, num_splits=1)
    assert counts[0] == counts[1] < report.instructions


def test_gqa_group_shares_each_kv_load():
    """Every K/V chunk is gathered once per kv head, whatever the number of query heads."""
    gathers = []
    for group in (1, 4):
        sample = make_sample(2, 2 * group, 2, 3, 16, [600, 64], torch.bfloat16, block_size=32,
                             capacity_=1024)
        outs, report = _launch(sample, num_splits=1)
        _judge(sample, outs)
        gathers.append(sum(1 for e in report.trace if e.opcode == "dma_copy"
                           and e.attrs.get("dge_mode") == "swdge"))
    assert gathers[0] == gathers[1] > 0


@pytest.mark.parametrize("hq, sq, d", [(48, 3, 16), (2, 2, 160), (2, 1, 256)])
def test_row_and_head_dim_tiles(hq, sq, d):
    sample = make_sample(1, hq, 1, sq, d, [200], torch.bfloat16, block_size=32, sinks=True, softcap=8.0)
    outs, _ = _launch(sample)
    _judge(sample, outs)


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (256, torch.float32)])
def test_many_row_tiles_with_long_chunks_fit_sbuf(d, dtype):
    """512 rows (4 row tiles) over chunks of up to 16384 keys: the softmax step and the chunk
    buffers shrink so that every row tile's scores and P^T fit SBUF next to the chunk buffers."""
    sample = make_sample(1, 32, 1, 16, d, [16384], dtype)
    outs, _ = _launch(sample)        # the simulator raises if the live SBUF exceeds the target's
    _judge(sample, outs)


@pytest.mark.parametrize("b, hkv, num_splits", [(2, 2, None), (1, 1, None), (1, 1, 3), (3, 1, 1)],
                         ids=["units-per-core", "splits-per-core", "odd-splits-rounded", "odd-units"])
def test_lnc2(b, hkv, num_splits):
    """LNC2: whole (b, hk) units per core, or each core takes half of the splits and the two
    exchange their states (sendrecv) before the merge."""
    lengths = [1900, 70, 600][:b]
    sample = make_sample(b, 2 * hkv, hkv, 2, 32, lengths, torch.bfloat16, block_size=16, capacity_=2048,
                         sinks=True, window_left=900)
    outs, report = _launch(sample, num_splits, grid=2)
    assert report.grid == 2
    _judge(sample, outs)
    if b * hkv % 2:
        assert any(e.opcode == "sendrecv" for e in report.trace)


def test_unsupported_block_size_is_visible():
    sample = make_sample(1, 2, 1, 1, 8, [50], torch.float32, block_size=24)
    with nki_lib.use_backend("simulator"), nki_lib.strict(), pytest.raises(NKIFallbackError, match="block_size"):
        SPEC.op(*sample.args, **sample.kwargs)
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"):
        SPEC.op(*sample.args, **sample.kwargs)
    assert "block_size" in str(nki_lib.coverage())


def test_nan_and_inf_propagate_like_the_reference():
    sample = make_sample(2, 4, 2, 2, 16, [40, 9], torch.float32, block_size=8, capacity_=48, sinks=True)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    q, v = q.clone(), v.clone()
    q[0, 1, 0, 3] = float("nan")
    v[int(table[1, 0]), 0, 2, 5] = float("inf")
    outs = {}
    for path in ("reference", "simulator"):
        with nki_lib.use_backend(path), nki_lib.strict():
            outs[path] = torch.ops.nki.decode_attention(q, k, v, seqlens, table, sinks)
    for ref, got in zip(outs["reference"], outs["simulator"]):
        assert torch.isnan(ref).any() or torch.isinf(ref).any()
        assert torch.equal(torch.isnan(ref), torch.isnan(got)) and torch.equal(torch.isinf(ref), torch.isinf(got))


@pytest.mark.parametrize("block_size", [None, 16])
def test_invisible_slots_never_poison_the_result(block_size):
    """NaN in read-but-invisible slots (past L_b inside the last unit, before the window inside the
    first unit) and a legitimate inf in another sequence: non-finite outputs exactly where the
    reference has them."""
    lengths, sq, window = [300, 150], 2, 40
    sample = make_sample(2, 2, 1, sq, 16, lengths, torch.float32, block_size=block_size, capacity_=512,
                         window_left=window)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    k, v = k.clone(), v.clone()

    def slot(b, pos):           # (index into the cache's first two dims, row) of position pos of b
        if table is None:
            return (b, 0), pos
        return (int(table[b, pos // block_size]), 0), pos % block_size

    for b, length in enumerate(lengths):
        first = length - sq - window
        unit = block_size or decode_attention_fwd_plan.CONTIGUOUS_UNIT_KEYS
        invisible = list(range(first // unit * unit, first)) + list(range(length, -(-length // unit) * unit))
        for pos in invisible:
            idx, row = slot(b, pos)
            k[idx + (row,)] = float("nan")
            v[idx + (row,)] = float("nan")
    idx, row = slot(0, lengths[0] - 1)
    v[idx + (row, 0)] = float("inf")
    outs = {}
    for path in ("reference", "simulator"):
        with nki_lib.use_backend(path), nki_lib.strict():
            outs[path] = torch.ops.nki.decode_attention(q, k, v, seqlens, table, sinks, window_left=window)
    ref_out, got_out = outs["reference"][0], outs["simulator"][0]
    assert torch.isfinite(ref_out[1]).all() and not torch.isfinite(ref_out[0]).all()
    assert torch.equal(torch.isfinite(ref_out), torch.isfinite(got_out))
    assert torch.equal(torch.isfinite(outs["reference"][1]), torch.isfinite(outs["simulator"][1]))


@pytest.mark.parametrize("length, window_left", [(8192, -1), (8000, 3000)])
def test_long_row_step_masks_scores_in_psum(length, window_left):
    """One 64-slot softmax step per 8192-key chunk (4 rows): the mask evicts the unscaled scores
    from PSUM and the scale goes into -m and the exp (interior and edge chunks, with a window)."""
    sample = make_sample(1, 4, 1, 1, 32, [length], torch.bfloat16, capacity_=8192, sinks=True,
                         window_left=window_left, scale=0.3)
    outs, _ = _launch(sample, num_splits=1)
    _judge(sample, outs)


def test_many_sequences_broadcast_key_windows_by_dma():
    """B*S*2 > 128 key-window values: broadcast to the partitions by one DMA instead of a PE
    transpose of one column."""
    lengths = [1 + (7 * i) % 40 for i in range(65)]
    sample = make_sample(65, 2, 1, 1, 8, lengths, torch.float32, capacity_=40, window_left=9)
    outs, _ = _launch(sample, num_splits=1)
    _judge(sample, outs)


@pytest.mark.parametrize("length, window_left", [(300, -1), (8000, 500)])
def test_single_chunk_contiguous_reads_follow_the_window(length, window_left):
    """A contiguous capacity of one chunk loads statically, but only the partition groups holding
    a key of [first, L_b): fewer bytes than the full capacity, the rest poisoned with NaN."""
    cap = 8192
    sample = make_sample(1, 4, 1, 1, 32, [length], torch.bfloat16, capacity_=cap, window_left=window_left)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    first = max(0, length - 1 - window_left) if window_left >= 0 else 0
    pos = torch.arange(cap)[None, None, :, None]
    keep = (pos >= first) & (pos < length)
    poisoned = Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                      sample.label + " poisoned")
    outs, report = _launch(poisoned, num_splits=1)
    _judge(poisoned, outs)
    kv_bytes = sum(e.bytes for e in report.trace if e.opcode == "dma_copy" and e.bytes >= 1024)
    assert kv_bytes < 2 * cap * 32 * k.element_size()


def _units_stay_apart(sample, lengths, sq, window_left):
    """NaN in K and V outside every unit's [first, L_b) and a legitimate inf in unit 0's visible V:
    non-finite outputs exactly where the reference has them (unit 0's rows only), so units sharing a
    chunk never see each other's keys (0 * inf would be NaN)."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    hkv = k.shape[1]
    pos = torch.arange(k.shape[2])
    keep = torch.zeros(k.shape[0], hkv, k.shape[2], 1, dtype=torch.bool)
    for i, length in enumerate(lengths):
        first = max(0, length - sq - window_left) if window_left >= 0 else 0
        keep[i, :, :, 0] = (pos >= first) & (pos < length)
    v = _poison(v, keep).clone()
    v[0, 0, lengths[0] - 1, 0] = float("inf")
    poisoned = Sample((q, _poison(k, keep), v, seqlens, table, sinks), sample.kwargs, sample.label + " poisoned")
    with nki_lib.use_backend("reference"), nki_lib.strict():
        ref = torch.ops.nki.decode_attention(*poisoned.args, **poisoned.kwargs)
    got, _ = _launch(poisoned, num_splits=1)
    assert not torch.isfinite(ref[0][0]).all() and torch.isfinite(ref[0][1:]).all()
    assert torch.equal(torch.isfinite(ref[0]), torch.isfinite(got[0]))
    assert torch.equal(torch.isfinite(ref[1]), torch.isfinite(got[1]))


@pytest.mark.parametrize("b, hq, hkv, sq, d, lengths, window_left, dtype", [
    (8, 4, 1, 4, 64, [128, 5, 77, 4, 100, 128, 64, 65], -1, torch.bfloat16),   # the AWS shape: 4 units a chunk
    (8, 4, 1, 4, 64, [128, 5, 77, 4, 100, 128, 64, 65], 10, torch.float32),
    (4, 8, 2, 2, 64, [128, 3, 90, 127], 20, torch.bfloat16),                   # kv heads inside a pack
    (4, 4, 4, 1, 32, [100, 128, 1, 50], -1, torch.float16),
    (2, 2, 1, 2, 16, [128, 60], 7, torch.float32),                             # 2 units a chunk
])
def test_packed_units_share_one_chunk(b, hq, hkv, sq, d, lengths, window_left, dtype):
    """Short contiguous caches pack several units into one chunk (one K and one V load per pack):
    NaN outside every unit's [first, L_b) and a legitimate inf in one unit's visible V stay out of
    the other units' rows (each unit's P @ V contracts over its own partitions only)."""
    sample = make_sample(b, hq, hkv, sq, d, lengths, dtype, capacity_=128, sinks=True, window_left=window_left)
    outs, report = _launch(sample, num_splits=1)
    _judge(sample, outs)
    units, m = b * hkv, 1
    pack = 2 if b * hkv == 2 else 4
    chunk_bytes = nl.tile_size.pmax * pack * m * d * sample.args[1].element_size()
    loads = [e for e in report.trace if e.opcode == "dma_copy" and e.bytes == chunk_bytes]
    assert len(loads) == 2 * units // pack
    _units_stay_apart(sample, lengths, sq, window_left)


@pytest.mark.parametrize("b, hq, hkv, sq, d, cap, lengths, window_left, dtype, sinks", [
    (8, 8, 1, 4, 128, 1024, [1024, 5, 777, 130, 1000, 1024, 64, 129], -1, torch.bfloat16, True),  # the AWS shape
    (4, 8, 1, 4, 128, 1024, [1024, 300, 4, 900], 100, torch.float16, True),
    (4, 8, 2, 2, 64, 1024, [700, 1024, 2, 513], 37, torch.bfloat16, True),     # kv heads inside a pack
    (4, 16, 1, 1, 128, 512, [512, 17, 300, 256], -1, torch.bfloat16, True),    # Sq = 1, M = 4
    (2, 8, 1, 2, 128, 1024, [1000, 3], 500, torch.bfloat16, False),           # no sinks
    (36, 8, 1, 4, 128, 256, [4 + (53 * i) % 253 for i in range(36)], -1, torch.bfloat16, True),  # 2 q loads
])
def test_column_tiled_packs(b, hq, hkv, sq, d, cap, lengths, window_left, dtype, sinks):
    """Contiguous caches whose chunk rows are short but whose rows are too many for a shared packed
    tile: units share a chunk (4 KiB DMA rows), K arrives as K^T by one dma_transpose per pack, each
    unit's scores are column-tiled matmuls onto its own partitions, rows are token-major and each
    pack's out rows leave as one DMA of Sq rows per partition. NaN outside every unit's [first, L_b)
    and an inf in one unit's visible V stay out of the other units' rows."""
    sample = make_sample(b, hq, hkv, sq, d, lengths, dtype, capacity_=cap, sinks=sinks, window_left=window_left)
    outs, report = _launch(sample, num_splits=1)
    _judge(sample, outs)
    units = b * hkv
    pack = decode_attention_fwd_packed.column_pack_size(units, hq // hkv * sq, sq, cap // nl.tile_size.pmax, d,
                                                        sample.args[1].element_size(), 1)
    assert pack > 1
    transposes = [e for e in report.trace if e.opcode == "dma_transpose"]
    assert len(transposes) == units // pack
    tiled = [e for e in report.trace if e.opcode == "nc_matmul" and e.shape[0] == nl.tile_size.pmax // pack]
    assert len(tiled) >= units * cap // nl.tile_size.pmax
    assert not [e for e in report.trace if e.opcode == "nc_transpose" and e.shape == (d, nl.tile_size.pmax)]
    pack_out = [e for e in report.trace if e.opcode == "dma_copy" and e.shape == (pack * hq // hkv, sq * d)]
    assert len(pack_out) == units // pack
    _units_stay_apart(sample, lengths, sq, window_left)


@pytest.mark.parametrize("hq, sq, d, cap, window_left, reads", [
    (4, 2, 64, 256, -1, True), (4, 2, 64, 256, 3, False),      # packed units
    (8, 1, 128, 2048, -1, True),                                 # one unit per chunk
])
def test_single_chunk_kernel_reads_the_lengths(hq, sq, d, cap, window_left, reads):
    """A contiguous single-chunk cache without a window or cache start: the kernel reads L_b and
    derives [0, L_b) and its one edge range on chip, one register per unit instead of the four of
    the derived split bounds (the launcher passes the lengths either way, no tables); full and
    partial chunks, NaN past L_b never reaches the output."""
    lengths = [cap, 3, cap - 56, cap - 1]
    sample = make_sample(4, hq, 1, sq, d, lengths, torch.bfloat16, capacity_=cap, sinks=True,
                         window_left=window_left)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    launch = decode_attention_fwd_plan.launch_decode_attention_fwd(q, k, v, seqlens, table, sinks, scale=None,
                                                                  window_left=window_left, softcap=0.0,
                                                                  num_splits=1, grid=1)
    assert launch.args[3] is None and torch.equal(launch.args[4], seqlens.to(torch.int32))
    pos = torch.arange(cap)[None, None, :, None]
    keep = pos < torch.tensor(lengths)[:, None, None, None]
    poisoned = Sample((q, k, _poison(v, keep), seqlens, table, sinks), sample.kwargs, sample.label + " poisoned")
    outs, report = _launch(poisoned, num_splits=1)
    _judge(poisoned, outs)
    if d == 64:                                 # the packed path reads no key registers
        registers = [e for e in report.trace if e.opcode == "register_load"]
        assert len(registers) == len(lengths) * (1 if reads else 4)


@pytest.mark.parametrize("b, hq, hkv, d, cap, lengths, window_left, dtype, taken", [
    (4, 8, 1, 128, 2048, [2048, 3, 1990, 700], -1, torch.bfloat16, True),    # the AWS shape, partial lengths
    (2, 4, 2, 128, 2048, [1500, 2048], 300, torch.float16, True),            # two kv heads, a window
    (1, 8, 1, 128, 1024, [1000], -1, torch.bfloat16, True),                   # one unit, M = 8
    (4, 8, 1, 128, 4096, [4096, 3, 4000, 700], -1, torch.bfloat16, False),   # M = 32: PE transposes
    (4, 8, 1, 128, 2048, [2048, 3, 1990, 700], -1, torch.float32, False),    # 4-byte K: PE transposes
])
def test_last_unit_k_by_dma_transpose(b, hq, hkv, d, cap, lengths, window_left, dtype, taken):
    """The single-chunk path of a contiguous 2-byte cache with at most ``K_T_DMA_MAX_SLOTS`` keys per
    partition loads the K of its last unit as K^T by one dma_transpose of the whole chunk (no PE
    transposes of its keys); the other units keep their PE transposes. It reads keys past L_b and
    before the window: NaN there (K and V, every unit) stays out of the result."""
    sample = make_sample(b, hq, hkv, 1, d, lengths, dtype, capacity_=cap, sinks=True, window_left=window_left)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    m = cap // nl.tile_size.pmax
    assert decode_attention_fwd.k_by_transpose(cap, k.element_size(), d, m) == taken
    pos = torch.arange(cap)[None, None, :, None]
    length = torch.tensor(lengths)[:, None, None, None]
    first = (length - 1 - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(length)
    keep = (pos >= first) & (pos < length)
    poisoned = Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                      sample.label + " poisoned")
    outs, report = _launch(poisoned, num_splits=1)
    _judge(poisoned, outs)
    transposes = [e for e in report.trace if e.opcode == "dma_transpose"]
    assert [e.shape for e in transposes] == ([(d, m, nl.tile_size.pmax)] if taken else [])
    k_t = [e for e in report.trace if e.opcode == "nc_transpose" and e.shape == (d, nl.tile_size.pmax)]
    assert len(k_t) == (b * hkv - taken) * m


def _poisoned_paged_blocks(sample, bs, lengths, sq, window_left):
    """``sample`` with NaN in K and V in every block of a paged (NB, Hkv, bs, D) cache that no
    sequence uses and in every slot of a used block outside its sequence's [first, L_b)."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    keep = torch.zeros(k.shape[0], 1, bs, 1, dtype=torch.bool)
    for i, length in enumerate(lengths):
        first = max(0, length - sq - window_left) if window_left >= 0 else 0
        for col in range(-(-length // bs)):
            pos = col * bs + torch.arange(bs)
            keep[int(table[i, col]), 0, :, 0] = (pos >= first) & (pos < length)
    return Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks), sample.kwargs,
                  sample.label + " poisoned")


def _poisoned_outside_window(sample, cap, lengths, sq, window_left):
    """``sample`` with NaN in K and V at every cached position outside each sequence's [first, L_b)
    of a contiguous (B, Hkv, cap, D) cache (``first`` folds in the cache start, ``sample.args[6]``,
    when there is one), and ``first`` (B, 1, 1, 1)."""
    q, k, v, seqlens, table, sinks = sample.args[:6]
    starts = sample.args[6:7]
    pos = torch.arange(cap)[None, None, :, None]
    length = torch.tensor(lengths)[:, None, None, None]
    first = (length - sq - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(length)
    if starts and starts[0] is not None:
        first = torch.maximum(first, starts[0].to(first.dtype)[:, None, None, None])
    keep = (pos >= first) & (pos < length)
    return Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks, *starts), sample.kwargs,
                  sample.label + " poisoned"), first


@pytest.mark.parametrize("b, hq, hkv, sq, d, cap, lengths, window_left, dtype, taken", [
    (2, 16, 2, 1, 64, 8192, [8192, 1000], -1, torch.bfloat16, True),    # M = 64: 4 groups, 3 skipped for b = 1
    (1, 8, 1, 2, 64, 4096, [4000], 1500, torch.float16, True),          # M = 32: 2 groups, a window skips group 0
    (2, 8, 2, 1, 32, 8192, [5000, 8192], -1, torch.bfloat16, True),     # D = 32
    (2, 16, 2, 1, 64, 8192, [8192, 1000], -1, torch.float32, False),    # 4-byte K: PE transposes
])
def test_every_k_by_dma_transpose_at_d64(b, hq, hkv, sq, d, cap, lengths, window_left, dtype, taken):
    """D <= 64 on the single-chunk path of a contiguous 2-byte cache: the K of every unit loads as K^T
    by dma_transposes of partition groups (no PE transposes of keys), each group only when it holds a
    key of [first, L_b); NaN outside every unit's [first, L_b) (K and V) stays out of the result."""
    pmax = nl.tile_size.pmax
    sample = make_sample(b, hq, hkv, sq, d, lengths, dtype, capacity_=cap, sinks=True, window_left=window_left)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    m = cap // pmax
    assert decode_attention_fwd.every_k_by_transpose(cap, k.element_size(), d) == taken
    poisoned, first = _poisoned_outside_window(sample, cap, lengths, sq, window_left)
    outs, report = _launch(poisoned, num_splits=1)
    _judge(poisoned, outs)
    pg = decode_attention_fwd._k_t_groups(m, k.element_size())
    assert pg * m * k.element_size() >= decode_attention_fwd.K_T_ROW_BYTES or pg == pmax
    needed = sum(int(lb > g * pg * m and int(f) < (g + 1) * pg * m)
                 for lb, f in zip(lengths, first.flatten()) for g in range(pmax // pg)) * hkv
    transposes = [e for e in report.trace if e.opcode == "dma_transpose"]
    assert [e.shape for e in transposes] == ([(d, m, pg)] * needed if taken else [])
    k_t = [e for e in report.trace if e.opcode == "nc_transpose" and e.shape == (d, pmax)]
    assert len(k_t) == (0 if taken else b * hkv * m)


@pytest.mark.parametrize("b, hq, hkv, sq, d, cap, lengths, window_left, dtype, grid", [
    (1, 8, 1, 1, 64, 3072, [3072], -1, torch.bfloat16, 1),       # M = 32, 96 partitions: K^T groups of 32
    (2, 8, 2, 2, 64, 3072, [3000, 700], 1000, torch.bfloat16, 1),  # a window; the second sequence 22 groups
    (1, 8, 1, 1, 128, 1536, [1536], -1, torch.bfloat16, 1),      # D = 128, M = 16: the last K by transpose
    (2, 4, 2, 1, 64, 1000, [999, 1], -1, torch.float32, 1),      # M = 8, 125 partitions: a group of 13
    (1, 8, 1, 1, 32, 1000, [1000], 200, torch.bfloat16, 1),      # one K^T group of 125 partitions, cut short
    (2, 8, 2, 1, 128, 3072, [2500, 3072], -1, torch.float16, 2),  # LNC2: each core two units
    (1, 8, 1, 1, 64, 3000, [3000], -1, torch.bfloat16, 1),       # M = 32: 93 partitions and 24 keys on the 94th
    (2, 8, 2, 2, 64, 3000, [2977, 2990], 40, torch.bfloat16, 1),  # windows inside the last two partitions
    (2, 8, 2, 1, 128, 2500, [2500, 1], -1, torch.float16, 2),    # D = 128, LNC2: 78 partitions and 4 keys
    (1, 8, 1, 1, 128, 1900, [1899], -1, torch.bfloat16, 1),      # M = 16: the last K by transpose, 12 keys
    (1, 4, 1, 1, 32, 6000, [6000], -1, torch.bfloat16, 1),       # M = 64, D = 32: 93 partitions and 48 keys
    (2, 4, 2, 3, 64, 2500, [2500, 2000], 700, torch.float32, 1),  # 4-byte K: PE transposes of a partial row
])
def test_single_chunk_below_the_capacity_of_its_chunk(b, hq, hkv, sq, d, cap, lengths, window_left, dtype, grid):
    """A contiguous cache whose capacity is below the chunk (M rounded up to a power of two,
    ``keys_per_partition``: 3072 keys -> M = 32; 3000 too, its last partition holding 24 keys) takes
    the single-chunk path, not the multi-chunk one: no unit-id gathers, only the ``chunk_partitions``
    partitions holding keys of the head are read, and of a last partly filled one only those keys
    (``partition_rows``: never a byte past the head, so at most the cache's K and V bytes move). The
    rest of the chunk -- never written, NaN on the simulator -- with NaN at every cached position
    outside [first, L_b), stays out of the result. K^T groups tile those partitions (``_k_t_groups``)
    when a power of two from 16 up does; a group cut short is transposed into its own tile, so no
    ``dma_transpose`` writes runs shorter than the partial partition's keys."""
    pmax = nl.tile_size.pmax
    sample = make_sample(b, hq, hkv, sq, d, lengths, dtype, capacity_=cap, sinks=True, window_left=window_left)
    q, k, v = sample.args[:3]
    m = launch_plan(sample, grid=grid)["keys_per_partition"]
    n_part = decode_attention_fwd.chunk_partitions(cap, m)
    assert m * pmax > cap and (n_part - 1) * m < cap <= n_part * m and n_part < pmax
    assert decode_attention_fwd.single_chunk_path(1, b * hkv, grid, cap, m * pmax)
    poisoned, _ = _poisoned_outside_window(sample, cap, lengths, sq, window_left)
    outs, report = _launch(poisoned, grid=grid)
    assert not any(torch.isnan(o).any() for o in outs)
    _judge(poisoned, outs)
    assert _swdge_gathers(report) == 0
    read = Counter()                                # bytes read from each HBM tensor (K, V, q, ...)
    for e in report.trace:
        if e.opcode in ("dma_copy", "dma_transpose") and e.reads and e.reads[0].memory.endswith("hbm"):
            read[e.reads[0].buffer_id] += e.bytes
    assert max(read.values()) <= k.numel() * k.element_size()
    pg = decode_attention_fwd.k_t_head_groups(m, k.element_size(), cap)
    whole, rest = divmod(cap, m)
    short = {(d, m, whole % pg), (d, rest, 1)}      # the last group's whole partitions, its partial one
    transposes = [e for e in report.trace if e.opcode == "dma_transpose"]
    assert all(e.shape == (d, m, pg) or e.shape in short for e in transposes)
    assert all(e.attrs["contiguous_bytes"] >= (rest or m) * k.element_size() for e in transposes)


@pytest.mark.parametrize("b, hq, hkv, sq, d, cap, lengths, window_left, num_splits, grid", [
    (2, 8, 1, 1, 64, 40960, [38000, 1000], -1, 2, 1),      # M = 128: 3 chunks, a partial last chunk
    (2, 8, 1, 2, 64, 40960, [38000, 16384], 22000, 3, 1),  # a window: the first chunk reads 1 of 8 groups
    (1, 16, 2, 1, 64, 16384, [16384], -1, 1, 1),           # one split of one interior chunk per unit
    (2, 8, 2, 1, 32, 4096, [4000, 700], 1500, 2, 1),       # M = 32, D = 32: 64 partitions per DMA
    (1, 4, 1, 3, 64, 2048, [1990], 300, 3, 1),             # M = 16: one DMA per chunk, empty splits
    (1, 8, 1, 1, 64, 40960, [37000], 30000, 3, 2),         # LNC2: the cores share the splits (sendrecv)
])
def test_multi_chunk_k_by_dma_transpose_at_d64(b, hq, hkv, sq, d, cap, lengths, window_left, num_splits, grid):
    """D <= 64 on the multi-chunk (split-KV) path of a contiguous 2-byte cache: K loads as K^T by
    hardware-DGE dma_transposes of ``_k_t_groups`` partitions at runtime chunk offsets (no PE
    transposes of keys), each source (16, groups, M/f, 128): f = 128/D consecutive slots of a
    partition per 128-element row (the documented hwdge form, docs/nki-semantics.md §14.15); an edge
    chunk reads only the partition groups holding a key of [first, L_b), an interior chunk all. NaN
    outside every sequence's [first, L_b) (K and V) stays out of the result (sinks, splits forced to
    1, 2, 3)."""
    _check_multi_chunk_k_t(b, hq, hkv, sq, d, cap, lengths, window_left, num_splits, grid)


@pytest.mark.parametrize("d, cap, lengths, window_left, starts, num_splits", [
    (64, 40960, [32768, 16384], -1, None, 2),         # L_b at a chunk edge (M = 128: 16384-key chunks)
    (64, 40960, [16385, 32767], 16383, None, 3),      # one key past an edge; a window ending a key short
    (64, 40960, [38000, 20000], -1, [16384, 3000], 2),   # cache_start at a chunk edge and inside a span
    (32, 8192, [8192, 4097], 2047, [1, 0], 3),        # D = 32 (four slots a row): window and cache start
    (64, 4096, [4096], 0, None, 2),                   # window_left = 0: one key per row
])
def test_multi_chunk_folded_k_t_edges(d, cap, lengths, window_left, starts, num_splits):
    """The folded K^T of the multi-chunk path (slots 2c, 2c+1 (D = 64) or 4c .. 4c+3 (D = 32) of a
    partition one 128-element source row; the score matmuls on the PE row tile of each slot's
    partitions) at its edges: L_b at and one key past a chunk edge, windows, cache starts."""
    _check_multi_chunk_k_t(len(lengths), 8, 1, 1, d, cap, lengths, window_left, num_splits, 1, starts)


def _check_multi_chunk_k_t(b, hq, hkv, sq, d, cap, lengths, window_left, num_splits, grid, starts=None):
    pmax = nl.tile_size.pmax
    sample = make_sample(b, hq, hkv, sq, d, lengths, torch.bfloat16, capacity_=cap, sinks=True,
                         window_left=window_left,
                         starts=starts)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    poisoned, first = _poisoned_outside_window(sample, cap, lengths, sq, window_left)
    outs, report = _launch(poisoned, num_splits=num_splits, grid=grid)
    assert decode_attention_fwd.every_k_by_transpose(cap, k.element_size(), d)
    m = decode_attention_fwd_plan.keys_per_partition(cap, d, k.element_size())
    assert not decode_attention_fwd.single_chunk_path(num_splits, b * hkv, grid, cap, m * pmax)
    _judge(poisoned, outs)
    assert decode_attention_fwd.stream_k_by_transpose(cap, m, k.element_size(), d)
    fold = decode_attention_fwd.k_t_fold(d, m)
    span = decode_attention_fwd._k_t_groups(m // fold, k.element_size())
    chunk = m * pmax
    needed = sum(int(p0 * m < lb - c0 and int(f) - c0 < (p0 + span) * m)
                 for lb, f in zip(lengths, first.flatten()) for c0 in range(int(f) // chunk * chunk, lb, chunk)
                 for p0 in range(0, pmax, span)) * hkv
    transposes = [e for e in report.trace if e.opcode == "dma_transpose"]
    assert len(transposes) == needed
    rows = decode_attention_fwd.K_T_DGE_ROWS
    assert all(e.shape == (pmax, span // rows, m // fold, rows) and e.attrs["dge_mode"] == "hwdge"
               and e.reads[0].shape == (rows, span // rows, m // fold, pmax) for e in transposes)
    assert not [e for e in report.trace if e.opcode == "nc_transpose" and e.shape == (d, pmax)]


@pytest.mark.parametrize("d, cap, length, m", [
    (64, 3000, 2900, 8),    # spans of 128 partitions (1024 keys) pass the capacity
    (64, 100, 90, 1),       # M = 1: no two slots of a partition to fold into a 128-element row
    (32, 200, 199, 2),      # D = 32, M = 2: not four slots
])
def test_multi_chunk_k_by_pe_transposes_when_spans_pass_the_capacity(d, cap, length, m):
    """A capacity that is not a whole number of K^T DMA spans (3000 keys: M = 8, the largest number
    of keys per partition whose units (8 keys, ``gcd(3000, 128)``) tile the chunk; spans of 128
    partitions, 1024 keys), or an M that is not a multiple of the slots folded into one
    128-element hwdge source row (``k_t_fold``), keeps the gathers and PE transposes of K on the
    multi-chunk path (a span holding a needed key would read past the cache; the hardware DGE takes
    no other source shape; at D <= 64 a PE transpose may make K^T of 128/D slots at once)."""
    sample = make_sample(1, 8, 1, 1, d, [length], torch.bfloat16, capacity_=cap, sinks=True)
    assert launch_plan(sample, num_splits=2)["keys_per_partition"] == m
    assert not decode_attention_fwd.stream_k_by_transpose(cap, m, 2, d)
    outs, report = _launch(sample, num_splits=2)
    _judge(sample, outs)
    assert not [e for e in report.trace if e.opcode == "dma_transpose"]
    pmax = nl.tile_size.pmax       # K^T of one slot (D, 128), or of 128/D slots at once (pairs)
    assert [e for e in report.trace if e.opcode == "nc_transpose" and e.shape in ((d, pmax), (pmax, pmax))]


def test_merges_follow_each_unit_when_a_later_group_follows():
    """Single-chunk path with more units than K/V buffer pairs (8 units of 64 slots, 4 pairs): the
    merge of each unit of a group that a later group follows is issued right behind its own P @ V
    (unit after unit), so the first merge precedes the second unit's P @ V; the last group keeps
    the lockstep (every P @ V before the first of its merges)."""

    from nki_lib.attention.kernels import decode_attention_fwd_steps as steps

    cap, hkv = 8192, 4
    sample = make_sample(2, 4, hkv, 1, 128, [8192, 5000], torch.bfloat16, capacity_=cap, sinks=True)
    outs, report = _launch(sample, num_splits=1)
    _judge(sample, outs)
    lines, start = inspect.getsourcelines(steps.step_pv_phases)
    pv_lines = {f"decode_attention_fwd_steps.py:{start + i}" for i, text in enumerate(lines) if "nc_matmul" in text}
    order = [e for e in report.trace if e.program_id == 0]
    pv = [e.index for e in order if e.opcode == "nc_matmul" and e.source in pv_lines]
    merges = [e.index for e in order if e.opcode == "reciprocal"]
    m = cap // nl.tile_size.pmax
    per_unit = 2 * m                            # O^T form: one V matmul and one row-sum matmul a slot
    units = 2 * hkv
    assert len(pv) == units * per_unit and len(merges) == units
    assert sum(i < merges[0] for i in pv) == per_unit            # first group: unit 0 merged before unit 1's P @ V
    assert sum(i < merges[units // 2] for i in pv) == units * per_unit   # last group: lockstep



def test_d64_8k_cache_fits_psum():
    """gpt-oss-120b's decode (B=1 Hq=64 Hkv=8 D=64) at an 8k cache runs on the kernel with parity:
    its steps of 64 slots are no longer fused when a second wave follows (two waves of score blocks
    held in PSUM needed 9 banks; perf-log §18.7)."""
    s = make_sample(1, 64, 8, 1, 64, [8192], torch.bfloat16)
    result = op_parity(SPEC, s, grads=False)
    assert result.ok, result


def _swdge_gathers(report):
    return sum(e.attrs.get("dge_mode") == "swdge" for e in report.trace if e.opcode == "dma_copy")


@pytest.mark.parametrize("b, hq, hkv, sq, d, lengths, dtype, flags, gathers", [
    # 12 units, K and V tiles apart: one K and one V gather per sequence (its 4 kv heads), not one per head
    (3, 8, 4, 2, 32, [1001, 517, 64], torch.bfloat16, dict(window_left=300, sinks=True), 2 * 3),
    # 16 units whose K and V do not both fit: V over K (``overlay``), waves of 2 units (D = 256: two
    # head-dim chunks); K per wave (8), V per wave but the first and the last in single units (10)
    (2, 16, 8, 1, 256, [1024, 333], torch.float32, dict(sinks=True), 8 + 10),
])
def test_paged_heads_share_gathers(b, hq, hkv, sq, d, lengths, dtype, flags, gathers):
    """Paged single-chunk path with one block per partition (M = block size): the consecutive kv heads
    of a sequence share each gather (a block's heads are one contiguous run of its row). A permuted
    table, partial last blocks, NaN in every unused block and in every slot outside [first, L_b) of
    the used ones: parity with the reference and no NaN."""
    bs, cap = 8, 1024
    sample = make_sample(b, hq, hkv, sq, d, lengths, dtype, block_size=bs, capacity_=cap,
                         num_blocks=sum(-(-n // bs) for n in lengths) + 5, **flags)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    m = decode_attention_fwd_plan.keys_per_partition(cap, d, q.element_size())
    assert m == bs and decode_attention_fwd_gathers.shared_gathers(None, bs, m)
    poisoned = _poisoned_paged_blocks(sample, bs, lengths, sq, flags.get("window_left", -1))
    outs, report = _launch(poisoned)
    assert not any(torch.isnan(o).any() for o in outs)
    _judge(poisoned, outs)
    assert _swdge_gathers(report) == gathers
    outs, _ = _launch(poisoned, grid=2)             # LNC2: each core's units alternate, one head per gather
    assert not any(torch.isnan(o).any() for o in outs)
    _judge(poisoned, outs)


@pytest.mark.parametrize("d, dtype, bs, lengths, flags, pack", [
    # D = 64: slots (c, c+1) in one transpose, lengths at block edges (a full block, one key past one)
    (64, torch.bfloat16, 8, [1024, 8, 9], dict(window_left=15, sinks=True), 2),
    # D = 32: 4 slots per transpose (32-row tiles), a window inside the last block, fp32
    (32, torch.float32, 8, [1000, 513, 64], dict(window_left=3, softcap=5.0), 4),
    # D = 128: one slot per transpose, as before
    (128, torch.bfloat16, 4, [512, 77, 4], dict(sinks=True), 1),
])
def test_paged_keys_transposed_in_slot_groups(d, dtype, bs, lengths, flags, pack):
    """Paged single-chunk path with one block per partition at D <= 64: one PE transpose moves
    ``128 / D`` consecutive slots of K (slot i on partitions i*D ..), and each slot's score matmul is
    a row tile over its own D partitions, so a NaN key of the neighbouring slot (unused block, or
    outside [first, L_b)) never meets the slot's query (NaN poisoning as above): parity, no NaN,
    ``M / pack`` key transposes per unit, every score matmul over D partitions at a multiple of D."""
    hq, hkv, sq = 2 * 3, 3, 2
    cap = bs * nl.tile_size.pmax
    sample = make_sample(len(lengths), hq, hkv, sq, d, lengths, dtype, block_size=bs, capacity_=cap,
                         num_blocks=sum(-(-n // bs) for n in lengths) + 5, **flags)
    q, k, v, seqlens, table, sinks = sample.args[:6]
    m = decode_attention_fwd_plan.keys_per_partition(cap, d, q.element_size())
    assert m == bs
    poisoned = _poisoned_paged_blocks(sample, bs, lengths, sq, flags.get("window_left", -1))
    outs, report = _launch(poisoned)
    assert not any(torch.isnan(o).any() for o in outs)
    _judge(poisoned, outs)
    pmax = nl.tile_size.pmax
    key_transposes = [e for e in report.trace if e.opcode == "nc_transpose" and e.shape == (pack * d, pmax)]
    assert len(key_transposes) == len(lengths) * hkv * m // pack
    if pack > 1:
        scores = [e for e in report.trace if e.opcode == "nc_matmul" and e.attrs["K"] == d and e.attrs["M"] == pmax]
        assert len(scores) == len(lengths) * hkv * m
        assert {e.reads[0].partitions for e in scores} == {(p0, p0 + d) for p0 in range(0, pmax, d)}


@pytest.mark.parametrize("d, dtype, bs, lengths, flags", [
    # D = 64 bf16, 32 slots a step (the threshold): lengths at block edges, a window and sinks
    (64, torch.bfloat16, 32, [4096, 32, 33], dict(window_left=40, sinks=True)),
    # D = 32 fp32, 64 slots a step, softcap
    (32, torch.float32, 64, [6000, 65, 64], dict(softcap=5.0)),
])
def test_pv_on_pe_column_tiles(d, dtype, bs, lengths, flags):
    """A direct P @ V step of >= PV_TILES_MIN_SLOTS slots and <= 32 rows spreads its slots over the
    four 32-column PE tiles (slot j on tile j % 4, its own zeroed partial) and adds the partials by one
    fp32 matmul with the selection matrix: parity, no NaN with NaN in every unused block and slot
    outside [first, L_b), and every P @ V matmul on a 32-column tile."""
    hq, hkv, sq = 2 * 3, 3, 2
    cap = bs * nl.tile_size.pmax
    sample = make_sample(len(lengths), hq, hkv, sq, d, lengths, dtype, block_size=bs, capacity_=cap,
                         num_blocks=sum(-(-n // bs) for n in lengths) + 5, **flags)
    q = sample.args[0]
    m = decode_attention_fwd_plan.keys_per_partition(cap, d, q.element_size())
    rows = hq // hkv * sq
    assert decode_attention_fwd_steps.pv_column_tiles(rows, m, True) == nl.tile_size.pmax // 32
    poisoned = _poisoned_paged_blocks(sample, bs, lengths, sq, flags.get("window_left", -1))
    outs, report = _launch(poisoned)
    assert not any(torch.isnan(o).any() for o in outs)
    _judge(poisoned, outs)
    tiled = [e.attrs["tile"] for e in report.trace if e.opcode == "nc_matmul" and e.attrs.get("tile")
             and e.attrs["tile"][3] == 32]
    # per unit and slot one P @ V and one row-sum matmul, on the four column tiles
    assert len(tiled) == 2 * len(lengths) * hkv * m
    assert {t[2] for t in tiled} == {0, 32, 64, 96}


def test_pv_column_tiles_threshold():
    steps = decode_attention_fwd_steps
    assert steps.pv_column_tiles(8, steps.PV_TILES_MIN_SLOTS, True) == nl.tile_size.pmax // steps.PV_TILE_COLUMNS
    assert steps.pv_column_tiles(8, steps.PV_TILES_MIN_SLOTS - 1, True) == 1      # too few slots
    assert steps.pv_column_tiles(steps.PV_TILE_COLUMNS + 1, 64, True) == 1       # rows exceed a column tile
    assert steps.pv_column_tiles(8, 64, False) == 1                              # the transposed form


def test_head_runs_and_v_gather_parts():
    """Gathers span consecutive kv heads of one sequence only; V-over-K gathers split the first wave
    in halves and the last wave's last unit apart."""
    runs = decode_attention_fwd_gathers.head_runs([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)])
    assert runs == [(0, 3), (3, 2), (5, 1)]
    waves = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [decode_attention_fwd_gathers.v_gather_parts(waves, w) for w in range(2)] == [[[0, 1], [2, 3]], [[4, 5, 6], [7]]]
    assert decode_attention_fwd_gathers.v_gather_parts([[0, 1]], 0) == [[0], [1]]


def _host_ops(sample):
    """The host-side torch ops of one op call on the simulator (the whole-op accounting's record)."""
    from nki_lib.bench.whole_op import record_host_ops

    with nki_lib.use_backend("simulator"), nki_lib.strict(), record_host_ops() as ops:
        torch.ops.nki.decode_attention(*sample.args, **sample.kwargs)
    return ops


@pytest.mark.parametrize("flags, index_dtype, casts", [
    (dict(block_size=16, capacity_=2048, window_left=300), torch.int32, 0),         # paged, multi-chunk
    (dict(block_size=64, capacity_=8192), torch.int32, 0),                          # paged, single chunk
    (dict(capacity_=40000), torch.int32, 0),                                        # contiguous, multi-chunk
    (dict(capacity_=40000, window_left=700, starts=[100, 0]), torch.int32, 0),      # ... window, cache start
    (dict(block_size=16, capacity_=2048, starts=[100, 0]), torch.int64, 2),         # int64 lengths, starts
    (dict(block_size=16, capacity_=1500), torch.int32, 1),                          # table padded to whole chunks
])
def test_paged_and_multi_chunk_launches_issue_no_host_ops(flags, index_dtype, casts):
    """The kernel derives split bounds, key windows and the skipping of unneeded units on chip: the
    launcher's only host ops are the casts of int64 index tensors (the validators' host copies
    aside; the block table itself is int32)."""
    sample = make_sample(2, 4, 2, 1, 64, [1500, 900], torch.bfloat16, index_dtype=index_dtype, **flags)
    names = [o.name for o in _host_ops(sample)]
    glue = [n for n in names if n != "to_host"]
    assert len(glue) == casts and all(n.startswith(("aten.to.", "aten._to_copy", "aten.pad", "aten.constant_pad"))
                                      for n in glue), names


@pytest.mark.parametrize("block_size, cap, num_splits, starts, window_left", [
    (None, 2048, 3, [300, 0], -1), (None, 2048, 2, [40, 700], 500), (16, 2048, 3, [300, 0], -1),
    (16, 2048, 5, [0, 33], 200), (16, 1500, 3, [0, 0], 400),     # the last: a table padded to whole chunks
])
def test_derived_bounds_with_cache_start_and_odd_splits(block_size, cap, num_splits, starts, window_left):
    """Split bounds and key windows derived on chip with first = max(L - Sq - window, cache_start)
    and a split count that is not a power of two (the rounded division), multi-chunk: NaN outside
    every [first, L_b) never reaches the output."""
    lengths, sq = [1500, 900], 2
    sample = make_sample(2, 4, 2, sq, 32, lengths, torch.bfloat16, block_size=block_size, capacity_=cap,
                         starts=starts, window_left=window_left, sinks=True)
    if block_size is None:
        q, k, v, seqlens, table, sinks, start_t = sample.args
        pos = torch.arange(cap)[None, None, :, None]
        first = torch.tensor([max(s, n - sq - window_left if window_left >= 0 else 0)
                              for s, n in zip(starts, lengths)])[:, None, None, None]
        keep = (pos >= first) & (pos < torch.tensor(lengths)[:, None, None, None])
        sample = Sample((q, _poison(k, keep), _poison(v, keep), seqlens, table, sinks, start_t), sample.kwargs,
                        sample.label + " poisoned")
    outs, _ = _launch(sample, num_splits=num_splits)
    _judge(sample, outs)
