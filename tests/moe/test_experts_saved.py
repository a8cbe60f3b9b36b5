"""moe_experts training forward / backward with saved activations: a call that needs gradients
runs ``nki::moe_experts_train``, whose forward kernel also writes the pre-activation g and u
(``moe_experts_fwd.saved_shape``), and the backward kernel reads them instead of recomputing;
inference saves nothing; the recompute path stays served (and tested) where saving is off. Each
test asserts, from the kernel traces, which path ran, and judges parity against the fp64 oracle
(``nki_lib.numerics``) or bitwise equality."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nki_lib
import nki_lib.moe  # noqa: F401  (registers the ops)
from nki_lib.dispatch import collect_runs
from nki_lib.moe import moe_experts_op
from nki_lib.moe.kernels import (
    moe_experts_bwd_blocks,
    moe_experts_bwd_rows,
    moe_experts_fwd_dmas,
    moe_experts_fwd_launch,
)
from nki_lib.numerics.oppar import op_parity


def _sources(fn):
    """The "file.py:LINE" trace sources of a function's lines."""
    lines, first = inspect.getsourcelines(fn)
    name = inspect.getsourcefile(fn).rsplit("/", 1)[-1]
    return {f"{name}:{n}" for n in range(first, first + len(lines))}


def _ran(report, fn, opcode):
    return any(e.opcode == opcode and e.source in _sources(fn) for e in report.trace)


def _traces(s):
    """(forward report, backward report) of one strict simulator call with gradients, and parity."""
    with collect_runs() as runs:
        result = op_parity(moe_experts_op.SPEC, s)
    assert result.ok, str(result)
    assert len(runs) == 2, [op for op, _ in runs]
    return runs[0][1], runs[1][1]


def _saved_path_ran(fwd, bwd):
    return (_ran(fwd, moe_experts_fwd_dmas.store_saved, "dma_copy") and _ran(bwd, moe_experts_bwd_rows.load_saved,
                                                                         "dma_copy")
            and _ran(bwd, moe_experts_bwd_blocks._saved_gu, "nc_transpose"))


def sample(t, h, inter, e, k, block, dtype, activation="silu", **kw):
    return moe_experts_op.make_sample(t, h, inter, e, k, block, dtype, True, activation=activation, **kw)


def test_training_call_saves_and_backward_reads():
    for s in (sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "gelu"),
              sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5,
                     weight_layout="in_out"),
              sample(12, 40, 24, 3, 3, 300, torch.float16, "gelu_tanh"),
              sample(16, 64, 40, 2, 2, 64, torch.float32)):
        fwd, bwd = _traces(s)
        assert _saved_path_ran(fwd, bwd), s.label


def test_recompute_path_when_nothing_is_saved(monkeypatch):
    """saved_grouping None (as for a call the forward kernel cannot serve while saving): the
    forward saves nothing and the backward recomputes g and u, with parity."""
    monkeypatch.setattr(moe_experts_op, "saved_grouping", lambda *a, **k: None)
    s = sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5)
    fwd, bwd = _traces(s)
    assert not _ran(fwd, moe_experts_fwd_dmas.store_saved, "dma_copy")
    assert not _ran(bwd, moe_experts_bwd_rows.load_saved, "dma_copy")
    assert not _ran(bwd, moe_experts_bwd_blocks._saved_gu, "nc_transpose")


def test_forward_saves_only_what_the_backward_reads(monkeypatch):
    """The training forward saves g/u only where the backward's launch would read them at the
    forward's groups (``moe_experts_bwd.reads_saved``); where it would recompute them, nothing is
    saved (and the backward recomputes, with parity)."""
    from nki_lib.moe.kernels import moe_experts_bwd
    monkeypatch.setattr(moe_experts_bwd, "_saved_blocks", lambda *a, **k: None)
    s = sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "gelu")
    assert moe_experts_op.saved_grouping(s.args + (None, None), dict(activation="gelu", weight_layout="out_in")) is None
    fwd, bwd = _traces(s)
    assert not _ran(fwd, moe_experts_fwd_dmas.store_saved, "dma_copy")
    assert not _ran(bwd, moe_experts_bwd_rows.load_saved, "dma_copy")


def test_forward_asks_the_backward_estimate_of_its_own_layout(monkeypatch):
    """The training forward's save decision uses the backward's SBUF estimate for the call's
    weight layout (in_out stages the weights' transposes, so its estimate differs from out_in's)."""
    from nki_lib.dispatch import Unsupported
    from nki_lib.moe.kernels import moe_experts_bwd
    seen = []

    def record(*args, **counts):
        seen.append(counts["in_out"])
        return None

    monkeypatch.setattr(moe_experts_bwd, "_saved_blocks", record)
    for layout in ("out_in", "in_out"):
        s = moe_experts_op.make_sample(30, 200, 136, 4, 2, 130, torch.bfloat16, False, weight_layout=layout)
        with pytest.raises(Unsupported, match="recompute"):
            moe_experts_fwd_launch.saved_grouping(*s.args, activation="silu", weight_layout=layout)
    assert seen == [False, True]


