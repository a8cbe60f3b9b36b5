"""Softmax attention of one query block with a residual, in bf16 (written for this project).

``attention_with_residual(q, k, v, key_block)``: out (Sq, D) = softmax(q @ k.T / sqrt(D)) @ v + q,
q (Sq, D), k and v (Sk, D), all bf16. Dimension legend: Sq queries (<= pmax), Sk keys, D head
dim (<= pmax), Bk = ``key_block`` keys per block (<= pmax, Sk % Bk == 0, Sk <= psum_fmax).

Algorithm (two passes over the keys, all scores kept):
1. q and every key block are transposed on the Tensor engine (``nc_transpose`` into bf16 PSUM,
   copied to SBUF) so that D is the contraction axis; one ``nc_matmul`` per key block writes its
   (Sq, Bk) slice of one (Sq, Sk) fp32 score tile in PSUM.
2. Row max (``tensor_reduce``), then p = exp(s / sqrt(D) - max / sqrt(D)) as one ``activation``
   with ``scale`` and a (Sq, 1) ``bias``, summing each row into a (Sq, 1) tile; 1 / sum with
   ``activation(op=nl.reciprocal)``.
3. Each (Sq, Bk) probability block (bf16) is transposed to (Bk, Sq) and multiplied with its value
   block, accumulating (Sq, D) in one PSUM tile.
4. out = acc * (1 / sum) + q in one ``scalar_tensor_tensor``, cast to bf16.
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _load(src, row0, rows):
    tile_sb = nl.ndarray((rows, src.shape[1]), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile_sb, src=src[nl.ds(row0, rows), :])
    return tile_sb


def _transposed(tile_sb):
    """(F, P) SBUF copy of a (P, F) bf16 tile through the Tensor engine."""
    rows, cols = tile_sb.shape
    t_psum = nl.ndarray((cols, rows), dtype=tile_sb.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=t_psum, data=tile_sb, engine=nisa.tensor_engine)
    t_sb = nl.ndarray((cols, rows), dtype=tile_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t_sb, src=t_psum)
    return t_sb


def _scores(q_sb, k, key_block):
    n_q = q_sb.shape[0]
    n_keys = k.shape[0]
    q_t_sb = _transposed(q_sb)
    scores_psum = nl.ndarray((n_q, n_keys), dtype=nl.float32, buffer=nl.psum)
    for k0 in range(0, n_keys, key_block):
        k_t_sb = _transposed(_load(k, k0, key_block))
        nisa.nc_matmul(dst=scores_psum[:, nl.ds(k0, key_block)], stationary=q_t_sb, moving=k_t_sb)
    return scores_psum


def _probabilities(scores_psum, scale):
    """(unnormalised bf16 probabilities, fp32 (Sq, 1) reciprocal row sums)."""
    n_q, n_keys = scores_psum.shape
    neg_max_sb = nl.ndarray((n_q, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max_sb, op=nl.maximum, data=scores_psum, axis=1, negate=True)
    nisa.tensor_scalar(dst=neg_max_sb, data=neg_max_sb, op0=nl.multiply, operand0=scale)
    probs_sb = nl.ndarray((n_q, n_keys), dtype=nl.bfloat16, buffer=nl.sbuf)
    row_sum_sb = nl.ndarray((n_q, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=probs_sb, op=nl.exp, data=scores_psum, bias=neg_max_sb, scale=scale, reduce_op=nl.add,
                    reduce_res=row_sum_sb, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    inv_sum_sb = nl.ndarray((n_q, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=inv_sum_sb, op=nl.reciprocal, data=row_sum_sb)
    return probs_sb, inv_sum_sb


@nki.jit
def attention_with_residual(q, k, v, key_block):
    n_q, head_dim = q.shape
    n_keys = k.shape[0]
    out = nl.ndarray((n_q, head_dim), dtype=q.dtype, buffer=nl.shared_hbm)
    q_sb = _load(q, 0, n_q)
    probs_sb, inv_sum_sb = _probabilities(_scores(q_sb, k, key_block), 1.0 / head_dim ** 0.5)
    acc_psum = nl.ndarray((n_q, head_dim), dtype=nl.float32, buffer=nl.psum)
    for k0 in range(0, n_keys, key_block):
        probs_t_sb = _transposed(probs_sb[:, nl.ds(k0, key_block)])
        nisa.nc_matmul(dst=acc_psum, stationary=probs_t_sb, moving=_load(v, k0, key_block))
    out_sb = nl.ndarray((n_q, head_dim), dtype=q.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=out_sb, data=acc_psum, op0=nl.multiply, operand0=inv_sum_sb,
                              op1=nl.add, operand1=q_sb)
    nisa.dma_copy(dst=out, src=out_sb)
    return out
