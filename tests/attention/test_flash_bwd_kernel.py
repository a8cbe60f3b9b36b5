"""The flash-attention backward NKI kernel on the simulator (strict mode, no fallback).

Gradient parity runs the registered op forward and backward on the simulator through
``op_parity`` (q, k, v, sinks gradients, with the loss using both ``out`` and ``lse``), judged
against the fp64 oracle with the tolerances of ``nki_lib.numerics``; the kernel alone (fed the
reference forward) against the fp64 reference backward. Plus bitwise determinism (repeat, and
LNC1 vs LNC2), whole-tile skipping, the DMA-transposed dS^T couples, the ``Unsupported`` reason
of the launcher, and two slow cases: the Sq = Sk = 16384 capacity case and a windowed
Sq = Sk = 16500 sequence.
"""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib
from nki_lib import registry, simulator
from nki_lib.attention import flash_attention_reference
from nki_lib.attention.kernels import flash_attention_bwd
from nki_lib.dispatch import Unsupported, collect_runs
from nki_lib.numerics import parity
from nki_lib.numerics.oppar import op_parity
from nki_lib.registry import Sample

SPEC = registry.get("flash_attention")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_sample(b, hq, hkv, sq, sk, d, dtype, *, causal=False, window=(-1, -1), softcap=0.0,
                sinks=False, cu_seqlens=None, scale=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).requires_grad_(True)  # noqa: E731
    sinks_t = torch.randn(hq, generator=gen).requires_grad_(True) if sinks else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    kwargs = dict(causal=causal, scale=scale, window_left=window[0], window_right=window[1], softcap=softcap)
    label = f"b{b} hq{hq} hkv{hkv} sq{sq} sk{sk} d{d} {dtype} {kwargs} sinks={sinks} cu={cu_seqlens}"
    return Sample((rand(b, hq, sq, d), rand(b, hkv, sk, d), rand(b, hkv, sk, d), sinks_t, cu), kwargs, label)


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    sq = draw(st.integers(1, 200))
    sk = draw(st.integers(1, 200))
    packed = b == 1 and draw(st.booleans())
    cu = None
    if packed:
        sk = sq
        cuts = sorted(draw(st.lists(st.integers(0, sq), max_size=3)))
        cu = [0, *cuts, sq]
    window = draw(st.sampled_from([(-1, -1), (-1, 0), (16, -1), (7, 5), (0, 0)]))
    return dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=draw(st.sampled_from([1, 8, 32, 64, 128, 160])),
                dtype=draw(st.sampled_from(sorted(DTYPES))), causal=draw(st.booleans()), window=window,
                softcap=draw(st.sampled_from([0.0, 0.0, 5.0])), sinks=draw(st.booleans()), cu_seqlens=cu)


def _check(problem):
    problem = dict(problem, dtype=DTYPES[problem["dtype"]])
    result = op_parity(SPEC, make_sample(**problem))
    assert result.ok, str(result)
    assert len([c for c in result.checks if c.name.startswith("grad")]) == 3 + problem.get("sinks", False)


EDGE = dict(b=1, hq=2, hkv=2, d=16, dtype="fp32", causal=False, window=(-1, -1), softcap=0.0, sinks=False,
            cu_seqlens=None)


@given(problems())
@example(dict(EDGE, sq=130, sk=300, causal=True))                               # Sq != Sk, partial tiles
@example(dict(EDGE, sq=150, sk=40, causal=True, dtype="bf16"))                   # rows with no visible key
@example(dict(EDGE, sq=60, sk=20, window=(0, 0), sinks=True))                    # no key, but a sink
@example(dict(EDGE, sq=33, sk=33, d=1))                                          # D = 1
@example(dict(EDGE, sq=70, sk=90, d=256, dtype="bf16", causal=True))             # D = 256: two chunks
@example(dict(EDGE, sq=200, sk=300, d=160, dtype="bf16", causal=True))           # D > 128: natural K rows by DMA
@example(dict(EDGE, hq=4, hkv=1, sq=129, sk=129, dtype="bf16", window=(40, 8)))  # MQA, window
@example(dict(EDGE, hq=2, hkv=1, sq=700, sk=1500, d=32, window=(300, 200)))   # dQ chain over 3 key tiles,
                                                                               # 2 query groups, partial tile
