"""Forward parity and structure of the flash-attention NKI kernel (``kernels/flash_attention_fwd.py``) on the
simulator in strict mode, judged against the fp64 oracle by ``op_parity`` (numerics tolerances).

Structure tests read the simulator trace: fully masked tiles are skipped, masks are emitted only
on partial tiles, K/V are loaded once per GQA group, and the working set stays bounded at
Sq = Sk = 16384 (slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from nki_lib import backend, registry, simulator
from nki_lib.attention import flash_attention_reference, masks
from nki_lib.attention.kernels import flash_attention_fwd, tiles
from nki_lib.attention.kernels import flash_attention_fwd_step as fwd_step
from nki_lib.dispatch import Unsupported, collect_runs
from nki_lib.numerics import parity
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

SPEC = registry.get("flash_attention")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (1, 8, 32, 64, 100, 128, 160, 256)


@dataclass(frozen=True)
class Case:
    b: int = 1
    hq: int = 2
    hkv: int = 1
    sq: int = 17
    sk: int = 17
    d: int = 8
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    scale: float | None = None
    sinks: bool = False
    cu_seqlens: tuple | None = None
    seed: int = 0

    def sample(self) -> Sample:
        gen = torch.Generator().manual_seed(self.seed)
        randn = lambda *shape: torch.randn(*shape, generator=gen).to(self.dtype)  # noqa: E731
        q = randn(self.b, self.hq, self.sq, self.d)
        k = randn(self.b, self.hkv, self.sk, self.d)
        v = randn(self.b, self.hkv, self.sk, self.d)
        sinks = torch.randn(self.hq, generator=gen) if self.sinks else None
        cu = None if self.cu_seqlens is None else torch.tensor(self.cu_seqlens, dtype=torch.int32)
        kwargs = dict(causal=self.causal, scale=self.scale, window_left=self.window[0],
                      window_right=self.window[1], softcap=self.softcap)
        return Sample((q, k, v, sinks, cu), kwargs, repr(self))


@st.composite
def cases(draw) -> Case:
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    packed = draw(st.booleans())
    sq = draw(st.integers(1, 300))
    sk = sq if packed else draw(st.one_of(st.integers(1, 300), st.integers(513, 2200)))
    cu = None
    if packed:
        cuts = draw(st.lists(st.integers(0, sq), max_size=4))
        cu = tuple([0, *sorted(cuts), sq])
    window = (draw(st.sampled_from((-1, 0, 3, 40, 200))), draw(st.sampled_from((-1, 0, 5, 130))))
    return Case(b=1 if packed else draw(st.integers(1, 2)), hq=hkv * group, hkv=hkv, sq=sq, sk=sk,
                d=draw(st.sampled_from(HEAD_DIMS)), dtype=draw(st.sampled_from(DTYPES)),
                causal=draw(st.booleans()), window=window,
                softcap=draw(st.sampled_from((0.0, 0.0, 5.0, 30.0))),
                scale=draw(st.sampled_from((None, None, 0.3, -0.7))), sinks=draw(st.booleans()),
                cu_seqlens=cu, seed=draw(st.integers(0, 2 ** 16)))


def _assert_parity(case: Case):
    result = op_parity(SPEC, case.sample(), grads=False)
    assert result.ok, str(result)


@given(case=cases())
@example(case=Case(sq=1, sk=1, d=1))
@example(case=Case(sq=129, sk=127, d=1, causal=True))                       # Sq > Sk: empty rows
@example(case=Case(sq=129, sk=127, d=64, causal=True, sinks=True))          # empty rows, sink only
@example(case=Case(sq=300, sk=129, d=64, dtype=torch.float16, window=(0, 0)))  # tiny window
@example(case=Case(sq=127, sk=300, d=256, dtype=torch.float32, causal=True))
@example(case=Case(sq=300, sk=300, d=256, causal=True, window=(100, -1), softcap=30.0))
@example(case=Case(b=2, hq=4, hkv=1, sq=129, sk=300, d=128))                 # MQA
@example(case=Case(hq=6, hkv=2, sq=300, sk=300, d=160, dtype=torch.float16, sinks=True,
                   window=(-1, 7)))
@example(case=Case(sq=300, sk=300, d=32, causal=True, cu_seqlens=(0, 1, 1, 128, 129, 300)))
@example(case=Case(sq=200, sk=200, d=16, dtype=torch.float32, window=(3, 0), sinks=True,
                   cu_seqlens=(0, 60, 200), scale=-0.7, softcap=5.0))
@example(case=Case(hq=36, hkv=1, sq=40, sk=70, d=256, dtype=torch.float32, causal=True,
                   sinks=True))                                              # 3 GQA passes
@example(case=Case(sq=200, sk=1100, d=64, causal=True))           # section of 3 tiles, last 76 keys
@example(case=Case(sq=130, sk=2600, d=32, dtype=torch.float32, window=(700, 100)))  # skips, fp32
@example(case=Case(hq=2, hkv=2, sq=129, sk=2100, d=128, dtype=torch.float16, sinks=True))  # 4+1
def test_forward_parity(case):
    _assert_parity(case)


@pytest.fixture
def trn3():
    previous = simulator.get_target()
    simulator.set_target("trn3")
    yield
    simulator.set_target(previous)


@pytest.mark.parametrize("case", [
    Case(b=2, hq=4, hkv=2, sq=600, sk=1100, d=128, window=(300, 20)),
    Case(sq=300, sk=200, d=160, dtype=torch.float16, causal=True, sinks=True, softcap=30.0),
], ids=["window-gqa", "causal-sinks-softcap"])
def test_forward_parity_trn3(trn3, case):
    _assert_parity(case)


@pytest.mark.parametrize("case", [
    Case(b=2, hq=4, hkv=2, sq=600, sk=700, d=128, causal=True),              # unequal rows
    Case(sq=1, sk=5, d=8),                                                   # one group only
    Case(sq=300, sk=300, d=64, sinks=True, window=(40, 0), cu_seqlens=(0, 100, 300)),
], ids=["causal-gqa", "single-group", "packed-window-sinks"])
def test_forward_parity_lnc2(monkeypatch, case):
    """NEURON_LOGICAL_NC_CONFIG=2: two programs share the groups and write disjoint rows."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert _trace_of(case).grid == 2
    _assert_parity(case)


