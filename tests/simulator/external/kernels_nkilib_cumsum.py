"""Cumulative sum along the last dimension, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/cumsum/cumsum.py (``cumsum``),
Copyright Amazon.com, Apache-2.0. Re-typed by hand with the same structure, calls and
arguments (not copied verbatim); comments are ours.

Algorithm: view x [..., H] as [R, H] (R = product of the leading dims); for each 128-row
partition tile (``TiledRange``) walk the free dim in F_TILE_SIZE chunks with
``nl.sequential_range``: DMA the chunk in, ``nisa.tensor_tensor_scan`` computes
``r_i = 1 * r_{i-1} + x_i`` from the carry ``init_sb``, DMA out, and carry the chunk's last column.
Shapes: x, y [B, H] or [B, S, H]. Limits: reduction over the last axis only.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import TiledRange, div_ceil, kernel_assert, reduce

P_MAX = 128  # the library writes the literal (its comment: shapes need a Python int)
F_TILE_SIZE = 2048


@nki.jit
def cumsum(x, axis=-1):
    rank = len(x.shape)
    if axis < 0:
        axis = rank + axis
    kernel_assert(axis == rank - 1, f"cumsum supports the last dim only, got axis={axis} rank={rank}")

    x_shape = x.shape
    outer_dim = reduce(op="mul", input_list=list(x_shape[:-1]), initial_value=1) if rank > 1 else 1
    last_dim = x_shape[-1]
    shape_2d = (outer_dim, last_dim)
    x_2d = x.reshape(shape_2d)

    y = nl.ndarray(x_shape, dtype=x.dtype, buffer=nl.shared_hbm)
    y_2d = y.reshape(shape_2d)
    num_f_tiles = div_ceil(last_dim, F_TILE_SIZE)

    for p_tile in TiledRange(outer_dim, P_MAX):
        init_sb = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=init_sb, value=0.0)
        ones_sb = nl.ndarray((P_MAX, F_TILE_SIZE), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones_sb, value=1.0)

        for f_tile_idx in nl.sequential_range(num_f_tiles):
            f_start = f_tile_idx * F_TILE_SIZE
            f_end = min(f_start + F_TILE_SIZE, last_dim)
            f_size = f_end - f_start

            data_sb = nl.ndarray((P_MAX, F_TILE_SIZE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=data_sb[0:p_tile.size, 0:f_size],
                          src=x_2d[p_tile.start_offset:p_tile.start_offset + p_tile.size, f_start:f_end])

            result_sb = nl.ndarray((P_MAX, F_TILE_SIZE), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor_scan(dst=result_sb[0:p_tile.size, 0:f_size],
                                    data0=ones_sb[0:p_tile.size, 0:f_size],
                                    data1=data_sb[0:p_tile.size, 0:f_size],
                                    initial=init_sb[0:p_tile.size, 0:1],
                                    op0=nl.multiply, op1=nl.add)

            nisa.dma_copy(dst=y_2d[p_tile.start_offset:p_tile.start_offset + p_tile.size, f_start:f_end],
                          src=result_sb[0:p_tile.size, 0:f_size])

            if f_tile_idx + 1 < num_f_tiles:
                last_col = f_size - 1
                nisa.tensor_copy(dst=init_sb[0:p_tile.size, 0:1],
                                 src=result_sb[0:p_tile.size, last_col:last_col + 1])
    return y
