"""RMSNorm for token generation in [T, H] layout with the hidden dim sharded over LNC2, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/subkernels/rmsnorm_tkg.py
(``_rmsnorm_tkg_th`` with ``shard_on_h=True``, steps 1-5), Copyright Amazon.com, Apache-2.0.
Re-typed by hand with the same instruction sequence and arguments (not copied verbatim); comments
are ours. Left out: gamma and the final transpose to [H0, H2, T] (step 6+7); the library's
TensorView slices are plain slices here and ``rmsnorm_tkg_shard_on_h`` (test entry) writes each
core's normalised [T, H/n] shard to the shared output.

Per T tile (``TiledRange`` over T by pmax): DMA this core's H shard in, ``activation_reduce``
(square, add) gives the partial sum(x^2); under LNC2 the partials are exchanged with
``sendrecv(dma_engine=gpsimd_dma)`` and added; ``activation(rsqrt, scale=1/H, bias=eps)`` with an
immediate bias (NC-v3+); ``tensor_scalar`` scales the shard by the (T, 1) factor.
Shapes: x [T, H] fp32 -> out [T, H]. Limits: H divisible by the LNC degree.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import TiledRange, get_verified_program_sharding_info


@nki.jit
def rmsnorm_tkg_shard_on_h(x, eps):
    T, H = x.shape
    T0 = min(T, nl.tile_size.pmax)
    _, lnc, shard_id = get_verified_program_sharding_info("rmsnorm_tkg", (0, 1))
    shard_on_h = lnc > 1
    H_per_shard = H // lnc
    H_shard_start = shard_id * H_per_shard
    hidden_scale = 1.0 / H
    inter_dtype = nl.float32

    input_buf = nl.ndarray((T0, H_per_shard), dtype=x.dtype, buffer=nl.sbuf)
    reduced_sq = nl.ndarray((T0, 1), dtype=inter_dtype, buffer=nl.sbuf)
    square_buf = nl.ndarray((T0, H_per_shard), dtype=inter_dtype, buffer=nl.sbuf)
    remote_reduced_sq = nl.ndarray((T0, 1), dtype=inter_dtype, buffer=nl.sbuf) if shard_on_h else None
    out = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)

    for t_tile in TiledRange(T, T0):
        tile_T = t_tile.size
        tile_input = input_buf[0:tile_T, :]
        tile_sq = square_buf[0:tile_T, :]
        tile_red = reduced_sq[0:tile_T, :]
        nisa.dma_copy(dst=tile_input,
                      src=x[t_tile.start_offset:t_tile.end_offset, H_shard_start:H_shard_start + H_per_shard])
        nisa.activation_reduce(tile_sq, op=nl.square, data=tile_input, reduce_op=nl.add, reduce_res=tile_red)
        if shard_on_h:
            tile_remote_red = remote_reduced_sq[0:tile_T, :]
            nisa.sendrecv(dst=tile_remote_red, src=tile_red, send_to_rank=1 - shard_id, recv_from_rank=1 - shard_id,
                          pipe_id=0, dma_engine=nisa.dma_engine.gpsimd_dma)
            nisa.tensor_tensor(tile_red, tile_red, tile_remote_red, nl.add)
        nisa.activation(tile_red, op=nl.rsqrt, data=tile_red, scale=hidden_scale, bias=eps)
        nisa.tensor_scalar(tile_input, tile_input, op0=nl.multiply, operand0=tile_red)
        nisa.dma_copy(dst=out[t_tile.start_offset:t_tile.end_offset, H_shard_start:H_shard_start + H_per_shard],
                      src=tile_input)
    return out