@example(dict(EDGE, sq=150, sk=150, causal=True, cu_seqlens=[0, 3, 3, 129, 150], dtype="fp16",
              softcap=5.0, sinks=True))                                          # documents, empty one
def test_gradient_parity(problem):
    _check(problem)


def _backward(sample):
    q, k, v, sinks, cu = (t.detach() if isinstance(t, torch.Tensor) else t for t in sample.args)
    out, lse = flash_attention_reference.flash_attention(q, k, v, sinks, cu, **sample.kwargs)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    dlse = torch.where(torch.isfinite(lse), torch.randn(lse.shape, generator=gen), 0.0)
    args = (dout, dlse, q, k, v, out, lse, sinks, cu)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        return torch.ops.nki.flash_attention_backward(*args, **sample.kwargs), args


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _backward_at_lnc1_and_lnc2(monkeypatch, sample):
    """The backward of ``sample`` at LNC1, then at LNC2: ([grads1, grads2], args, the LNC2 run's
    (launch, trace) records)."""
    results = []
    for lnc in ("1", "2"):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        with collect_runs() as runs:
            grads, args = _backward(sample)
        results.append(grads)
    return results, args, runs


def test_bitwise_deterministic():
    sample = make_sample(1, 4, 2, 150, 700, 32, torch.bfloat16, causal=True, window=(300, -1), sinks=True)
    first, _ = _backward(sample)
    second, _ = _backward(sample)
    for a, b in zip(first, second):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("sinks", [False, True])
def test_absent_dlse_equals_zero_dlse(sinks):
    """dlse None (no gradient reaches lse: delta = rowsum(dO * O) without a zeros tensor) gives
    the bits of an all-zero dlse."""
    sample = make_sample(1, 2, 1, 150, 200, 32, torch.bfloat16, causal=True, sinks=sinks)
    grads, args = _backward(sample)
    zero = (args[0], torch.zeros_like(args[1]), *args[2:])
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        with_zeros = torch.ops.nki.flash_attention_backward(*zero, **sample.kwargs)
        absent = torch.ops.nki.flash_attention_backward(args[0], None, *args[2:], **sample.kwargs)
    for a, b in zip(with_zeros, absent):
        assert torch.equal(_bits(a), _bits(b))


def test_q_rows_on_chip_match_host_rows(monkeypatch):
    """Q rows made on chip (TensorE transposes of Q^T, cached groups) give the bits of the host's
    row-group copy of Q (``q_rows_on_chip`` forced off)."""
    sample = make_sample(1, 4, 2, 600, 520, 64, torch.bfloat16, causal=True, sinks=True)
    assert flash_attention_bwd.q_rows_on_chip(sample.args[0], sample.args[1])
    on_chip, _ = _backward(sample)
    monkeypatch.setattr(flash_attention_bwd, "q_rows_on_chip", lambda q, k: False)
    host, _ = _backward(sample)
    for a, b in zip(on_chip, host):
        assert torch.equal(_bits(a), _bits(b))


def _naive_grads(args, flags, dtype, wrt):
    """Plain PyTorch (``naive``) gradients in ``dtype`` of sum(out * dout) + sum(lse * dlse)."""
    dout, dlse, q, k, v, _, _, sinks, cu = args
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    if sinks is not None:
        sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        leaves.append(sinks.detach().to(sink_dtype).requires_grad_(True))
    out, lse = flash_attention_reference.naive(*leaves[:3], leaves[3] if sinks is not None else None, cu, **flags)
    loss = (out * dout.to(out.dtype)).sum() + torch.where(torch.isfinite(lse), lse * dlse.to(lse.dtype), 0).sum()
    return torch.autograd.grad(loss, [leaves[i] for i in wrt])