# --------------------------------------------------------------------------- structure


def _trace_of(case: Case):
    sample = case.sample()
    with backend.use_backend("simulator"), backend.strict(True), collect_runs() as runs:
        SPEC.op(*sample.args, **sample.kwargs)
    (_, report), = runs
    return report


def _unmasked_keys(case: Case):
    """Keys of the visible (query tile, key tile) pairs that are not partial (their cut width,
    as in :func:`_tile_pairs`)."""
    mask = masks.full_mask(case.sq, case.sk, causal=case.causal, window_left=case.window[0],
                           window_right=case.window[1], cu_seqlens=None, device="cpu")
    q_step, k_step = simulator.tile_size.pmax, tiles.key_tile_width()
    keys = 0
    for q0 in range(0, case.sq, q_step):
        for k0 in range(0, case.sk, k_step):
            block = mask[q0:q0 + q_step, k0:k0 + k_step]
            seen = [j for j in range(0, block.shape[1], q_step) if bool(block[:, j:j + q_step].any())]
            if seen and bool(block[:, seen[0]:seen[-1] + q_step].all()):
                keys += block[:, seen[0]:seen[-1] + q_step].shape[1]
    return keys


def _tile_pairs(case: Case):
    """(visible, partial, keys) of (query tile, key tile) pairs from the dense mask; a visible
    tile is first cut to its 128-key blocks that some query sees (the kernel's ``trim_plan``),
    it is partial when that cut tile still hides a key from some query, and ``keys`` sums the
    widths of the cut tiles."""
    mask = masks.full_mask(case.sq, case.sk, causal=case.causal, window_left=case.window[0],
                           window_right=case.window[1], cu_seqlens=None, device="cpu")
    q_step, k_step = simulator.tile_size.pmax, tiles.key_tile_width()
    b_step = simulator.tile_size.pmax
    visible = partial = keys = 0
    for q0 in range(0, case.sq, q_step):
        for k0 in range(0, case.sk, k_step):
            block = mask[q0:q0 + q_step, k0:k0 + k_step]
            if not bool(block.any()):
                continue
            seen = [j for j in range(0, block.shape[1], b_step)
                    if bool(block[:, j:j + b_step].any())]
            cut = block[:, seen[0]:seen[-1] + b_step]
            visible += 1
            partial += not bool(cut.all())
            keys += cut.shape[1]
    return visible, partial, keys


