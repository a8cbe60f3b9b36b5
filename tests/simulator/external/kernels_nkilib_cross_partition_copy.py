"""SBUF copy between arbitrary partition offsets, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/utils/cross_partition_copy.py
(``cross_partition_copy``, ``_shuffle_within_quadrant``, ``_aligned_copy_from_unaligned_src``),
Copyright Amazon.com, Apache-2.0. Re-typed by hand with the same structure, calls and arguments
(not copied verbatim); comments are ours. ``cross_partition_copy_kernel`` is our test entry point.

Algorithm: a destination starting on a 32-partition quadrant boundary is a plain ``tensor_copy``;
otherwise rows are moved through quadrant-sized temporaries with ``nc_stream_shuffle`` (mask
entry 255 = leave that destination partition unchanged): the first (partial) destination
quadrant by one shuffle, the rest in quadrant chunks, re-aligning an unaligned source with one or
two shuffles.
Shapes: src [Ps, F], dst [Pd, F] in SBUF (F = free_dim_size). Limits: Ps, Pd <= 128.
"""

import nki
import nki.isa as nisa
import nki.language as nl

QUADRANT = 32
MASK_NO_CHANGE = 255


def cross_partition_copy(src, dst, src_start_partition, dst_start_partition, num_partitions_to_copy,
                         free_dim_size):
    dst_end = dst_start_partition + num_partitions_to_copy
    if dst_start_partition % QUADRANT == 0:
        nisa.tensor_copy(src=src[src_start_partition:src_start_partition + num_partitions_to_copy, :free_dim_size],
                         dst=dst[dst_start_partition:dst_start_partition + num_partitions_to_copy, :free_dim_size])
        return
    dst_start_quadrant = dst_start_partition // QUADRANT
    dst_offset_in_quadrant = dst_start_partition % QUADRANT
    dst_end_quadrant = (dst_end - 1) // QUADRANT
    if dst_start_quadrant == dst_end_quadrant:
        _shuffle_within_quadrant(src, dst, src_start_partition, dst_start_partition, num_partitions_to_copy,
                                 free_dim_size)
        return

    first_portion_count = QUADRANT - dst_offset_in_quadrant
    _shuffle_within_quadrant(src, dst, src_start_partition, dst_start_partition, first_portion_count,
                             free_dim_size)
    remaining_src_start = src_start_partition + first_portion_count
    remaining_dst_start = (dst_start_quadrant + 1) * QUADRANT
    remaining_count = num_partitions_to_copy - first_portion_count
    while remaining_count > 0:
        chunk_count = min(remaining_count, QUADRANT)
        if remaining_src_start % QUADRANT == 0:
            nisa.tensor_copy(src=src[remaining_src_start:remaining_src_start + chunk_count, :free_dim_size],
                             dst=dst[remaining_dst_start:remaining_dst_start + chunk_count, :free_dim_size])
        else:
            _aligned_copy_from_unaligned_src(src, dst, remaining_src_start, remaining_dst_start, chunk_count,
                                             free_dim_size)
        remaining_src_start += chunk_count
        remaining_dst_start += chunk_count
        remaining_count -= chunk_count


