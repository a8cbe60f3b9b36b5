"""Chunked row argmax (kernels_argmax.py).

Behaviours pinned here: a ``@dataclass`` subclass of ``nl.NKIObject`` passed as a kernel argument;
``.ap()`` on an HBM argument with an explicit offset; ``dge_mode.hwdge`` and the default DGE mode;
``affine_select`` padding in place; ``max8`` + ``nc_find_index8``; ``iota`` with a negative
``channel_multiplier``; ``nc_matmul(is_transpose=True)`` writing fp32 PSUM; LNC2 programs writing
disjoint columns of one ``shared_hbm`` output; ``tensor_reduce`` over a non-trailing axis refused.
The outputs are exact (a maximum and an index), so they are compared bit for bit.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nki_lib import simulator as sim


def _rows_with_ties(rng, rows, cols):
    """Rows of small integers (so the maximum repeats) with a unique sign pattern."""
    return rng.integers(-50, 50, size=(rows, cols)).astype(np.float32)


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("cols, chunk", [(1024, 512), (1000, 256), (77, 64)], ids=["even", "tail", "short"])
@pytest.mark.parametrize("hardware_dge", [True, False], ids=["hwdge", "default-dge"])
def test_row_argmax(kernel_module, rng, grid, cols, chunk, hardware_dge):
    k = kernel_module("argmax")
    x = _rows_with_ties(rng, 6, cols)
    kernel = k.row_argmax if grid == 1 else k.row_argmax[grid]
    config = k.ArgmaxConfig(chunk=chunk, hardware_dge=hardware_dge)
    values, positions = sim.simulate(kernel)(x, config)
    assert values.shape == (1, 6) and positions.shape == (1, 6) and positions.dtype == np.int32
    np.testing.assert_array_equal(values[0], x.max(axis=1))
    np.testing.assert_array_equal(positions[0], x.argmax(axis=1))  # first occurrence wins
    report = sim.last_run()
    assert report.grid == grid
    transposes = [e for e in report.trace if e.opcode == "nc_matmul"]
    assert len(transposes) == 2 * grid and all(e.attrs["is_transpose"] for e in transposes)
    assert sum(e.opcode == "affine_select" for e in report.trace) == grid * (cols % chunk != 0)
    loads = [e for e in report.trace if e.opcode == "dma_copy" and e.writes[0].memory == "sbuf"]
    assert {e.attrs["dge_mode"] for e in loads} == {"hwdge" if hardware_dge else "unknown"}


def test_row_argmax_any_width(kernel_module):
    """Any column count and chunk width (padded tails included) on one or two programs."""
    k = kernel_module("argmax")

    @settings(max_examples=30)  # each example is a full kernel launch; keeps the folder fast
    @given(cols=st.integers(1, 700), chunk=st.sampled_from([8, 64, 200, 512]), grid=st.sampled_from([1, 2]),
           seed=st.integers(0, 99))
    @example(cols=1, chunk=8, grid=1, seed=0)
    @example(cols=513, chunk=512, grid=2, seed=1)
    def check(cols, chunk, grid, seed):
        x = _rows_with_ties(np.random.default_rng(seed), 4, cols)
        kernel = k.row_argmax if grid == 1 else k.row_argmax[grid]
        values, positions = sim.simulate(kernel)(x, k.ArgmaxConfig(chunk=chunk))
        np.testing.assert_array_equal(values[0], x.max(axis=1))
        np.testing.assert_array_equal(positions[0], x.argmax(axis=1))

    check()


def test_reduce_over_a_middle_axis_is_refused(kernel_module, rng):
    k = kernel_module("argmax")
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.reduce_middle_axis)(rng.standard_normal((4, 3, 16)).astype(np.float32))
    err = info.value
    assert (err.instruction, err.operand) == ("tensor_reduce", "axis")
    assert err.source.startswith("kernels_argmax.py:")