def test_kernel_alone_against_fp64_backward():
    """The backward kernel fed the reference forward's (out, lse), against the fp64 reference
    backward of the same inputs; the yardstick is plain bf16 PyTorch (naive fwd + autograd)."""
    sample = make_sample(1, 3, 1, 200, 260, 64, torch.bfloat16, causal=True, softcap=30.0, sinks=True)
    grads, args = _backward(sample)
    upcast = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    oracle = flash_attention_reference.flash_attention_backward(*upcast, **sample.kwargs)
    baseline = _naive_grads(args, sample.kwargs, torch.bfloat16, wrt=range(4))
    for name, g, o, base in zip(("dq", "dk", "dv", "dsinks"), grads, oracle, baseline):
        assert g.shape == o.shape and g.dtype == base.dtype, name
        result = parity(g, o, base, kind="grad", dtype=torch.bfloat16, name=name)
        assert result.ok, str(result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dma_transposed_ds_couples(dtype):
    """Interior pairs (every row of a 128-row query tile sees the whole 512-key tile) take dS^T
    from one SBUF -> SBUF DMA transpose per couple of neighbours (``DsCouple``) instead of TensorE
    transposes; at Sq = Sk = 1024 causal that is query tiles 4..7 on key tile 0 (two couples per
    head). Their gradients match the fp64 reference backward like every other pair's."""
    sample = make_sample(1, 2, 1, 1024, 1024, 32, dtype, causal=True)
    with collect_runs() as runs:
        grads, args = _backward(sample)
    trace = runs[-1][1].trace
    couples = [e for e in trace if e.opcode == "dma_transpose" and e.attrs.get("src_memory") == "sbuf"]
    assert len(couples) == 2 * 2
    upcast = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    oracle = flash_attention_reference.flash_attention_backward(*upcast, **sample.kwargs)
    baseline = _naive_grads(args, sample.kwargs, dtype, wrt=range(3))
    for name, g, o, base in zip(("dq", "dk", "dv"), grads, oracle, baseline):
        result = parity(g, o, base, kind="grad", dtype=dtype, name=name)
        assert result.ok, str(result)


def test_unsupported_before_launch():
    q = torch.randn(1, 1, 8, 4)
    stats = torch.zeros(1, 1, 8)
    with pytest.raises(Unsupported, match="scale <= 0"):
        flash_attention_bwd.launch_flash_attention_bwd(q, stats, q, q, q, q, stats, None, torch.zeros(1, 2, 8),
                      causal=True, scale=-0.5, window_left=-1, window_right=-1, softcap=0.0)


# SBUF bytes per partition the backward may use at Sq = 16384, D = 128 (flash_attention_bwd.py docstring: the
# software pipeline keeps a few query groups, key tiles and thirteen pairs with their couples in flight --
# plus 24 B of statistics per query tile, plus the fp32 dQ accumulators of the head, 4 * D B per
# query tile, which stay in SBUF at this size).
SBUF_BUDGET_BYTES = 44 * 1024 + (16384 // 128) * 128 * 4


@pytest.mark.slow
def test_capacity_16384_causal():
    """Sq = Sk = 16384, D = 128 fits SBUF/PSUM (the simulator checks every allocation); the
    last query tile's dq matches the fp64 oracle. Only those rows get the true forward (out,
    lse) -- cut out with the same bottom-right alignment -- the others get finite stand-ins."""
    s, d, rows = 16384, 128, 128
    flags = dict(causal=True, scale=None, window_left=-1, window_right=-1, softcap=0.0)
    gen = torch.Generator().manual_seed(0)
    q, k, v, out, dout = (torch.randn(1, 1, s, d, generator=gen).to(torch.bfloat16) for _ in range(5))
    lse = torch.full((1, 1, s), float(math.log(s)))
    dlse = torch.zeros_like(lse)
    out[:, :, -rows:], lse[:, :, -rows:] = flash_attention_reference.flash_attention(q[:, :, -rows:], k, v, **flags)
    with simulator.recording(False), collect_runs() as runs, nki_lib.use_backend("simulator"), nki_lib.strict(True):
        dq, dk, dv, _ = torch.ops.nki.flash_attention_backward(dout, dlse, q, k, v, out, lse, **flags)
    report = runs[-1][1]
    assert report.peak_psum_banks <= nki_lib.simulator.tile_size.psum_num_banks
    assert report.peak_sbuf_bytes <= SBUF_BUDGET_BYTES
    assert all(bool(torch.isfinite(t.float()).all()) for t in (dq, dk, dv))

    tail = (dout[:, :, -rows:], dlse[:, :, -rows:], q[:, :, -rows:], k, v, None, None, None, None)
    oracle, = _naive_grads(tail, flags, torch.float64, wrt=[0])
    baseline, = _naive_grads(tail, flags, torch.bfloat16, wrt=[0])
    result = parity(dq[:, :, -rows:], oracle, baseline, kind="grad", dtype=torch.bfloat16, name="dq[-128:]")
    assert result.ok, str(result)


@pytest.mark.slow
def test_long_windowed_sequence():
    """Sq = Sk = 16500: more than pmax query tiles (phase 0 turns the statistics around in two
    chunks) and a partial last tile, with a causal sliding window. Checked: dq of the last m rows
    and dk/dv of the last m keys, against the fp64 reference backward on the sub-problem (last m
    queries, last m + w keys, same bottom-right alignment) that holds every pair they depend on;
    only those rows get the true forward (out, lse)."""
    s, d, w, m = 16500, 16, 64, 200
    flags = dict(causal=True, scale=None, window_left=w, window_right=-1, softcap=0.0)
    gen = torch.Generator().manual_seed(0)
    q, k, v, out, dout = (torch.randn(1, 1, s, d, generator=gen) for _ in range(5))
    lse = torch.full((1, 1, s), float(math.log(w)))
    dlse = torch.randn(1, 1, s, generator=gen)
    rows, keys = slice(s - m, s), slice(s - m - w, s)
    out[:, :, rows], lse[:, :, rows] = flash_attention_reference.flash_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], **flags)
    with simulator.recording(False), nki_lib.use_backend("simulator"), nki_lib.strict(True):
        dq, dk, dv, _ = torch.ops.nki.flash_attention_backward(dout, dlse, q, k, v, out, lse, **flags)

    sub = (dout[:, :, rows], dlse[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
           lse[:, :, rows])
    oracle = flash_attention_reference.flash_attention_backward(*(t.double() for t in sub), **flags)
    baseline = flash_attention_reference.flash_attention_backward(*sub, **flags)
    for name, got, i in (("dq", dq[:, :, rows], 0), ("dk", dk[:, :, rows], 1), ("dv", dv[:, :, rows], 2)):
        cut = slice(None) if i == 0 else slice(w, None)
        result = parity(got, oracle[i][:, :, cut], baseline[i][:, :, cut], kind="grad", dtype=torch.float32,
                        name=name)
        assert result.ok, str(result)


def _matmuls(**flags):
    sample = make_sample(1, 1, 1, 1024, 1024, 32, torch.bfloat16, **flags)
    with collect_runs() as runs:
        _backward(sample)
    return sum(1 for e in runs[-1][1].trace if e.opcode == "nc_matmul")


def test_whole_tile_skipping():
    """Causal and windowed runs skip invisible (query tile, key tile) pairs and 128-key blocks."""
    full = _matmuls()
    assert _matmuls(causal=True) < 0.6 * full
    assert _matmuls(causal=True, window=(128, -1)) < 0.3 * full


def test_lnc2_matches_lnc1(monkeypatch):
    """Under LNC2 the programs split the kv heads; the result is bitwise that of LNC1."""
    sample = make_sample(1, 4, 2, 150, 300, 32, torch.bfloat16, causal=True, sinks=True)
    results = []
    for lnc in ("1", "2"):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        with collect_runs() as runs:
            grads, _ = _backward(sample)
        assert runs[-1][1].grid == int(lnc)
        results.append(grads)
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))