def test_deepseek_expert_parallel_forward_saves_nothing():
    """At deepseek-v3's expert-parallel shape (T=2560 rows, H=7168, I=2048, 16 local experts, k=1)
    the backward's SBUF estimate does not fit saved g/u at the forward's groups, so the training
    forward does not save them (meta tensors: a launch decision, no data read)."""

    from nki_lib.bench.inputs import _plan
    from nki_lib.dispatch import Unsupported

    t, h, i, e, k = 2560, 7168, 2048, 16, 1
    meta = dict(dtype=torch.bfloat16, device="meta")
    block_expert, slots, _ = _plan((torch.arange(t * k, dtype=torch.int32) % e).reshape(t, k), e, 128)
    args = (torch.empty(t, h, **meta), torch.full((t, k), 1.0), block_expert, slots,
            torch.empty(e, 2 * i, h, **meta), torch.empty(e, h, i, **meta))
    with pytest.raises(Unsupported, match="recompute"):
        moe_experts_fwd_launch.saved_grouping(*args, activation="silu")


def test_inference_saves_nothing():
    s = sample(20, 64, 40, 3, 2, 16, torch.bfloat16)
    args = [a.detach() for a in s.args]
    for grad in (False, True):
        leaves = [a.clone().requires_grad_(grad and a.is_floating_point()) for a in args]
        with nki_lib.use_backend("simulator"), nki_lib.strict(True), collect_runs() as runs, torch.no_grad():
            torch.ops.nki.moe_experts(*leaves, **s.kwargs)
        (_, fwd), = runs
        assert not _ran(fwd, moe_experts_fwd_dmas.store_saved, "dma_copy")


def test_first_slot_tile_of_a_group_is_padding():
    """A valid expert's first block holds only padding, its second the assignments: the group's
    first slot tile (always computed by the backward) was not written by the forward, so its
    saved g/u are zeroed, not read."""
    s = sample(20, 24, 16, 1, 1, 128, torch.float32, topk_ids=torch.zeros(20, 1, dtype=torch.int64))
    args = list(s.args)
    slots = torch.full((2 * 128,), -1, dtype=args[3].dtype)
    slots[128:148] = torch.arange(20)
    args[2], args[3] = torch.zeros(2, dtype=args[2].dtype), slots
    fwd, bwd = _traces(type(s)(tuple(args), s.kwargs, s.label + " first tile padding"))
    assert _saved_path_ran(fwd, bwd)


def test_padding_tile_inside_a_group_with_saved():
    s = sample(20, 24, 16, 1, 1, 256, torch.float32, topk_ids=torch.zeros(20, 1, dtype=torch.int64))
    args = list(s.args)
    slots = torch.full((2 * 256,), -1, dtype=args[3].dtype)
    slots[:10], slots[256:266] = torch.arange(10), torch.arange(10, 20)   # tile 1 of block 0: padding
    args[2], args[3] = torch.zeros(2, dtype=args[2].dtype), slots
    fwd, bwd = _traces(type(s)(tuple(args), s.kwargs, s.label + " padding tile inside a group"))
    assert _saved_path_ran(fwd, bwd)


def _down_rows_stored(bwd, inter):
    from nki_lib.moe.kernels import moe_experts_bwd_accum
    sources = _sources(moe_experts_bwd_accum._store) | _sources(moe_experts_bwd_accum._add_store)
    return any(e.opcode == "dma_copy" and e.source in sources and e.shape[-1] == inter for e in bwd.trace)


def test_down_gradient_in_whole_rows_of_i():
    """I > one I chunk: dW_down is contracted after the last chunk and stored in whole rows of I
    (the h of every chunk kept), in every accumulation mode (an expert over several groups: the
    fp32 accumulators), with the saved g/u and without them, with parity."""
    for s in (sample(5, 8, 2 * 256 + 40, 2, 1, 8, torch.float32, "gelu"),
              sample(13, 24, 2 * 256 + 40, 3, 2, 4, torch.bfloat16, topk_ids=torch.tensor([[1, 0]] * 13))):
        fwd, bwd = _traces(s)
        assert _saved_path_ran(fwd, bwd) and _down_rows_stored(bwd, 2 * 256 + 40), s.label


