"""Write one sequence's K/V into a batched KV cache at a runtime batch index, re-typed.

Source: aws-neuron/neuronx-distributed-inference,
src/neuronx_distributed_inference/modules/kvcache/utils.py (``write_kv_cache_at_batch_kernel``,
new ``nki`` API version; it imports ``get_verified_program_sharding_info`` from the NKI
Library), Copyright Amazon.com, Apache-2.0. Re-typed by hand with the same structure, calls and
arguments (not copied verbatim); comments are ours.

Algorithm: the batch index is DMA'd from HBM into a (1, 1) SBUF tile; program 0 writes K and the
last program writes V (under LNC1 both are program 0) with one DMA each into a 4-D ``.ap()`` view
of the cache whose start is ``batch_idx * H * S_prior * D`` (``scalar_offset`` with
``indirect_dim=0``); ``oob_mode=skip`` drops the write when batch_idx >= B. The kernel writes into
its HBM arguments and returns them.
Shapes: K, V [1, H, S, D]; K_prior, V_prior [B, H, S_prior, D]; batch_idx [1] int32.
Limits: S <= S_prior.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import get_verified_program_sharding_info


def _cache_row_view(cache, seq_len, batch_idx_sbuf):
    _, heads, s_prior, d_head = cache.shape
    return cache.ap(pattern=[[d_head * s_prior * heads, 1], [d_head * s_prior, heads], [d_head, seq_len],
                             [1, d_head]],
                    offset=0, scalar_offset=batch_idx_sbuf, indirect_dim=0)


@nki.jit
def write_kv_cache_at_batch_kernel(K, V, K_prior, V_prior, batch_idx):
    _, n_prgs, prg_id = get_verified_program_sharding_info("write_kv_cache_at_batch_kernel", (0, 1), 2)
    batch_idx_sbuf = nl.ndarray((1, 1), dtype=batch_idx.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=batch_idx_sbuf, src=batch_idx.reshape((1, 1)))

    if prg_id == 0:
        nisa.dma_copy(src=K, dst=_cache_row_view(K_prior, K.shape[2], batch_idx_sbuf),
                      oob_mode=nisa.oob_mode.skip)
    if prg_id == n_prgs - 1:
        nisa.dma_copy(src=V, dst=_cache_row_view(V_prior, V.shape[2], batch_idx_sbuf),
                      oob_mode=nisa.oob_mode.skip)
    return K_prior, V_prior