def test_lnc2_splits_the_batch(monkeypatch):
    """One kv head, B = 2: under LNC2 each core takes one batch (neither idles); dq, dk, dv are
    bitwise those of LNC1, and dsinks (one row of partial sums per core, added by the launcher)
    passes parity against the fp64 oracle."""
    sample = make_sample(2, 2, 1, 150, 300, 32, torch.bfloat16, causal=True, sinks=True)
    results, args, runs = _backward_at_lnc1_and_lnc2(monkeypatch, sample)
    matmul_programs = {e.program_id for e in runs[-1][1].trace if e.opcode == "nc_matmul"}
    assert matmul_programs == {0, 1}
    for a, b in zip(results[0][:3], results[1][:3]):
        assert torch.equal(_bits(a), _bits(b))
    upcast = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    oracle = flash_attention_reference.flash_attention_backward(*upcast, **sample.kwargs)[3]
    baseline = _naive_grads(args, sample.kwargs, torch.bfloat16, wrt=[3])[0]
    result = parity(results[1][3], oracle, baseline, kind="grad", dtype=torch.float32, name="dsinks")
    assert result.ok, str(result)


def test_lnc2_splits_the_query_heads(monkeypatch):
    """B = 1, one kv head, four query heads: under LNC2 each core takes two query heads (neither
    idles); dq and dsinks are bitwise those of LNC1, the partial dK/dV (fp32, added by the
    launcher) pass parity against the fp64 oracle."""
    sample = make_sample(1, 4, 1, 150, 300, 32, torch.bfloat16, causal=True, sinks=True)
    results, args, runs = _backward_at_lnc1_and_lnc2(monkeypatch, sample)
    assert {e.program_id for e in runs[-1][1].trace if e.opcode == "nc_matmul"} == {0, 1}
    for i in (0, 3):
        assert torch.equal(_bits(results[0][i]), _bits(results[1][i]))
    upcast = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    oracle = flash_attention_reference.flash_attention_backward(*upcast, **sample.kwargs)
    baseline = _naive_grads(args, sample.kwargs, torch.bfloat16, wrt=[1, 2])
    for name, i, base in (("dk", 1, baseline[0]), ("dv", 2, baseline[1])):
        assert results[1][i].dtype == torch.bfloat16
        result = parity(results[1][i], oracle[i], base, kind="grad", dtype=torch.float32, name=name)
        assert result.ok, str(result)


@pytest.mark.parametrize("seqlen", [1000, 512, 130])
def test_row_groups_round_trip_in_one_host_op(seqlen):
    """Rows in the row-group layout and back (padding rows dropped, cast in the same copy): the
    rows come back exactly, contiguous, and each direction of one tensor is one host op (no second
    copy to cut the padding when S is not a multiple of the group rows and B * H > 1)."""
    from nki_lib.attention.kernels.flash_attention_bwd_rows import _row_group_view, from_row_groups
    from nki_lib.bench.whole_op import _Recorder

    x = torch.randn(2, 2, seqlen, 64, dtype=torch.float32)
    recorder = _Recorder()
    recorder.inside.append("flash_attention_backward")
    with recorder:
        groups = _row_group_view(x).contiguous()
        back = from_row_groups(groups, seqlen, torch.bfloat16)
    assert torch.equal(from_row_groups(groups, seqlen), x)
    assert torch.equal(back, x.to(torch.bfloat16)) and back.is_contiguous()
    padded = seqlen % 512 != 0
    assert len(recorder.ops) == padded + 2 and recorder.ops[-1].name == "aten.cat.out"   # pad, clone, cat
