"""The LNC barrier call site of the AWS NKI Library's blockwise MoE matmul, re-typed.

Source: aws-neuron/nki-library, core/moe/moe_cte (``blockwise_mm_baseline_shard_intermediate``:
``DimensionSizes(NKIObject)`` with ``derive_all_dims()`` reading ``nl.num_programs(axes=0)``, and
after each block ``nisa.core_barrier(output, (0))`` when NUM_SHARDS == 1, ``(output, (0, 1))`` when
2), Copyright Amazon.com, Apache-2.0. Only the sharding skeleton is re-typed (each shard writes its
half of every block's rows of the ``shared_hbm`` output, barrier, then reads the other shard's half
back); the block matmuls are left out. Comments are ours.
Shapes: x [N * B, H] -> out [N * B, H] (out = x, assembled by both shards), peer [N * B, H // 2]
(the half each shard read back after the barrier). Limits: H even, B <= 128.
"""

import nki
import nki.isa as nisa
import nki.language as nl
from nki.language import NKIObject


class DimensionSizes(NKIObject):
    B: int
    H: int
    N: int

    def derive_all_dims(self):
        self.NUM_SHARDS = nl.num_programs(axes=0)
        self.H_SHARDED = self.H // self.NUM_SHARDS


@nki.jit(mode="trace")
def sharded_blocks_with_barrier(x, block_size):
    T, H = x.shape
    dims = DimensionSizes(B=block_size, H=H, N=T // block_size)
    dims.derive_all_dims()
    shard_id = nl.program_id(axis=0)
    output = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    peer = nl.ndarray((T, H // 2), dtype=x.dtype, buffer=nl.shared_hbm)
    for block_idx in nl.sequential_range(dims.N):
        rows = nl.ds(block_idx * dims.B, dims.B)
        cols = nl.ds(shard_id * dims.H_SHARDED, dims.H_SHARDED)
        block_sb = nl.ndarray((dims.B, dims.H_SHARDED), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=block_sb, src=x[rows, cols])
        nisa.dma_copy(dst=output[rows, cols], src=block_sb)
        if dims.NUM_SHARDS == 1:
            nisa.core_barrier(output, (0))
        elif dims.NUM_SHARDS == 2:
            nisa.core_barrier(output, (0, 1))
        other = nl.ds((1 - shard_id) * (H // 2), H // 2)
        peer_sb = nl.ndarray((dims.B, H // 2), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=peer_sb, src=output[rows, other])
        if shard_id == 0:
            nisa.dma_copy(dst=peer[rows, :], src=peer_sb)
    return output, peer