def test_down_gradient_rows_across_groups(monkeypatch):
    """Groups of one block each (the first / middle / last modes) with dW_down in whole rows."""
    from nki_lib.moe.kernels import moe_experts_bwd
    monkeypatch.setattr(moe_experts_op, "saved_grouping", lambda *a, **k: None)
    monkeypatch.setattr(moe_experts_bwd, "group_blocks", lambda *a, **k: 1)
    s = sample(13, 24, 2 * 256 + 40, 3, 2, 4, torch.bfloat16, topk_ids=torch.tensor([[1, 0]] * 13))
    _, bwd = _traces(s)
    assert _down_rows_stored(bwd, 2 * 256 + 40)


def _spy_group_down(monkeypatch):
    """Counts the calls of ``load_group_down`` (W_down loaded whole per group) in the kernel."""
    from nki_lib.moe.kernels import moe_experts_bwd
    calls = []
    real = moe_experts_bwd_blocks.load_group_down

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(moe_experts_bwd_blocks, "load_group_down", spy)
    monkeypatch.setattr(moe_experts_bwd, "load_group_down", spy)
    return calls


def test_down_weights_loaded_once_per_group(monkeypatch):
    """W_down loaded whole once per group (the next group's by the last I chunk's prefetch), over
    several groups and experts, several I chunks, with the saved g/u and without them (the
    recompute's W_gate^T/W_up^T columns still per chunk), with parity."""
    from nki_lib.moe.kernels import moe_experts_bwd
    calls = _spy_group_down(monkeypatch)
    for s in (sample(13, 24, 2 * 256 + 40, 3, 2, 4, torch.bfloat16, topk_ids=torch.tensor([[1, 0]] * 13)),
              sample(30, 200, 136, 4, 2, 130, torch.bfloat16, "gelu_tanh")):
        calls.clear()
        _traces(s)
        assert len(calls) > 1, s.label          # the first group's, then one per following group
    monkeypatch.setattr(moe_experts_op, "saved_grouping", lambda *a, **k: None)   # recompute, groups of one block
    monkeypatch.setattr(moe_experts_bwd, "group_blocks", lambda *a, **k: 1)
    calls.clear()
    _traces(sample(13, 24, 2 * 256 + 40, 3, 2, 4, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5,
                   topk_ids=torch.tensor([[1, 0]] * 13)))
    assert len(calls) > 1


def test_down_weights_per_chunk_when_the_group_does_not_fit(monkeypatch):
    """Where the SBUF estimate has no room for a whole W_down per group, its columns are loaded
    per I chunk (as before), with parity."""
    from nki_lib.moe.kernels import moe_experts_bwd
    calls = _spy_group_down(monkeypatch)
    real = moe_experts_bwd.sbuf_bytes_at
    monkeypatch.setattr(moe_experts_bwd, "sbuf_bytes_at",
                        lambda *a, down_group=False, **k: 1 << 40 if down_group else real(*a, **k))
    _traces(sample(13, 24, 2 * 256 + 40, 3, 2, 4, torch.bfloat16, topk_ids=torch.tensor([[1, 0]] * 13)))
    assert not calls


def _interleaved_down(bwd, inter, itemsize):
    """(W_down loaded DOWN_INTERLEAVE rows of H per partition, dW_down stored 2 rows per partition)."""
    from nki_lib.moe.kernels import moe_experts_bwd_accum, moe_experts_steps
    m = moe_experts_bwd_blocks.DOWN_INTERLEAVE
    loads = _sources(moe_experts_steps.load_expert_cols)
    stores = _sources(moe_experts_bwd_accum._store) | _sources(moe_experts_bwd_accum._add_store)
    return (any(e.opcode == "dma_copy" and e.source in loads and e.attrs.get("contiguous_bytes") == m * inter * itemsize
                for e in bwd.trace),
            any(e.opcode == "dma_copy" and e.source in stores and e.shape[-1] == 2 * inter for e in bwd.trace))


def test_down_weights_and_gradient_rows_interleaved(monkeypatch):
    """H of 4 full 128-row tiles and a partial one, I of two chunks of one PSUM bank each: the
    group's W_down loaded DOWN_INTERLEAVE rows of H per partition (one run per partition), dyT and
    the b_down column in that order, and dW_down stored 2 rows per partition, in the only mode,
    then with groups of one block (first / middle / last modes, the fp32 accumulators), with
    biases, with parity."""
    from nki_lib.moe.kernels import moe_experts_bwd
    inter = 2 * 256 + 40
    s = sample(13, 4 * 128 + 8, inter, 3, 2, 4, torch.bfloat16, topk_ids=torch.tensor([[1, 0]] * 13))
    _, bwd = _traces(s)
    assert _interleaved_down(bwd, inter, 2) == (True, True)
    monkeypatch.setattr(moe_experts_op, "saved_grouping", lambda *a, **k: None)
    monkeypatch.setattr(moe_experts_bwd, "group_blocks", lambda *a, **k: 1)
    s = sample(13, 4 * 128 + 8, inter, 3, 2, 4, torch.bfloat16, "clamped_swiglu", biases=True, swiglu_limit=0.5,
               topk_ids=torch.tensor([[1, 0]] * 13))
    _, bwd = _traces(s)
    assert _interleaved_down(bwd, inter, 2) == (True, True)


