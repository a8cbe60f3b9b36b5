"""Global max and argmax over the last dim, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/max/cascaded_max.py (``cascaded_max``,
``CascadedMaxConfig``, ``cascaded_max_core``, ``_grouped_reduce_max``, ``_repeat``) and
core/max/cascaded_max_utils.py (``predicated_folded_load``, LNC-sharded part), Copyright
Amazon.com, Apache-2.0. Re-typed by hand with the same structure, calls and arguments (not
copied verbatim); comments are ours.

Algorithm: x [BxS, V] is folded into SBUF as [BxS_local * n_stages, ceil(V / n_stages)]
(fast path: an HBM reshape + one DMA with ``dge_mode=hwdge``; slow path: per-row ``.ap()`` DMAs
and a fill value for the padding); ``tensor_reduce`` max per partition, ``nc_find_index8`` finds
the local index, a GpSimd ``affine_select`` builds an identity, two ``nc_matmul(is_transpose=True)``
move values and indices to one partition, ``iota`` adds the stage offsets, and
``_grouped_reduce_max`` picks each row's max and its index. LNC2 shards rows by ``program_id``
and both programs write disjoint parts of the ``shared_hbm`` outputs through ``.ap()`` views.
Shapes: x [BxS, V] (V >= 128); outputs [BxS, 1] values (x.dtype) and indices (uint32).
Limits: BxS per program <= 128.

``_grouped_reduce_max`` in the library passes ``axis=1`` to ``tensor_reduce`` on a 3-D tile
[b, fold, elts] while the dst is [b, fold]: that reduces the last dim only under the NKI 0.2
reading ("axis=1 = last dim"); since 0.3 the reduced axes must be the trailing free dims
(nki-api.md §8.11), i.e. ``axis=2`` here. ``cascaded_max`` keeps the library's ``axis=1``;
``cascaded_max_axis2`` is the same kernel with ``axis=2``.
"""

import math
from dataclasses import dataclass

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import div_ceil, get_verified_program_sharding_info, kernel_assert, reduce

LIBRARY_GROUPED_AXIS = 1   # as written in the library (NKI 0.2 meaning)
TRAILING_GROUPED_AXIS = 2  # the NKI 0.3+ spelling of the same reduction


