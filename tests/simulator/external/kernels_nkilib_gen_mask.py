"""Attention token-generation mask builder, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/attention/gen_mask_tkg.py
(``gen_mask_tkg`` standard path, ``_generate_iota_tensor``, ``_create_batch_masks``), Copyright
Amazon.com, Apache-2.0. Re-typed by hand with the same structure, calls and arguments (not
copied verbatim); comments are ours. Left out: the sliding-window (``start_pos``) path and the
``active_mask`` load. Replaced: the library's ``SbufManager(use_auto_alloc=True).alloc_stack``
by plain ``nl.ndarray`` (what auto allocation amounts to), and
``TensorView(mask_out).select(2, b).get_view()`` by the equivalent ``.ap()`` view (TensorView
builds its views with ``.ap()``). ``gen_mask_kernel`` is our test entry point around it.

Algorithm: memset the mask; ``iota`` writes the key index of every (partition, tile) slot for
the cache layout (flat strided: p*n + f; flat non-strided: p + f*128; block cache: per fold
p*block_len + f); a Scalar-engine ``tensor_copy`` from a stride-0 ``.ap()`` replicates it over
(q_head, s_active); per batch ``tensor_scalar(op0=nl.less)`` against that batch's position id,
and Scalar / Vector ``tensor_copy`` (alternating) into the batch's slice of the 5-D mask.
Shapes: pos_ids [P_MAX, bs * s_active] (broadcast over partitions), mask_out
[P_MAX, n_sprior_tile, bs, q_head, s_active]. Limits: block_len divides n_sprior_tile.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import get_verified_program_sharding_info, kernel_assert


def gen_mask_tkg(pos_ids, mask_out, bs, q_head, s_active, is_s_prior_sharded, s_prior_per_shard,
                 s_prior_offset=0, block_len=0, strided_mm1=True):
    P_MAX = nl.tile_size.pmax
    _, lnc, shard_id = get_verified_program_sharding_info("gen_mask_tkg", (0, 1))
    sprior_prg_id = shard_id if is_s_prior_sharded else 0

    nisa.memset(mask_out, value=0)
    kernel_assert(len(mask_out.shape) == 5, f"mask_out must be 5-D, got {mask_out.shape}")
    _, n_sprior_tile, _bs, _q_head, _s_active = mask_out.shape
    kernel_assert((_bs, _q_head, _s_active) == (bs, q_head, s_active), "mask_out shape mismatch")
    s_active_qh = q_head * s_active

    tmp_iota = nl.ndarray((P_MAX, n_sprior_tile), dtype=pos_ids.dtype, buffer=nl.sbuf,
                          name=f"tmp_iota_{s_prior_offset}")
    nisa.memset(tmp_iota, value=0)
    _generate_iota_tensor(tmp_iota, n_sprior_tile, s_prior_per_shard, sprior_prg_id, s_prior_offset,
                          block_len, strided_mm1)

    mask_iota = nl.ndarray((P_MAX, n_sprior_tile * s_active_qh), dtype=tmp_iota.dtype, buffer=nl.sbuf,
                           name=f"mask_iota_{s_prior_offset}")
    nisa.tensor_copy(
        dst=mask_iota.ap(pattern=[[n_sprior_tile * s_active_qh, P_MAX], [s_active_qh, n_sprior_tile],
                                  [1, s_active_qh]]),
        src=tmp_iota.ap(pattern=[[n_sprior_tile, P_MAX], [1, n_sprior_tile], [0, s_active_qh]], offset=0),
        engine=nisa.scalar_engine)
    _create_batch_masks(mask_iota, mask_out, pos_ids, bs, q_head, s_active, n_sprior_tile, s_prior_offset)
    return mask_out


def _generate_iota_tensor(tmp_iota, n_sprior_tile, s_prior_per_shard, sprior_prg_id, s_prior_offset,
                          block_len, strided_mm1):
    P_MAX = nl.tile_size.pmax
    iota_base = sprior_prg_id * s_prior_per_shard + s_prior_offset
    if block_len > 0:
        for fold_idx in range(n_sprior_tile // block_len):
            fold_base = iota_base + fold_idx * P_MAX * block_len
            nisa.iota(dst=tmp_iota[:, nl.ds(fold_idx * block_len, block_len)], pattern=[[1, block_len]],
                      offset=fold_base, channel_multiplier=block_len)
    else:
        iota_pattern = [[1, n_sprior_tile]] if strided_mm1 else [[P_MAX, n_sprior_tile]]
        iota_multiplier = n_sprior_tile if strided_mm1 else 1
        nisa.iota(dst=tmp_iota[...], pattern=iota_pattern, offset=iota_base, channel_multiplier=iota_multiplier)


def _select_batch(mask_out, batch_idx):
    """mask_out[:, :, batch_idx] as an ``.ap()`` view [P, n_sprior_tile, q_head, s_active]."""
    p, n_tile, bs, q_head, s_active = mask_out.shape
    per_partition = n_tile * bs * q_head * s_active
    return mask_out.ap(pattern=[[per_partition, p], [bs * q_head * s_active, n_tile], [s_active, q_head],
                                [1, s_active]], offset=batch_idx * q_head * s_active)


def _create_batch_masks(mask_iota, mask_out, pos_ids, bs, q_head, s_active, n_sprior_tile, s_prior_offset):
    P_MAX = nl.tile_size.pmax
    for batch_idx in range(bs):
        cur_mask = nl.ndarray(mask_iota.shape, dtype=mask_out.dtype, buffer=nl.sbuf,
                              name=f"cur_mask_{batch_idx}_{s_prior_offset}")
        nisa.tensor_scalar(dst=cur_mask[...], data=mask_iota[...], op0=nl.less,
                           operand0=pos_ids[:, nl.ds(batch_idx * s_active, 1)])
        cur_mask = cur_mask.reshape((P_MAX, n_sprior_tile, q_head, s_active))
        mask_out_pat = _select_batch(mask_out, batch_idx)
        if batch_idx % 2 == 0:
            nisa.tensor_copy(mask_out_pat, cur_mask[...], engine=nisa.scalar_engine)
        else:
            nisa.tensor_copy(mask_out_pat, cur_mask[...], engine=nisa.vector_engine)


@nki.jit
def gen_mask_kernel(pos_ids_hbm, n_sprior_tile, q_head, s_active, block_len=0, strided_mm1=True,
                    mask_dtype=nl.float32):
    """Test entry: pos_ids [1, bs * s_active] in HBM, broadcast to 128 partitions by a stride-0 DMA;
    returns the mask of every program, [n_programs, P_MAX, n_sprior_tile, bs, q_head, s_active]."""
    P_MAX = nl.tile_size.pmax
    bs = pos_ids_hbm.shape[1] // s_active
    _, n_programs, program_id = get_verified_program_sharding_info()
    pos_ids = nl.ndarray((P_MAX, bs * s_active), dtype=pos_ids_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=pos_ids, src=pos_ids_hbm.ap(pattern=[[0, P_MAX], [1, bs * s_active]], offset=0))

    mask_sb = nl.ndarray((P_MAX, n_sprior_tile, bs, q_head, s_active), dtype=mask_dtype, buffer=nl.sbuf)
    gen_mask_tkg(pos_ids, mask_sb, bs, q_head, s_active, is_s_prior_sharded=n_programs > 1,
                 s_prior_per_shard=P_MAX * n_sprior_tile, block_len=block_len, strided_mm1=strided_mm1)

    mask_hbm = nl.ndarray((n_programs, P_MAX, n_sprior_tile, bs, q_head, s_active), dtype=mask_dtype,
                          buffer=nl.shared_hbm)
    nisa.dma_copy(dst=mask_hbm[program_id], src=mask_sb)
    return mask_hbm