def _chunk_width(bwd):
    """The backward's I chunk, from the trace: the widest g/u/dhy PSUM result of a slot tile."""
    return max(e.shape[-1] for e in bwd.trace
               if e.opcode == "nc_matmul" and e.source in _sources(moe_experts_bwd_blocks._slot_tile_grads))


def test_down_rows_psum_at_narrow_chunks():
    """The smallest natural shape found whose backward picks 128-column I chunks at I = 1536 (fp32,
    H = 3072): dW_down in whole rows of I would hold 12 PSUM banks (one per chunk) of the 8 there
    are (the simulator rejected it: "PSUM capacity exceeded: 9 banks"), so the launcher keeps it
    per chunk; the kernel runs with parity (strict, no fallback)."""
    from nki_lib.moe.kernels import moe_experts_bwd
    s = sample(4, 3072, 1536, 1, 1, 32, torch.float32, topk_ids=torch.zeros(4, 1, dtype=torch.int64))
    _, bwd = _traces(s)
    assert _chunk_width(bwd) == 128 and not moe_experts_bwd.down_rows_fit(1536, 128)
    assert not _down_rows_stored(bwd, 1536)


def _expected_down_rows(inter, i_chunk):
    """Independent of the helpers: whole rows of I hold one PSUM bank per chunk (each <= 512
    fp32 columns), at most 4 banks of SBUF row (I <= 2048), and PSUM has 8 banks."""
    chunks = -(-inter // i_chunk)
    return 1 < chunks <= 8 and inter <= 4 * 512


@settings(max_examples=4)   # each example is a forward and a backward simulator launch
@given(inter=st.sampled_from([1536, 2048, 2560]), i_chunk=st.sampled_from([128, 256, 384, 512]),
       saved=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(inter=2048, i_chunk=128, saved=True, dtype=torch.bfloat16)     # h16m's case: 16 banks
@example(inter=2048, i_chunk=256, saved=True, dtype=torch.bfloat16)     # 8 banks: all of PSUM, whole rows
@example(inter=2048, i_chunk=384, saved=False, dtype=torch.float32)     # 6 banks (5 x 384 + 128)
@example(inter=1536, i_chunk=128, saved=False, dtype=torch.float32)     # 12 banks: per chunk
@example(inter=1536, i_chunk=256, saved=True, dtype=torch.float32)      # 6 banks: whole rows
@example(inter=2560, i_chunk=512, saved=True, dtype=torch.bfloat16)     # I > 4 banks of row: per chunk
def test_down_rows_only_where_psum_fits(inter, i_chunk, saved, dtype):
    """At I near the whole-row edge, with the I chunk forced (small H): dW_down in whole rows of I
    runs only where its PSUM banks fit (and the launcher's SBUF estimate with them), else per
    chunk; saved and recomputed g/u; parity either way, and the trace shows which path ran."""
    from nki_lib.moe.kernels import moe_experts_bwd
    real_tiling, real_sbuf = moe_experts_bwd.tiling, moe_experts_bwd.sbuf_bytes_at
    sbuf_rows = []          # the launcher's SBUF verdicts on whole rows (asked only where PSUM fits)

    def sbuf_spy(*a, **k):
        out = real_sbuf(*a, **k)
        if k.get("down_rows") and not k.get("down_group"):
            sbuf_rows.append(out <= nki_lib.simulator.tile_size.total_available_sbuf_size)
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_experts_bwd, "tiling", lambda *a, **k: (i_chunk,) + tuple(real_tiling(*a, **k)[1:]))
        mp.setattr(moe_experts_bwd, "sbuf_bytes_at", sbuf_spy)
        if not saved:
            mp.setattr(moe_experts_op, "saved_grouping", lambda *a, **k: None)
        s = sample(6, 24, inter, 2, 1, 8, dtype, topk_ids=torch.tensor([[1]] * 3 + [[0]] * 3))
        fwd, bwd = _traces(s)
    forward_saved = _ran(fwd, moe_experts_fwd_dmas.store_saved, "dma_copy")
    assert forward_saved <= saved and _saved_path_ran(fwd, bwd) == forward_saved, s.label
    assert _chunk_width(bwd) == i_chunk, s.label                                 # the forced chunk ran
    psum_fits = _expected_down_rows(inter, i_chunk)
    assert psum_fits == bool(sbuf_rows), (s.label, sbuf_rows)
    assert _down_rows_stored(bwd, inter) == (psum_fits and sbuf_rows[-1]), s.label