@pytest.mark.parametrize("case", [
    Case(sq=1024, sk=1024, d=64, causal=True),
    Case(sq=700, sk=1500, d=32, window=(200, 100)),
    Case(sq=300, sk=1100, d=16),
], ids=["causal", "window", "unmasked"])
def test_skips_invisible_tiles_and_masks_only_partial_tiles(case, monkeypatch):
    unmasked = []   # widths of the unmasked evictions (range_select with all-key bounds)
    evict = fwd_step.evict_unmasked

    def spy(s_tile, *args):
        unmasked.append(s_tile.shape[1])
        return evict(s_tile, *args)

    monkeypatch.setattr(fwd_step, "evict_unmasked", spy)
    report = _trace_of(case)
    opcodes = [e.opcode for e in report.trace]
    visible, partial, _ = _tile_pairs(case)
    assert opcodes.count("range_select") == partial * case.hq + len(unmasked)
    # unmasked tiles are evicted alone or merged with their unmasked neighbours into runs of up
    # to EVICT_RUN_TILES tiles: every unmasked key exactly once per head, no run too wide
    evicts = [e.shape[-1] for e in report.trace if e.opcode == "tensor_scalar_reduce"] + unmasked
    run_keys = fwd_step.EVICT_RUN_TILES * tiles.key_tile_width()
    assert sum(evicts) == _unmasked_keys(case) * case.hq
    assert max(evicts, default=0) <= run_keys
    assert (visible - partial) * case.hq / fwd_step.EVICT_RUN_TILES <= len(evicts)
    assert len(evicts) <= (visible - partial) * case.hq


@pytest.mark.parametrize("case", [
    Case(sq=1024, sk=1024, d=64, causal=True),
    Case(sq=700, sk=1500, d=32, window=(200, 100)),
], ids=["causal", "window"])
def test_scores_cover_only_key_blocks_some_query_sees(case):
    """QK^T matmuls (contraction K = D; P @ V contracts 128 or the Sk % 128 remainder) span
    exactly the visible tiles cut to their seen 128-key blocks."""
    report = _trace_of(case)
    qk_keys = sum(e.attrs["N"] for e in report.trace
                  if e.opcode == "nc_matmul" and e.attrs["K"] == case.d)
    assert qk_keys == _tile_pairs(case)[2] * case.hq


def _transposed_loads(report, rows, d):
    """Loads of (d, rows) transposed tiles: DMA transposes of natural (rows, d) HBM rows (2-byte
    dtypes) or contiguous rows of a host-transposed (d, rows) layout."""
    return [e for e in report.trace if e.reads and e.reads[0].memory.endswith("hbm")
            and ((e.opcode == "dma_transpose" and e.reads[0].shape == (rows, d))
                 or (e.opcode == "dma_copy" and e.reads[0].shape == (d, rows)))]


def test_qk_transposed_on_chip():
    """bf16 with D <= 128: q^T and k^T come from DMA transposes of the natural rows, so the launcher
    makes no host-side copy; fp32 keeps the host transposes."""
    from nki_lib.bench.whole_op import record_host_ops
    for dtype, on_chip in ((torch.bfloat16, True), (torch.float32, False)):
        case = Case(sq=200, sk=300, d=64, dtype=dtype, causal=True)
        sample = case.sample()
        with record_host_ops() as host_ops, backend.use_backend("simulator"), backend.strict(True), \
                collect_runs() as runs:
            SPEC.op(*sample.args, **sample.kwargs)
        opcodes = {e.opcode for e in runs[-1][1].trace}
        assert ("dma_transpose" in opcodes) == on_chip
        assert (len(host_ops) == 0) == on_chip


