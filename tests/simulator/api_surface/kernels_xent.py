"""Softmax cross-entropy per row with a streaming log-sum-exp (written for this project).

``softmax_cross_entropy(logits, labels, chunk, compute_dtype)``: for logits (N, V) fp32 and labels
(N,) int32 returns ``loss (N, 1)`` = lse - logits[n, labels[n]] and ``lse (N, 1)`` =
log(sum_v exp(logits[n, v])), both fp32. Dimension legend: N rows, V vocabulary, W = ``chunk``
columns per step, n = programs (LNC).

Algorithm: program i owns ceil(N / n) consecutive rows (the last program gets the remainder; rows
sit on partitions). The labels of those rows are loaded onto one partition; for each row one
(1, 1) DMA reads its label's logit through ``.ap(scalar_offset=label, indirect_dim=1)``. The
vocabulary is streamed in chunks of W: running max m and running sum s with
s <- s * exp(m_old - m_new) + sum(exp(x - m_new)) (``activation`` exp with a (rows, 1) bias and an
add-reduce; ``scalar_tensor_tensor`` for the rescale-and-add), m starts at -inf. Finally
lse = log(s) + m and loss = lse - picked. ``compute_dtype`` (an ``nki.dtype``) is the dtype of the
exp tile; instructions carry ``name=`` labels. Limits: rows per program <= pmax, V >= 1, labels in
[0, V).
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _column(rows, value=None):
    col_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    if value is not None:
        nisa.memset(dst=col_sb, value=value)
    return col_sb


def _label_logits(logits, labels, row0, rows):
    """(rows, 1) fp32: logits[row0 + r, labels[row0 + r]] gathered with a runtime scalar offset."""
    vocab = logits.shape[1]
    labels_sb = nl.ndarray((1, rows), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=labels_sb, src=labels[nl.ds(row0, rows)], name="load_labels")
    picked_sb = _column(rows)
    for r in range(rows):
        one_logit = logits.ap([[vocab, 1], [1, 1]], offset=(row0 + r) * vocab,
                              scalar_offset=labels_sb[0:1, r:r + 1], indirect_dim=1)
        nisa.dma_copy(dst=picked_sb[r:r + 1, 0:1], src=one_logit, name=f"gather_label_logit_{r}")
    return picked_sb


def _log_sum_exp(logits, row0, rows, chunk, compute_dtype):
    vocab = logits.shape[1]
    run_max_sb = _column(rows, -float("inf"))
    run_sum_sb = _column(rows, 0.0)
    for col0 in range(0, vocab, chunk):
        width = min(chunk, vocab - col0)
        x_sb = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=logits[nl.ds(row0, rows), nl.ds(col0, width)])
        new_max_sb = _column(rows)
        nisa.tensor_reduce(dst=new_max_sb, op=nl.maximum, data=x_sb, axis=1, name="chunk_max")
        nisa.tensor_tensor(dst=new_max_sb, data1=new_max_sb, data2=run_max_sb, op=nl.maximum)
        neg_max_sb = _column(rows)
        nisa.tensor_scalar(dst=neg_max_sb, data=new_max_sb, op0=nl.multiply, operand0=-1.0)
        rescale_sb = _column(rows)
        nisa.activation(dst=rescale_sb, op=nl.exp, data=run_max_sb, bias=neg_max_sb)
        exp_sb = nl.ndarray((rows, width), dtype=compute_dtype, buffer=nl.sbuf)
        chunk_sum_sb = _column(rows)
        nisa.activation(dst=exp_sb, op=nl.exp, data=x_sb, bias=neg_max_sb, reduce_op=nl.add,
                        reduce_res=chunk_sum_sb, reduce_cmd=nisa.reduce_cmd.reset_reduce, name="chunk_exp")
        nisa.scalar_tensor_tensor(dst=run_sum_sb, data=run_sum_sb, op0=nl.multiply, operand0=rescale_sb,
                                  op1=nl.add, operand1=chunk_sum_sb)
        nisa.tensor_copy(dst=run_max_sb, src=new_max_sb)
    lse_sb = _column(rows)
    nisa.activation(dst=lse_sb, op=nl.log, data=run_sum_sb, name="log_sum")
    nisa.tensor_tensor(dst=lse_sb, data1=lse_sb, data2=run_max_sb, op=nl.add)
    return lse_sb


@nki.jit
def softmax_cross_entropy(logits, labels, chunk, compute_dtype: nki.dtype):
    n_rows = logits.shape[0]
    n_prog = nl.num_programs(axes=0)
    per_program = (n_rows + n_prog - 1) // n_prog
    row0 = nl.program_id(axis=0) * per_program
    rows = min(per_program, n_rows - row0)
    loss = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_sb = _log_sum_exp(logits, row0, rows, chunk, compute_dtype)
    loss_sb = _column(rows)
    nisa.tensor_tensor(dst=loss_sb, data1=lse_sb, data2=_label_logits(logits, labels, row0, rows),
                       op=nl.subtract, name="loss")
    nisa.dma_copy(dst=lse[nl.ds(row0, rows), :], src=lse_sb)
    nisa.dma_copy(dst=loss[nl.ds(row0, rows), :], src=loss_sb)
    return loss, lse
