"""Token gather and PE transpose of one MoE block, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, core/moe/moe_cte/bwmm_shard_on_I.py (``load_hidden_states``'s
row gather and ``transpose_hidden_states_allocated``), Copyright Amazon.com, Apache-2.0.
Re-typed by hand with the same calls and arguments (not copied verbatim); comments are ours.
Ours: ``moe_block_gather_transpose`` (test entry), the token-index load and the zero fill of the
gathered tiles (the library's ``load_token_indices`` / ``create_block_hidden_states`` are not
reproduced); TILE_SIZE / PSUM_SIZE (library constants 128 / 512) are read from ``nl.tile_size``.

Algorithm: per 128-token tile, a DMA gathers hidden-state rows with ``.ap(vector_offset=<(128,1)
token ids>, indirect_dim=0)`` (``oob_mode.skip`` leaves rows of out-of-range ids untouched); the
[B, H] block is transposed to [H, B] on the Tensor engine by ``nc_matmul(is_transpose=True)``
against ``nl.shared_identity_matrix`` into PSUM tiles whose dtype is the input's on NC-v3+
(``nisa.get_nc_version() >= nc_version.gen3``, else fp32), then ``tensor_copy`` to SBUF.
Shapes: hidden [T, H], token_ids [B] int32 -> out [H, B]. Limits: B, H multiples of 128.
"""

import nki
import nki.isa as nisa
import nki.language as nl
from nki.isa.constants import oob_mode

from kernels_nkilib_helpers import div_ceil


def transpose_hidden_states_allocated(block_hidden_states, H, B, compute_dtype):
    TILE_SIZE, PSUM_SIZE = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    h_outer_tripcount = div_ceil(H, PSUM_SIZE)
    h_inner_tripcount = PSUM_SIZE // TILE_SIZE
    linearized_tripcount = div_ceil(H, TILE_SIZE)
    block_psum_tiles = div_ceil(B, PSUM_SIZE)
    free_size = min(PSUM_SIZE, B)
    block_hidden_states_T = []
    for _ in range(h_outer_tripcount):
        block_hidden_states_T.append([nl.ndarray((TILE_SIZE, block_psum_tiles, free_size), dtype=compute_dtype,
                                                 buffer=nl.sbuf) for _ in range(h_inner_tripcount)])

    block_free_tiles = min(PSUM_SIZE // TILE_SIZE, B // TILE_SIZE)
    identity_sbuf = nl.shared_identity_matrix(TILE_SIZE, dtype=compute_dtype)
    for psum_tile_idx in range(block_psum_tiles):
        for h_outer_idx in range(h_outer_tripcount):
            for h_inner_idx in range(h_inner_tripcount):
                psum_dtype = (block_hidden_states[0].dtype if nisa.get_nc_version() >= nisa.nc_version.gen3
                              else nl.float32)
                tmp_res = nl.ndarray((TILE_SIZE, PSUM_SIZE), dtype=psum_dtype, buffer=nl.psum)
                for b_tile_idx in range(block_free_tiles):
                    offset = TILE_SIZE * b_tile_idx
                    trans_f_offset = TILE_SIZE * h_inner_idx + PSUM_SIZE * h_outer_idx
                    i_lin = h_outer_idx * h_inner_tripcount + h_inner_idx
                    if i_lin < linearized_tripcount:
                        nisa.nc_matmul(
                            stationary=block_hidden_states[block_free_tiles * psum_tile_idx + b_tile_idx][
                                0:TILE_SIZE, trans_f_offset:trans_f_offset + TILE_SIZE],
                            moving=identity_sbuf[0:TILE_SIZE, 0:TILE_SIZE],
                            dst=tmp_res[0:TILE_SIZE, offset:offset + TILE_SIZE],
                            is_transpose=True)
                nisa.tensor_copy(src=tmp_res[0:TILE_SIZE, 0:free_size],
                                 dst=block_hidden_states_T[h_outer_idx][h_inner_idx][0:TILE_SIZE, psum_tile_idx,
                                                                                     0:free_size])
    return block_hidden_states_T


@nki.jit
def moe_block_gather_transpose(hidden_states, token_ids, skip_token=False):
    TILE_SIZE, PSUM_SIZE = nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    _, H = hidden_states.shape
    B = token_ids.shape[0]
    block_hidden_states = []
    for tile_idx in range(B // TILE_SIZE):
        tmp_vector_index = nl.ndarray((TILE_SIZE, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tmp_vector_index,
                      src=token_ids.ap([[1, TILE_SIZE], [1, 1]], offset=tile_idx * TILE_SIZE))
        tile = nl.ndarray((TILE_SIZE, H), dtype=hidden_states.dtype, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=0.0)
        nisa.dma_copy(src=hidden_states.ap([[H, TILE_SIZE], [1, H]], offset=0, vector_offset=tmp_vector_index,
                                           indirect_dim=0),
                      dst=tile[0:TILE_SIZE, 0:H],
                      oob_mode=oob_mode.skip if skip_token else oob_mode.error)
        block_hidden_states.append(tile)

    block_T = transpose_hidden_states_allocated(block_hidden_states, H, B, hidden_states.dtype)
    out = nl.ndarray((H, B), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    free_size = min(PSUM_SIZE, B)
    for h_tile in range(H // TILE_SIZE):
        h_outer, h_inner = h_tile // (PSUM_SIZE // TILE_SIZE), h_tile % (PSUM_SIZE // TILE_SIZE)
        for psum_tile_idx in range(div_ceil(B, PSUM_SIZE)):
            nisa.dma_copy(dst=out[h_tile * TILE_SIZE:(h_tile + 1) * TILE_SIZE,
                                  psum_tile_idx * PSUM_SIZE:psum_tile_idx * PSUM_SIZE + free_size],
                          src=block_T[h_outer][h_inner][0:TILE_SIZE, psum_tile_idx, 0:free_size])
    return out