def test_keys_loaded_once_per_kv_head():
    """K^T of a kv head is loaded once (one aligned span here) and shared by its query tiles."""
    case = Case(b=2, hq=2, hkv=1, sq=384, sk=600, d=64)
    report = _trace_of(case)
    key_loads = _transposed_loads(report, case.sk, case.d)
    assert len(key_loads) == case.b * case.hkv


def _value_bytes(report, case):
    """HBM -> SBUF bytes of the V loads (destination tiles hold keys on partitions, D columns)."""
    return sum(e.bytes for e in report.trace
               if e.opcode == "dma_copy" and e.reads[0].memory.endswith("hbm")
               and e.writes[0].memory == "sbuf" and e.writes[0].shape[-1] == case.d
               and e.writes[0].shape[0] <= simulator.tile_size.pmax and len(e.writes[0].shape) >= 2
               and e.writes[0].shape != (case.d, case.sq))


@pytest.mark.parametrize("case", [
    Case(b=2, hkv=2, hq=2, sq=1024, sk=1024, d=64, causal=True),   # natural blocks (diagonals first)
    Case(sq=384, sk=1100, d=64),                                   # interleaved runs + natural tail
], ids=["causal", "unmasked"])
def test_values_loaded_once_per_kv_head(case):
    """V of a kv head that fits the cache is read from HBM once, whatever its query tiles see."""
    report = _trace_of(case)
    assert _value_bytes(report, case) == case.b * case.hkv * case.sk * case.d * 2


@pytest.mark.parametrize("case", [
    Case(sq=600, sk=700, d=64, causal=True),
    Case(hq=4, hkv=2, sq=300, sk=1100, d=32, window=(300, 100), sinks=True),
], ids=["causal", "window-gqa-sinks"])
def test_streamed_values_parity(monkeypatch, case):
    """V streamed per section (the kv head's V over its SBUF share): same parity."""
    monkeypatch.setattr(flash_attention_fwd, "cache_bytes", lambda *a: 1 << 40)
    report = _trace_of(case)
    assert _value_bytes(report, case) > case.b * case.hkv * case.sk * case.d * 2
    _assert_parity(case)


def _pt_blocks(report, case):
    """(P^T blocks by TensorE transposes, by SBUF -> SBUF DMA transposes, P @ V matmuls)."""
    pmax = simulator.tile_size.pmax
    on_chip = [e for e in report.trace if e.opcode == "dma_transpose" and e.reads[0].memory == "sbuf"]
    pe = sum(1 for e in report.trace if e.opcode == "nc_transpose" and e.engine == "tensor"
             and e.reads[0].shape == (pmax, pmax))
    pv = sum(1 for e in report.trace if e.opcode == "nc_matmul" and e.attrs["K"] == pmax
             and e.attrs["N"] == case.d)
    return pe, sum(e.writes[0].shape[2] for e in on_chip), pv


def test_long_sections_transpose_p_by_dma():
    """Causal bf16 rows whose section has at least DMA_PT_MIN_BLOCKS blocks: the steps
    ``dma_transposed_steps`` picks get the P^T of their natural V blocks from one SBUF -> SBUF DMA
    transpose each, in place of TensorE transposes and PSUM evictions; same parity."""
    case = Case(hq=1, sq=2048, sk=2048, d=64, causal=True)
    report = _trace_of(case)
    pmax = simulator.tile_size.pmax
    on_chip = [e for e in report.trace if e.opcode == "dma_transpose" and e.reads[0].memory == "sbuf"]
    assert len(on_chip) >= 1
    for e in on_chip:
        rows, _, blocks, cols = e.writes[0].shape
        assert (rows, cols) == (pmax, pmax) and blocks >= 1
    pe_blocks, dma_blocks, pv_blocks = _pt_blocks(report, case)
    assert dma_blocks > 0 and pe_blocks + dma_blocks == pv_blocks    # one path per block
    _assert_parity(case)


