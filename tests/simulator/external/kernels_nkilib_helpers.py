"""Small helpers of the AWS NKI Library that the re-typed library kernels here call, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/utils/ (kernel_assert.py,
kernel_helpers.py: ``div_ceil``, ``get_program_sharding_info``,
``get_verified_program_sharding_info``; tiled_range.py: ``TiledRangeIterator``, ``TiledRange``)
and core/max/cascaded_max_utils.py (``reduce``), Copyright Amazon.com, Apache-2.0.
Re-typed by hand with the same behaviour (not copied verbatim); comments are ours.
They exercise the Python-level behaviours of nki-api.md §17: ``nl.NKIObject`` subclasses built
by keyword, ``!= None`` comparisons, ``nl.program_ndim``/``num_programs``/``program_id``.
"""

import math

import nki.language as nl


def kernel_assert(condition, message):
    if not condition:
        raise AssertionError(message)


def div_ceil(n, d):
    return (n + d - 1) // d


def reduce(op="mul", input_list=None, initial_value=None):
    """Fold ``input_list`` with 'mul' / 'add' / 'max' / 'min' starting at ``initial_value``."""
    supported_ops = ["mul", "add", "max", "min"]
    kernel_assert(initial_value != None, "initial_value must be set")  # noqa: E711 - library style
    kernel_assert(input_list != None, "input_list must be set")  # noqa: E711
    kernel_assert(op in supported_ops, f"op must be one of {supported_ops}, got {op}")
    value = initial_value
    for element in input_list:
        if op == "mul":
            value = value * element
        elif op == "add":
            value = value + element
        elif op == "min":
            value = min(value, element)
        else:
            value = max(value, element)
    return value


def get_program_sharding_info():
    """``(grid_ndim, n_programs, program_id)``; ``(0, 1, 0)`` when launched without a grid."""
    grid_ndim = nl.program_ndim()
    n_prgs, prg_id = (nl.num_programs(axes=0), nl.program_id(axis=0)) if grid_ndim != 0 else (1, 0)
    return grid_ndim, n_prgs, prg_id


def get_verified_program_sharding_info(kernel_name="", allowed_ndims=None, max_sharding=None):
    return get_program_sharding_info()


class TiledRangeIterator(nl.NKIObject):
    """One tile of a tiled dimension: ``size``, ``index``, absolute ``start_offset``/``end_offset``."""

    def __init__(self, tile_size: int, tile_index: int, start_offset: int, end_offset: int):
        self.size = tile_size
        self.index = tile_index
        self.start_offset = start_offset
        self.end_offset = end_offset


def TiledRange(size, tile_size):
    """Split ``size`` (an int or a ``TiledRangeIterator``) into tiles of ``tile_size`` (last one partial)."""
    if isinstance(size, TiledRangeIterator):
        total_size, base_offset = size.size, size.start_offset
    else:
        total_size, base_offset = size, 0
    tiles = []
    for i in range(math.ceil(total_size / tile_size)):
        relative = i * tile_size
        current = min(tile_size, total_size - relative)
        start = base_offset + relative
        tiles.append(TiledRangeIterator(current, i, start, start + current))
    return tuple(tiles)
