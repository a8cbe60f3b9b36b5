"""Monotonicity of the cost model: bigger tiles are never cheaper, more instructions never cheaper."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from profile_tracegen import Trace, hbm, new_id, onchip

from nki_lib.simulator.profile import estimate, instruction_cost, params

TARGETS = ("trn2", "trn3")
SIZES = (1, 16, 64, 100, 128, 256, 512, 1024, 2048, 8192)


def _cost(entry, target):
    c = instruction_cost(entry, params(target))
    return c.issue_ns + c.service_ns * max(c.dma_engines, 1) + c.latency_ns


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matmul_cost_grows_with_moving_and_stationary(target, dtype):
    def cost(m, n):
        t = Trace()
        e = t.matmul(onchip(new_id(), "sbuf", (128, m), dtype), onchip(new_id(), "sbuf", (128, n), dtype),
                     onchip(new_id(), "psum", (m, n), "float32"))
        return _cost(e, target)

    ns, ms = (1, 32, 64, 128, 256, 512), (1, 32, 64, 128)
    for m in ms:
        costs = [cost(m, n) for n in ns]
        assert costs == sorted(costs)
    for n in ns:
        costs = [cost(m, n) for m in ms]
        assert costs == sorted(costs)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("engine,opcode", [("vector", "tensor_copy"), ("vector", "tensor_scalar"),
                                           ("vector", "tensor_tensor"), ("vector", "tensor_reduce"),
                                           ("vector", "reciprocal"), ("scalar", "activation"),
                                           ("scalar", "tensor_copy"), ("gpsimd", "iota"),
                                           ("gpsimd", "tensor_tensor")])
@pytest.mark.parametrize("dtype,memory", [("bfloat16", "sbuf"), ("float32", "sbuf"), ("float32", "psum")])
def test_streaming_cost_grows_with_free_size(target, engine, opcode, dtype, memory):
    prev = 0.0
    for n in SIZES:
        t = Trace()
        src = onchip(new_id(), memory if engine != "gpsimd" else "sbuf", (128, n), dtype)
        reads = [src, onchip(new_id(), "sbuf", (128, n), dtype)] if opcode == "tensor_tensor" else [src]
        e = t.add(engine, opcode, reads, [onchip(new_id(), "sbuf", (128, n), dtype)], (128, n), dtype,
                  {"func": "exp"})
        cost = _cost(e, target)
        assert cost >= prev, (n, cost, prev)
        prev = cost


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("parts", [1, 8, 32, 128])
def test_dma_cost_grows_with_bytes(target, parts):
    prev = 0.0
    for n in SIZES:
        t = Trace()
        e = t.dma(hbm(new_id(), (parts, n)), onchip(new_id(), "sbuf", (parts, n)))
        cost = _cost(e, target)
        assert cost >= prev
        prev = cost


def test_fragmented_dma_costs_more():
    t = Trace()
    whole = t.dma(hbm(new_id(), (128, 2048)), onchip(new_id(), "sbuf", (128, 2048)))
    pieces = t.dma(hbm(new_id(), (128, 2048)), onchip(new_id(), "sbuf", (128, 2048)), contiguous_bytes=128)
    assert _cost(pieces, "trn2") > _cost(whole, "trn2")


_OPS = st.sampled_from(["load", "store", "matmul", "copy", "exp", "silu", "tt"])


@given(ops=st.lists(st.tuples(_OPS, st.integers(0, 3), st.sampled_from([64, 256, 512])), min_size=1, max_size=14),
       target=st.sampled_from(TARGETS))
def test_more_instructions_are_never_cheaper(ops, target):
    """Appending an instruction never lowers the estimate (list scheduling in program order)."""
    t = Trace()
    pool = [new_id() for _ in range(4)]
    psum = [new_id() for _ in range(4)]
    for op, slot, n in ops:
        tile = onchip(pool[slot], "sbuf", (128, n))
        other = onchip(pool[(slot + 1) % 4], "sbuf", (128, n))
        if op == "load":
            t.dma(hbm(new_id(), (128, n)), tile)
        elif op == "store":
            t.dma(tile, hbm(new_id(), (128, n)))
        elif op == "matmul":
            t.matmul(onchip(pool[slot], "sbuf", (128, 128)), other, onchip(psum[slot], "psum", (128, n), "float32"))
        elif op == "copy":
            t.vector("tensor_copy", [onchip(psum[slot], "psum", (128, n), "float32")], tile)
        elif op in ("exp", "silu"):
            t.activation(tile, other, func=op)
        else:
            t.vector("tensor_tensor", [tile, other], other, op="add")
    prev = None
    for k in range(1, len(t.entries) + 1):
        est = estimate(t.entries[:k], target)
        # bounds hold up to float summation order (time and bound add the same terms differently)
        assert est.lower_bound_ns <= est.time_ns * (1 + 1e-12)
        assert est.time_ns <= est.upper_bound_ns * (1 + 1e-12)
        if prev is not None:
            assert est.time_ns >= prev
        prev = est.time_ns


def test_trn3_moves_large_rows_faster():
    t = Trace()
    e = t.dma(hbm(new_id(), (128, 8192)), onchip(new_id(), "sbuf", (128, 8192)))
    assert _cost(e, "trn3") < _cost(e, "trn2")


def test_trn3_background_transpose_is_cheaper():
    t = Trace()
    e = t.add("tensor", "nc_transpose", [onchip(new_id(), "sbuf", (128, 128))], [onchip(new_id(), "psum", (128, 128))],
              (128, 128), "bfloat16")
    trn2, trn3 = (instruction_cost(e, params(x)).service_ns for x in TARGETS)
    assert trn3 == pytest.approx(trn2 * params("trn3").pe_transpose_factor) and trn3 < trn2


@given(widths=st.lists(st.tuples(st.sampled_from([64, 512, 2048]), st.sampled_from([64, 512, 2048])),
                       min_size=1, max_size=4))
def test_lnc2_barriers_only_delay(widths):
    """Two cores that meet at barriers take at least as long as either core alone, within the bounds."""
    traces = [Trace(0), Trace(1)]
    shared = new_id()
    for w0, w1 in widths:
        for t, w in zip(traces, (w0, w1)):
            t.activation(onchip(new_id(), "sbuf", (128, w)), onchip(new_id(), "sbuf", (128, w)), func="exp")
            t.add("sync", "core_barrier", [hbm(shared, (2, 128))], [], (1,), "bfloat16")
    both = estimate(traces[0].entries + traces[1].entries, "trn2")
    assert both.lower_bound_ns <= both.time_ns * (1 + 1e-12)
    assert both.time_ns <= both.upper_bound_ns * (1 + 1e-12)
    for t in traces:
        alone = [e for e in t.entries if e.opcode != "core_barrier"]
        assert both.time_ns >= estimate(alone, "trn2").time_ns