@pytest.mark.parametrize("case", [
    Case(hq=1, sq=4096, sk=4096, d=32, causal=True),
    Case(hq=1, sq=4608, sk=4608, d=32, dtype=torch.float16, causal=True),
], ids=["four-runs", "part-run"])
def test_first_run_padded_for_short_causal_rows(case):
    """One head per pass, no softcap, at least PADDED_RUN_MIN_RUNS V runs (1024-key runs):
    the short causal rows use the kv head's first V run interleaved (one long DMA row per
    partition) with P zero-padded to the run end, so their P^T blocks outnumber the visible ones;
    V is still read once; same parity. With softcap the rows keep natural blocks (exactly the
    visible blocks)."""
    report = _trace_of(case)
    pe_blocks, dma_blocks, pv_blocks = _pt_blocks(report, case)
    visible_blocks = _tile_pairs(case)[2] // simulator.tile_size.pmax
    assert pe_blocks + dma_blocks == pv_blocks > visible_blocks * case.hq
    assert _value_bytes(report, case) == case.b * case.hkv * case.sk * case.d * 2
    _assert_parity(case)
    capped = Case(hq=case.hq, hkv=case.hkv, sq=case.sq, sk=case.sk, d=case.d, dtype=case.dtype,
                  causal=True, softcap=30.0)
    pe_blocks, dma_blocks, pv_blocks = _pt_blocks(_trace_of(capped), capped)
    assert pv_blocks == pe_blocks + dma_blocks == visible_blocks * case.hq


def test_few_runs_keep_natural_blocks():
    """Under PADDED_RUN_MIN_RUNS runs (bf16 S = 1024: one run) the padding would cost more than it
    saves, so every P^T block is a visible one."""
    case = Case(hq=1, sq=1024, sk=1024, d=64, causal=True)
    pe_blocks, dma_blocks, pv_blocks = _pt_blocks(_trace_of(case), case)
    assert pe_blocks + dma_blocks == pv_blocks == _tile_pairs(case)[2] // simulator.tile_size.pmax


def test_gqa_loads_each_kv_tile_once_per_group():
    case = Case(hq=4, hkv=1, sq=128, sk=512, d=64)
    report = _trace_of(case)
    key_loads = _transposed_loads(report, case.sk, case.d)
    query_loads = _transposed_loads(report, case.sq, case.d)
    assert len(key_loads) == 1
    assert len(query_loads) == case.hq


def test_unsupported_lengths_raise_before_launch():
    q = torch.empty(1, 1, 1 << 23, 1, dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match="2\\*\\*24"):
        flash_attention_fwd.launch_flash_attention_fwd(q, q, q, None, None, causal=False, scale=1.0, window_left=-1,
                      window_right=-1, softcap=0.0)


@pytest.mark.slow
def test_working_set_is_bounded_at_16k():
    """Sq = Sk = 16384, D = 128: passes the simulator's SBUF/PSUM capacity checks (recording off);
    the last query rows match the fp64 oracle (computed on those rows only)."""
    s, d, rows = 16384, 128, 128
    case = Case(hq=1, hkv=1, sq=s, sk=s, d=d, causal=True)
    q, k, v, _, _ = case.sample().args
    with (backend.use_backend("simulator"), backend.strict(True), simulator.recording(False),
          collect_runs() as runs):
        out, lse = SPEC.op(q, k, v, causal=True)
    (_, report), = runs
    assert report.trace is None
    assert report.peak_psum_banks <= simulator.tile_size.psum_num_banks
    assert report.peak_sbuf_bytes <= simulator.tile_size.sbuf_fmax_bytes
    tail = (q[:, :, -rows:], k, v)
    oracle = flash_attention_reference.naive(*(t.double() for t in tail), causal=True)
    baseline = flash_attention_reference.naive(*tail, causal=True)
    for name, got, want, base in zip(("out", "lse"), (out, lse), oracle, baseline):
        check = parity(got[:, :, -rows:], want, base, kind="output", dtype=q.dtype, name=name)
        assert check.ok, str(check)
    assert math.isfinite(float(out.float().abs().max()))
