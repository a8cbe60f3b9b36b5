"""Two estimates per run (issue 10, cost model 4): program order and the dependency bound.

The dependency-bound schedule runs the same instructions with the same services, but each
engine may take them in any order subject to data dependencies (RAW/WAR/WAW), engine
occupancy, PSUM banks and barriers. Checked here: it reorders where program order stalls an
engine, it never reorders across a dependency, and on any trace
``lower_bound <= dependency_bound <= program order <= upper_bound``.
"""

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from profile_tracegen import Trace, hbm, new_id, onchip

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.profile import estimate


def _stalled_vector_engine(dependent_second: bool):
    """A long load, a copy of the loaded tile, then a copy of an unrelated tile (or, with
    ``dependent_second``, a copy that reads the first copy's output)."""
    t = Trace()
    x_hbm, x_sb, y_sb, z_sb, w_sb = (new_id() for _ in range(5))
    t.dma(hbm(x_hbm, (128, 4096)), onchip(x_sb, "sbuf", (128, 4096)))
    t.vector("tensor_copy", [onchip(x_sb, "sbuf", (128, 4096))], onchip(y_sb, "sbuf", (128, 4096)))
    second_src = y_sb if dependent_second else z_sb
    t.vector("tensor_copy", [onchip(second_src, "sbuf", (128, 4096))], onchip(w_sb, "sbuf", (128, 4096)))
    return estimate(t.entries, "trn2")


def test_independent_work_moves_ahead_of_a_stalled_instruction():
    est = _stalled_vector_engine(dependent_second=False)
    # program order: the second copy waits behind the first, which waits for the load;
    # dependency bound: it runs while the load is in flight.
    assert est.dependency_bound_ns < est.time_ns
    one_copy = est.busy_ns["vector"] / 2
    assert est.time_ns - est.dependency_bound_ns >= one_copy * 0.999


def test_dependent_work_is_not_reordered():
    est = _stalled_vector_engine(dependent_second=True)
    assert est.dependency_bound_ns == est.time_ns


def test_war_is_kept_when_reordering():
    """A later load into the tile an earlier copy reads must wait for that copy in both schedules."""
    t = Trace()
    x_hbm, y_hbm, a_sb, b_sb = (new_id() for _ in range(4))
    t.dma(hbm(x_hbm, (128, 2048)), onchip(a_sb, "sbuf", (128, 2048)))
    t.vector("tensor_copy", [onchip(a_sb, "sbuf", (128, 2048))], onchip(b_sb, "sbuf", (128, 2048)))
    t.dma(hbm(y_hbm, (128, 2048)), onchip(a_sb, "sbuf", (128, 2048)))
    est = estimate(t.entries, "trn2")
    assert est.dependency_bound_ns == est.time_ns  # nothing can move: load -> copy -> load


_ENGINE_OPS = {"vector": "tensor_copy", "scalar": "activation", "gpsimd": "tensor_copy"}


@st.composite
def _traces(draw):
    """Random straight-line programs over a few SBUF tiles and HBM tensors."""
    t = Trace()
    tiles = [new_id() for _ in range(draw(st.integers(2, 5)))]
    tensors = [new_id() for _ in range(2)]
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["load", "store", "vector", "scalar", "gpsimd", "matmul"]))
        free = draw(st.sampled_from([64, 512, 2048]))
        rows = draw(st.sampled_from([8, 64, 128]))
        src, dst = draw(st.sampled_from(tiles)), draw(st.sampled_from(tiles))
        if kind == "load":
            t.dma(hbm(draw(st.sampled_from(tensors)), (rows, free)), onchip(dst, "sbuf", (rows, free)))
        elif kind == "store":
            t.dma(onchip(src, "sbuf", (rows, free)), hbm(draw(st.sampled_from(tensors)), (rows, free)))
        elif kind == "matmul":
            t.matmul(onchip(src, "sbuf", (128, 128)), onchip(dst, "sbuf", (128, 512)),
                     onchip(new_id(), "psum", (128, 512), "float32"))
        elif kind == "scalar":
            t.activation(onchip(src, "sbuf", (rows, free)), onchip(dst, "sbuf", (rows, free)),
                         func=draw(st.sampled_from(["exp", "tanh"])))
        else:
            t.add(kind, _ENGINE_OPS[kind], [onchip(src, "sbuf", (rows, free))], [onchip(dst, "sbuf", (rows, free))],
                  (rows, free), "bfloat16")
    return t.entries


@given(_traces())
@example([])
def test_estimates_are_ordered(entries):
    if not entries:
        return
    est = estimate(entries, "trn2")
    tol = 1e-6 * est.upper_bound_ns
    assert est.lower_bound_ns - tol <= est.dependency_bound_ns <= est.time_ns <= est.upper_bound_ns + tol


def _two_phase(x, y):
    """Load x, exp it on ScalarE, store; load y, copy it on VectorE, store (independent halves)."""
    out_x = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    out_y = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.shared_hbm)
    for src, dst, scalar in ((x, out_x, True), (y, out_y, False)):
        a_sb = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sb, src=src)
        b_sb = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
        if scalar:
            nisa.activation(dst=b_sb, op=nl.exp, data=a_sb)
        else:
            nisa.tensor_copy(dst=b_sb, src=a_sb)
        nisa.dma_copy(dst=dst, src=b_sb)
    return out_x, out_y


def test_both_estimates_of_a_simulated_kernel():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 1024)).astype(np.float32)
    simulate(jit(_two_phase))(x, x.copy())
    est = estimate(last_run(), "trn2")
    assert est.lower_bound_ns <= est.dependency_bound_ns <= est.time_ns
    assert est.dependency_makespan_ns == est.dependency_bound_ns - est.launch_ns
    assert "dependency-bound" in est.summary()
