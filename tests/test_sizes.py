"""nki_lib.sizes: the shared size helpers."""

from hypothesis import example, given
from hypothesis import strategies as st

from nki_lib.sizes import ceil_div, ceil_pow2, floor_pow2, spans


@given(st.integers(-5, 1 << 20))
@example(0)
@example(1)
@example(1 << 16)
@example((1 << 16) - 1)
def test_floor_pow2_is_the_largest_power_of_two_not_above(x):
    p = floor_pow2(x)
    assert p & (p - 1) == 0 and p >= 1
    assert p <= max(1, x) < 2 * p


@given(st.integers(-5, 1 << 20))
@example(0)
@example(1)
@example(1 << 16)
@example((1 << 16) + 1)
def test_ceil_pow2_is_the_smallest_power_of_two_not_below(x):
    p = ceil_pow2(x)
    assert p & (p - 1) == 0 and p >= 1
    assert p // 2 < max(1, x) <= p


@given(st.integers(0, 5000), st.integers(1, 300))
def test_spans_tile_the_range(length, width):
    tiles = spans(length, width)
    assert len(tiles) == ceil_div(length, width)
    assert [s for s, _ in tiles] == list(range(0, length, width))
    assert sum(n for _, n in tiles) == length and all(0 < n <= width for _, n in tiles)