def _shuffle_within_quadrant(src, dst, src_start_partition, dst_start_partition, num_partitions_to_copy,
                             free_dim_size):
    dst_offset_in_quadrant = dst_start_partition % QUADRANT
    dst_quadrant_base = (dst_start_partition // QUADRANT) * QUADRANT
    if dst_offset_in_quadrant == 0:
        nisa.tensor_copy(src=src[src_start_partition:src_start_partition + num_partitions_to_copy, :free_dim_size],
                         dst=dst[dst_start_partition:dst_start_partition + num_partitions_to_copy, :free_dim_size])
        return

    temp_src = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
    temp_dst = nl.ndarray((QUADRANT, free_dim_size), dtype=dst.dtype, buffer=nl.sbuf)
    nisa.memset(dst=temp_src, value=0.0)
    nisa.memset(dst=temp_dst, value=0.0)
    nisa.tensor_copy(src=src[src_start_partition:src_start_partition + num_partitions_to_copy, :free_dim_size],
                     dst=temp_src[0:num_partitions_to_copy, :free_dim_size])
    if dst_offset_in_quadrant > 0:
        nisa.tensor_copy(src=dst[dst_quadrant_base:dst_quadrant_base + dst_offset_in_quadrant, :free_dim_size],
                         dst=temp_dst[0:dst_offset_in_quadrant, :free_dim_size])

    shuffle_mask = [MASK_NO_CHANGE] * QUADRANT
    for i in range(num_partitions_to_copy):
        shuffle_mask[dst_offset_in_quadrant + i] = i
    nisa.nc_stream_shuffle(dst=temp_dst, src=temp_src, shuffle_mask=shuffle_mask)

    copy_back_size = min(dst_offset_in_quadrant + num_partitions_to_copy, QUADRANT)
    nisa.tensor_copy(src=temp_dst[0:copy_back_size, :free_dim_size],
                     dst=dst[dst_quadrant_base:dst_quadrant_base + copy_back_size, :free_dim_size])


def _aligned_copy_from_unaligned_src(src, dst, src_start_partition, dst_start_partition, num_partitions_to_copy,
                                     free_dim_size):
    src_quadrant = src_start_partition // QUADRANT
    src_offset_in_quadrant = src_start_partition % QUADRANT
    src_quadrant_base = src_quadrant * QUADRANT
    first_q_count = min(QUADRANT - src_offset_in_quadrant, num_partitions_to_copy)
    second_q_count = num_partitions_to_copy - first_q_count

    if second_q_count > 0:
        temp_src0 = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
        temp_src1 = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
        temp_aligned = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
        nisa.memset(dst=temp_src0, value=0.0)
        nisa.memset(dst=temp_src1, value=0.0)
        nisa.memset(dst=temp_aligned, value=0.0)
        nisa.tensor_copy(src=src[src_quadrant_base:src_quadrant_base + QUADRANT, :free_dim_size],
                         dst=temp_src0[0:QUADRANT, :free_dim_size])
        align_mask0 = [MASK_NO_CHANGE] * QUADRANT
        for i in range(first_q_count):
            align_mask0[i] = src_offset_in_quadrant + i
        nisa.nc_stream_shuffle(dst=temp_aligned, src=temp_src0, shuffle_mask=align_mask0)
        next_base = (src_quadrant + 1) * QUADRANT
        nisa.tensor_copy(src=src[next_base:next_base + second_q_count, :free_dim_size],
                         dst=temp_src1[0:second_q_count, :free_dim_size])
        align_mask1 = [MASK_NO_CHANGE] * QUADRANT
        for i in range(second_q_count):
            align_mask1[first_q_count + i] = i
        nisa.nc_stream_shuffle(dst=temp_aligned, src=temp_src1, shuffle_mask=align_mask1)
        nisa.tensor_copy(src=temp_aligned[0:num_partitions_to_copy, :free_dim_size],
                         dst=dst[dst_start_partition:dst_start_partition + num_partitions_to_copy, :free_dim_size])
    else:
        temp_src = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
        temp_aligned = nl.ndarray((QUADRANT, free_dim_size), dtype=src.dtype, buffer=nl.sbuf)
        nisa.memset(dst=temp_src, value=0.0)
        nisa.memset(dst=temp_aligned, value=0.0)
        src_copy_end = src_offset_in_quadrant + num_partitions_to_copy
        nisa.tensor_copy(src=src[src_quadrant_base:src_quadrant_base + src_copy_end, :free_dim_size],
                         dst=temp_src[0:src_copy_end, :free_dim_size])
        align_mask = [MASK_NO_CHANGE] * QUADRANT
        for i in range(num_partitions_to_copy):
            align_mask[i] = src_offset_in_quadrant + i
        nisa.nc_stream_shuffle(dst=temp_aligned, src=temp_src, shuffle_mask=align_mask)
        nisa.tensor_copy(src=temp_aligned[0:num_partitions_to_copy, :free_dim_size],
                         dst=dst[dst_start_partition:dst_start_partition + num_partitions_to_copy, :free_dim_size])


@nki.jit
def cross_partition_copy_kernel(src_hbm, dst_hbm, src_start, dst_start, count):
    """Test entry: both tensors into SBUF, the copy, the updated dst back to a shared_hbm output."""
    free = src_hbm.shape[1]
    src_sb = nl.ndarray(src_hbm.shape, dtype=src_hbm.dtype, buffer=nl.sbuf)
    dst_sb = nl.ndarray(dst_hbm.shape, dtype=dst_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src_sb, src=src_hbm)
    nisa.dma_copy(dst=dst_sb, src=dst_hbm)
    cross_partition_copy(src_sb, dst_sb, src_start, dst_start, count, free)
    out = nl.ndarray(dst_hbm.shape, dtype=dst_hbm.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst_sb)
    return out
