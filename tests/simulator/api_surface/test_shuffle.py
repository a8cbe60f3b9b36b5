"""Quadrant shuffles (kernels_shuffle.py).

Behaviours pinned here: ``nc_stream_shuffle`` applies one 32-entry mask to every quadrant;
mask entry 255 leaves the destination partition unchanged; operands may be partition slices
starting at a quadrant boundary; a one-partition source broadcast with an all-zero mask; a
``tensor_copy`` between 32-partition slices at different start partitions. Exact.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from nki_lib import simulator as sim

Q = 32


def test_mirror_quadrants(kernel_module, rng):
    k = kernel_module("shuffle")
    x = rng.standard_normal((128, 20)).astype(np.float32)
    out = sim.simulate(k.mirror_quadrants)(x)
    np.testing.assert_array_equal(out, x.reshape(4, Q, 20)[:, ::-1].reshape(128, 20))


@pytest.mark.parametrize("quadrant, first, count", [(0, 0, 32), (1, 5, 10), (3, 31, 1), (2, 7, 0)])
def test_splice_rows(kernel_module, rng, quadrant, first, count):
    k = kernel_module("shuffle")
    base = rng.standard_normal((128, 12)).astype(np.float32)
    patch = rng.standard_normal((128, 12)).astype(np.float32)
    out = sim.simulate(k.splice_rows)(base, patch, quadrant, first, count)
    expected = base.copy()
    rows = slice(quadrant * Q + first, quadrant * Q + first + count)
    expected[rows] = patch[rows]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("src_quadrant, dst_quadrant", [(0, 0), (0, 3), (2, 1)])
def test_spread_row(kernel_module, rng, src_quadrant, dst_quadrant):
    k = kernel_module("shuffle")
    x = rng.standard_normal((128, 9)).astype(np.float32)
    out = sim.simulate(k.spread_row)(x, src_quadrant, dst_quadrant)
    expected = x.copy()
    expected[dst_quadrant * Q:(dst_quadrant + 1) * Q] = x[src_quadrant * Q]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("src_quadrant, dst_quadrant", [(0, 2), (3, 1)])
def test_relocate_quadrant(kernel_module, rng, src_quadrant, dst_quadrant):
    k = kernel_module("shuffle")
    x = rng.standard_normal((128, 5)).astype(np.float32)
    out = sim.simulate(k.relocate_quadrant)(x, src_quadrant, dst_quadrant)
    expected = x.copy()
    expected[dst_quadrant * Q:(dst_quadrant + 1) * Q] = x[src_quadrant * Q:(src_quadrant + 1) * Q]
    np.testing.assert_array_equal(out, expected)


def test_splice_rows_any_window(kernel_module):
    """Every (quadrant, first, count) window: exactly the window's rows change."""
    k = kernel_module("shuffle")

    @given(quadrant=st.integers(0, 3), first=st.integers(0, Q - 1), count=st.integers(0, Q), seed=st.integers(0, 99))
    @example(quadrant=3, first=0, count=Q, seed=0)
    @example(quadrant=0, first=Q - 1, count=0, seed=1)
    def check(quadrant, first, count, seed):
        count = min(count, Q - first)
        rng = np.random.default_rng(seed)
        base, patch = (rng.standard_normal((128, 4)).astype(np.float32) for _ in range(2))
        out = sim.simulate(k.splice_rows)(base, patch, quadrant, first, count)
        changed = np.zeros(128, dtype=bool)
        changed[quadrant * Q + first:quadrant * Q + first + count] = True
        np.testing.assert_array_equal(out, np.where(changed[:, None], patch, base))

    check()