@dataclass
class CascadedMaxConfig(nl.NKIObject):
    """Shapes, LNC sharding and stage constants of the cascaded reduction."""

    def __init__(self, inp_shape, inp_dtype=None):
        kernel_assert(inp_dtype is not None, "inp_dtype must be set")
        self.inp_dtype = inp_dtype
        self.index_dtype = nl.uint32
        self.BxS = reduce("mul", inp_shape[:-1], 1)
        self.vocab_size = inp_shape[-1]
        self.out_shape = [d for d in inp_shape[:-1]] + [1]
        self.inp_shape = [self.BxS, self.vocab_size]

        _, self.n_prgs, self.prg_id = get_verified_program_sharding_info("max", (0, 1), 2)
        if self.BxS == 1:
            self.prg_id, self.n_prgs = 0, 1
        self.per_lnc_BxS = div_ceil(self.BxS, self.n_prgs)
        self.per_lnc_BxS_unpadded = min(self.per_lnc_BxS, self.BxS - self.per_lnc_BxS * self.prg_id)
        kernel_assert(self.per_lnc_BxS <= nl.tile_size.pmax, "BxS per program exceeds pmax")
        kernel_assert(len(self.inp_shape) == 2, "input must be 2-D")

        p_max = nl.tile_size.pmax
        n_stages = min(math.floor(p_max // self.per_lnc_BxS), self.vocab_size // p_max)
        chunk_size = math.ceil(self.vocab_size / n_stages)
        self.n_stages = n_stages
        self.stage_free_size = chunk_size
        self.padded_vocab_size = chunk_size * n_stages


def _cascaded_max(input_tensor, grouped_axis):
    config = CascadedMaxConfig(input_tensor.shape, inp_dtype=input_tensor.dtype)
    val, indx = cascaded_max_core(input_tensor.reshape(config.inp_shape), config, grouped_axis)

    bxs_size, bxs_global = config.per_lnc_BxS, config.BxS
    program_id = config.prg_id
    max_values = nl.ndarray((1, bxs_global), dtype=val.dtype, buffer=nl.shared_hbm, name="max_values")
    max_indices = nl.ndarray((1, bxs_global), dtype=config.index_dtype, buffer=nl.shared_hbm,
                             name="max_indices")
    unpadded = min(bxs_size, bxs_global - bxs_size * program_id)
    src_ap = [[bxs_size, 1], [1, unpadded]]
    dst_ap = [[bxs_global, 1], [1, unpadded]]
    offset = program_id * bxs_size
    nisa.dma_copy(dst=max_values.ap(dst_ap, offset=offset), src=val.ap(src_ap))
    nisa.dma_copy(dst=max_indices.ap(dst_ap, offset=offset), src=indx.ap(src_ap))
    return max_values.reshape(config.out_shape), max_indices.reshape(config.out_shape)


@nki.jit
def cascaded_max(input_tensor):
    return _cascaded_max(input_tensor, LIBRARY_GROUPED_AXIS)


@nki.jit
def cascaded_max_axis2(input_tensor):
    return _cascaded_max(input_tensor, TRAILING_GROUPED_AXIS)


def predicated_folded_load(data_hbm, fold_factor, program_id=0, n_programs=1, fill_value=-9948.0):
    """HBM [b, n] -> SBUF [b_local * fold_factor, ceil(n / fold_factor)], padding with fill_value."""
    kernel_assert(len(data_hbm.shape) == 2, "expected [B, N]")
    batch_size, n = data_hbm.shape
    batch_size_sharded = (batch_size + n_programs - 1) // n_programs
    batch_line_offset = program_id * batch_size_sharded
    kernel_assert(batch_size_sharded * fold_factor <= nl.tile_size.pmax, "fold exceeds pmax")
    n_folded = math.ceil(n / fold_factor)
    data_sb = nl.ndarray((batch_size_sharded * fold_factor, n_folded), dtype=data_hbm.dtype, buffer=nl.sbuf)

    if n == fold_factor * n_folded:
        src_hbm_reshape = data_hbm.reshape((batch_size * fold_factor, n_folded))
        base_offset = batch_line_offset * fold_factor
        batch_bound = min(batch_size_sharded * fold_factor, batch_size * fold_factor - base_offset)
        ix, iy = nl.ds(0, batch_bound), nl.ds(0, n_folded)
        ix_src = nl.ds(base_offset, batch_bound)
        nisa.dma_copy(src=src_hbm_reshape[ix_src, iy], dst=data_sb[ix, iy], dge_mode=nisa.dge_mode.hwdge)
        return data_sb

    remainder = n % n_folded
    nisa.memset(dst=data_sb[:, nl.ds(remainder, n_folded - remainder)], value=fill_value)
    src_hbm_flat = data_hbm.reshape((batch_size * n,))
    bounded = min(batch_size_sharded, batch_size - batch_line_offset)
    for batch_line_idx in nl.affine_range(bounded):
        base_idx = (batch_line_idx + batch_line_offset) * n
        ix_0, iy_0 = nl.ds(batch_line_idx * fold_factor, fold_factor), nl.ds(0, remainder)
        ix_1, iy_1 = nl.ds(batch_line_idx * fold_factor, fold_factor - 1), nl.ds(remainder, n_folded - remainder)
        src_ap_0 = [[n_folded, fold_factor], [1, remainder]]
        src_ap_1 = [[n_folded, fold_factor - 1], [1, n_folded - remainder]]
        nisa.dma_copy(dst=data_sb[ix_0, iy_0], src=src_hbm_flat.ap(pattern=src_ap_0, offset=base_idx))
        nisa.dma_copy(dst=data_sb[ix_1, iy_1], src=src_hbm_flat.ap(pattern=src_ap_1, offset=base_idx + remainder))
    return data_sb


def cascaded_max_core(inp, config, grouped_axis):
    n_stages = config.n_stages
    bxs_size = config.per_lnc_BxS
    stage_free_size = config.stage_free_size
    total_p = n_stages * bxs_size
    i_p, i_f = nl.ds(0, total_p), nl.ds(0, stage_free_size)

    values = predicated_folded_load(data_hbm=inp, fold_factor=n_stages, n_programs=config.n_prgs,
                                    program_id=config.prg_id)
    kernel_assert(values.shape == (total_p, stage_free_size), f"unexpected folded shape {values.shape}")

    value = nl.ndarray((total_p, 1), dtype=inp.dtype)
    ind_buf = nl.ndarray((total_p, 8), dtype=config.index_dtype)
    broadcast_ap = [[1, total_p], [0, 8]]
    nisa.tensor_reduce(op=nl.maximum, data=values[i_p, i_f], dst=value[...], axis=1)
    nisa.nc_find_index8(data=values[:, :], vals=value.ap(broadcast_ap), dst=ind_buf[...])

    ind_offset = _repeat(n_stages, stage_free_size, bxs_size)

    identity_load = nl.ndarray((total_p, total_p), dtype=value.dtype, buffer=nl.sbuf)
    nisa.memset(dst=identity_load, value=1.0)
    nisa.affine_select(dst=identity_load[...], pattern=[[1, total_p]], channel_multiplier=-1,
                       cmp_op=nl.equal, on_true_tile=identity_load[nl.ds(0, total_p), nl.ds(0, total_p)],
                       on_false_value=0.0)
    ind_t = nl.ndarray((1, total_p), dtype=value.dtype, buffer=nl.psum)
    ind_buf_float = nl.ndarray((total_p, 1), dtype=value.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(src=ind_buf[:, 0:1], dst=ind_buf_float)
    nisa.nc_matmul(dst=ind_t[...], stationary=ind_buf_float, moving=identity_load, is_transpose=True)

    ind_shifted = nl.ndarray((1, total_p), dtype=value.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=ind_shifted, data1=ind_t, op=nl.add, data2=ind_offset)

    value_psum = nl.ndarray((1, total_p), dtype=value.dtype, buffer=nl.psum)
    nisa.nc_matmul(dst=value_psum, stationary=value[:, 0:1], moving=identity_load, is_transpose=True)
    return _grouped_reduce_max(value_psum, ind_shifted, fold_factor=bxs_size, axis=grouped_axis)


def _grouped_reduce_max(input_tensor, index, fold_factor, axis):
    """Per group of ``n // fold_factor`` elements: the max and the index stored next to it."""
    b, n = input_tensor.shape
    elts_per_fold = n // fold_factor
    reshaped_shape = (b, fold_factor, elts_per_fold)
    repeat_interleave_ap = [[fold_factor, b], [1, fold_factor], [0, elts_per_fold]]
    mask = nl.ndarray(reshaped_shape, dtype=nl.uint8, buffer=nl.sbuf)
    reduced_max = nl.ndarray((b, fold_factor), dtype=input_tensor.dtype, buffer=nl.sbuf)
    masked_index = nl.ndarray((b, n), dtype=index.dtype, buffer=nl.sbuf)
    final_index = nl.ndarray((b, fold_factor), dtype=index.dtype, buffer=nl.sbuf)

    nisa.tensor_reduce(dst=reduced_max, op=nl.maximum, data=input_tensor.reshape(reshaped_shape), axis=axis)
    nisa.tensor_tensor(dst=mask, data1=input_tensor.reshape(reshaped_shape), op=nl.equal,
                       data2=reduced_max.ap(repeat_interleave_ap))
    nisa.tensor_tensor(dst=masked_index, data1=mask.reshape((b, n)), data2=index, op=nl.multiply)
    nisa.tensor_reduce(dst=final_index, op=nl.maximum, data=masked_index.reshape(reshaped_shape), axis=axis)
    return reduced_max, final_index


def _repeat(n_stages, stage_size, repeat_count):
    """[1, repeat_count * n_stages] uint32: element i holds (i % n_stages) * stage_size."""
    offset_r = nl.ndarray((1, repeat_count * n_stages), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.iota(pattern=[[0, 1], [0, repeat_count], [stage_size, n_stages]], dst=offset_r)
    return offset_r
