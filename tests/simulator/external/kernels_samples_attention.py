"""Batch-invariant scaled dot-product attention from AWS nki-samples, structure re-typed.

Source: aws-neuron/nki-samples, batch_invariance/kernels/attention_batch_invariant.py
(``nki_attention_kernel_isa``, "NKI version: 0.3.0"). The repository's LICENSE.txt is a
placeholder ("TODO: Fill LICENSE after it is finalized"), so the licence is unclear: the kernel's
structure and calls were re-typed by hand here, not copied; comments are ours.

Algorithm per 128-row query tile: q and each 128-row k tile are transposed on the Tensor engine
(``nc_transpose`` into PSUM, ``tensor_copy`` out), S = scale * q k^T (``nc_matmul`` +
``tensor_scalar``) is staged in an fp32 SBUF row buffer with SBUF->SBUF DMAs; row max
(``tensor_reduce`` + ``tensor_tensor``), exp(s - max) (``activation`` with a (P,1) ``bias``), row sum,
1/sum (``activation(op=nl.reciprocal)``), normalisation to the input dtype
(``scalar_tensor_tensor``), then P V accumulated in PSUM over KV_TILE key chunks (after a
``memset`` of the PSUM tile) with the scores transposed per chunk.
Shapes: q [Sq, 128], k, v [Sk, 128] -> out [Sq, 128]. Limits: Sq, Sk multiples of 128, d = 128.
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def nki_attention_kernel_isa(q, k, v, deterministic=True):
    seq_q, d_head = q.shape
    seq_k = k.shape[0]
    Q_TILE = 128
    D_TILE = 128
    KV_TILE_SOFTMAX = 128
    KV_TILE = 128 if deterministic else 64
    scale = float(d_head) ** -0.5

    out = nl.ndarray((seq_q, d_head), dtype=q.dtype, buffer=nl.shared_hbm)
    for q_idx in nl.affine_range(seq_q // Q_TILE):
        q_start = q_idx * Q_TILE
        q_tile = nl.ndarray((Q_TILE, D_TILE), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=q_tile, src=q[q_start:q_start + Q_TILE, 0:D_TILE])
        q_t_psum = nl.ndarray((D_TILE, Q_TILE), dtype=q.dtype, buffer=nl.psum)
        nisa.nc_transpose(q_t_psum, q_tile)
        q_t = nl.ndarray((D_TILE, Q_TILE), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=q_t, src=q_t_psum)

        scores_sbuf = nl.ndarray((Q_TILE, seq_k), dtype=nl.float32, buffer=nl.sbuf)
        for kv_idx in nl.affine_range(seq_k // KV_TILE_SOFTMAX):
            kv_start = kv_idx * KV_TILE_SOFTMAX
            k_tile = nl.ndarray((KV_TILE_SOFTMAX, D_TILE), dtype=k.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=k_tile, src=k[kv_start:kv_start + KV_TILE_SOFTMAX, 0:D_TILE])
            k_t_psum = nl.ndarray((D_TILE, KV_TILE_SOFTMAX), dtype=k.dtype, buffer=nl.psum)
            nisa.nc_transpose(k_t_psum, k_tile)
            k_t = nl.ndarray((D_TILE, KV_TILE_SOFTMAX), dtype=k.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=k_t, src=k_t_psum)

            qk_psum = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=qk_psum, stationary=q_t, moving=k_t)
            qk_sbuf = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=qk_sbuf, data=qk_psum, op0=nl.multiply, operand0=scale)
            nisa.dma_copy(dst=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX], src=qk_sbuf)

        row_max = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=row_max, value=-3.4028235e+38)
        for kv_idx in nl.affine_range(seq_k // KV_TILE_SOFTMAX):
            kv_start = kv_idx * KV_TILE_SOFTMAX
            s = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX])
            tile_max = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=tile_max, data=s, op=nl.maximum, axis=(1,), negate=False)
            nisa.tensor_tensor(dst=row_max, data1=row_max, data2=tile_max, op=nl.maximum)

        neg_max = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg_max, data=row_max, op0=nl.multiply, operand0=-1.0)

        row_sum = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=row_sum, value=0.0)
        for kv_idx in nl.affine_range(seq_k // KV_TILE_SOFTMAX):
            kv_start = kv_idx * KV_TILE_SOFTMAX
            s = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX])
            exp_s = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=exp_s, op=nl.exp, data=s, bias=neg_max, scale=1.0)
            nisa.dma_copy(dst=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX], src=exp_s)
            tile_sum = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=tile_sum, data=exp_s, op=nl.add, axis=(1,), negate=False)
            nisa.tensor_tensor(dst=row_sum, data1=row_sum, data2=tile_sum, op=nl.add)

        inv_sum = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=inv_sum, op=nl.reciprocal, data=row_sum, scale=1.0)

        for kv_idx in nl.affine_range(seq_k // KV_TILE_SOFTMAX):
            kv_start = kv_idx * KV_TILE_SOFTMAX
            s_f32 = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=s_f32, src=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX])
            norm = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=q.dtype, buffer=nl.sbuf)
            ones_bcast = nl.ndarray((Q_TILE, KV_TILE_SOFTMAX), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=ones_bcast, value=1.0)
            nisa.scalar_tensor_tensor(dst=norm, data=s_f32, op0=nl.multiply, operand0=inv_sum,
                                      op1=nl.multiply, operand1=ones_bcast)
            nisa.dma_copy(dst=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE_SOFTMAX], src=norm)

        out_psum = nl.ndarray((Q_TILE, D_TILE), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=out_psum, value=0.0)
        for kv_idx in nl.affine_range(seq_k // KV_TILE):
            kv_start = kv_idx * KV_TILE
            s = nl.ndarray((Q_TILE, KV_TILE), dtype=q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=s, src=scores_sbuf[0:Q_TILE, kv_start:kv_start + KV_TILE])
            s_t_psum = nl.ndarray((KV_TILE, Q_TILE), dtype=q.dtype, buffer=nl.psum)
            nisa.nc_transpose(s_t_psum, s)
            s_t = nl.ndarray((KV_TILE, Q_TILE), dtype=q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=s_t, src=s_t_psum)
            v_tile = nl.ndarray((KV_TILE, D_TILE), dtype=v.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=v_tile, src=v[kv_start:kv_start + KV_TILE, 0:D_TILE])
            nisa.nc_matmul(dst=out_psum, stationary=s_t, moving=v_tile)

        out_sbuf = nl.ndarray((Q_TILE, D_TILE), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sbuf, src=out_psum)
        nisa.dma_copy(dst=out[q_start:q_start + Q_TILE, 0:D_TILE], src=out_sbuf)
    return out
