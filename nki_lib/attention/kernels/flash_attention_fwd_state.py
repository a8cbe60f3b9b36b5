"""Online-softmax state of the flash-attention forward kernel (``flash_attention_fwd.py``): per (query head,
query tile) the running -max ``neg_m`` (qn, 1), denominator ``l`` (qn, 1) and unnormalised
output ``acc`` (qn, D), all fp32 SBUF; their initialisation (with sinks) and the finalisation
``out = acc / max(l, 1)``, ``lse = m + log(l)`` (``-inf`` for rows with ``l = 0``, ``+inf`` for rows
whose running max is +inf, where the online softmax gives NaN: ``tiles.inf_max_rows``).

Dimension legend: qn query rows of a tile (<= 128), D head dim, n (head, query tile) pairs of
one lse batch (<= 128).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.tiles import inf_max_rows

__all__ = ["RowState", "load_sinks", "init_state", "store_out", "new_lse_batch", "add_lse", "flush_lse", "store_lse_rows"]


class RowState(nl.NKIObject):
    """Online-softmax state of one query head over one query tile (all fp32 SBUF)."""
    neg_m: object   # (qn, 1) -running max
    l: object       # (qn, 1) running denominator  # noqa: E741
    acc: object     # (qn, D) unnormalised output
    fresh: bool     # no section seen yet and no sink: l = 0, acc unset


def load_sinks(sinks, n_heads):
    """Every query head's sink on every partition, (pmax, Hq) fp32 SBUF: one DMA for the
    kernel (each partition reads one ``Hq * 4``-byte run) instead of a 4-byte read per partition
    per (head, query tile), each at the DMA chunk floor."""
    pmax = nl.tile_size.pmax
    sinks_sb = nl.ndarray((pmax, n_heads), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sinks_sb, src=sinks.ap(pattern=[[0, pmax], [1, n_heads]], offset=0))
    return sinks_sb


def init_state(sinks_sb, h, qn, d, has_sinks, zero_acc, stat_init):
    """State before the first key section (``sinks_sb``: :func:`load_sinks`, or None). acc (and l without sinks) is only zeroed
    (``zero_acc``) for a group with no visible key: otherwise the first section's update sets it
    (``flash_attention_fwd_pipeline.stage_acc``). ``fresh``: l = 0 and acc unset (no sinks), so the first
    section needs no alpha. ``stat_init``: the initial running max (``tiles.STAT_INIT``, times
    the softmax scale when the scores are kept unscaled).
    The small SBUF-only ops run on GpSimd (VectorE and ScalarE carry the per-key work)."""
    gpsimd = nisa.engine.gpsimd
    neg_m = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    l_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    if has_sinks:
        sink_sb = sinks_sb[0:qn, h:h + 1]
        nisa.tensor_scalar(dst=neg_m, data=sink_sb, op0=nl.maximum, operand0=stat_init,
                           op1=nl.multiply, operand1=-1.0, engine=gpsimd)
        nisa.activation(dst=l_sb, op=nl.exp, data=sink_sb, bias=neg_m)
    else:
        nisa.memset(dst=neg_m, value=-stat_init, engine=gpsimd)
        if zero_acc:
            nisa.memset(dst=l_sb, value=0.0, engine=gpsimd)
    acc = nl.ndarray((qn, d), dtype=nl.float32, buffer=nl.sbuf)
    if zero_acc:
        nisa.memset(dst=acc, value=0.0, engine=gpsimd)
    return RowState(neg_m=neg_m, l=l_sb, acc=acc, fresh=not has_sinks)


def store_out(state, out, b, h, q0):
    """out = acc / max(l, 1) (rows with l = 0 have acc = 0 and get 0); frees acc. All on GpSimd
    (VectorE and ScalarE carry the per-key work): 1 / l = rsqrt(l)^2, applied as
    ``acc * r * r`` in one tensor_scalar."""
    gpsimd = nisa.engine.gpsimd
    qn, d = state.acc.shape
    l_safe = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=state.l, op0=nl.maximum, operand0=1.0, engine=gpsimd)
    r_sb = nl.ndarray((qn, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=r_sb, data=l_safe, op0=nl.rsqrt, operand0=None, engine=gpsimd)
    out_sb = nl.ndarray((qn, d), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_sb, data=state.acc, op0=nl.multiply, operand0=r_sb,
                       op1=nl.multiply, operand1=r_sb, engine=gpsimd)
    nisa.dma_copy(dst=out[b, h, q0:q0 + qn, :], src=out_sb)
    state.acc = None


class LseBatch(nl.NKIObject):
    """lse statistics of up to ``size`` (head, query tile) pairs, gathered as the columns of one
    (128, size) tile pair (l, neg_m) when each group closes, finished together by
    :func:`flush_lse` (one ScalarE log per batch)."""
    lse: object            # (B, Hq, Sq) fp32 HBM output
    size: int              # pairs per batch
    l_all: object          # (128, size) fp32 denominators, or None before the first pair
    neg_m_all: object      # (128, size) fp32 -running max, or None before the first pair
    rows: list             # (qn, b, h, q0) of each queued pair


def new_lse_batch(lse, size):
    return LseBatch(lse=lse, size=size, l_all=None, neg_m_all=None, rows=[])


def add_lse(batch, state, b, h, q0, flush_full=True):
    """Queue the lse of one (head, query tile): copy its l and neg_m columns now (GpSimd), so
    that only the math is left for the flush; flushes a full batch (unless ``flush_full`` is
    False: the caller flushes it, :func:`flush_lse` with ``last``)."""
    gpsimd = nisa.engine.gpsimd
    pmax = nl.tile_size.pmax
    if batch.l_all is None:
        batch.l_all = nl.ndarray((pmax, batch.size), dtype=nl.float32, buffer=nl.sbuf)
        batch.neg_m_all = nl.ndarray((pmax, batch.size), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=batch.l_all, value=0.0, engine=gpsimd)
        nisa.memset(dst=batch.neg_m_all, value=0.0, engine=gpsimd)
    i = len(batch.rows)
    qn = state.l.shape[0]
    nisa.tensor_copy(dst=batch.l_all[0:qn, i:i + 1], src=state.l, engine=gpsimd)
    nisa.tensor_copy(dst=batch.neg_m_all[0:qn, i:i + 1], src=state.neg_m, engine=gpsimd)
    batch.rows.append((qn, b, h, q0))
    if len(batch.rows) == batch.size and flush_full:
        flush_lse(batch)


def flush_lse(batch, last=False):
    """lse = log(max(l, 1)) + m for the queued pairs; rows with l = 0 get -inf, rows with m = +inf
    get +inf (both by predicated copies of an immediate). The (128, n) result is transposed on
    TensorE so that each (head, query tile) is stored as one contiguous row (a single-partition
    DMA) instead of qn 4-byte pieces. Empties the batch. ``last``: the kernel's last batch,
    finished before the last acc update: the transpose is read out of PSUM on ScalarE (idle by
    then; VectorE still has that update) and the row stores are returned as ``(dst, src)``
    pairs for :func:`store_lse_rows` after the last outputs (the DMA queues run in program
    order), else issued now."""
    n = len(batch.rows)
    if n == 0:
        return []
    pmax = nl.tile_size.pmax
    gpsimd = nisa.engine.gpsimd
    l_all = batch.l_all[:, 0:n]
    l_safe = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=l_safe, data=l_all, op0=nl.maximum, operand0=1.0, engine=gpsimd)
    lse_all = nl.ndarray((pmax, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_all, op=nl.log, data=l_safe)
    nisa.tensor_tensor(dst=lse_all, data1=lse_all, data2=batch.neg_m_all[:, 0:n], op=nl.subtract)
    empty = nl.ndarray((pmax, n), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=empty, data=l_all, op0=nl.equal, operand0=0.0, engine=gpsimd)
    nisa.tensor_copy_predicated(dst=lse_all, src=float("-inf"), predicate=empty)
    inf_max_rows(lse_all, batch.neg_m_all[:, 0:n])
    lse_t_psum = nl.ndarray((n, pmax), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=lse_t_psum, data=lse_all, engine=nisa.engine.tensor)
    lse_t = nl.ndarray((n, pmax), dtype=nl.float32, buffer=nl.sbuf)
    if last:
        nisa.activation(dst=lse_t, op=nl.copy, data=lse_t_psum)
    else:
        nisa.tensor_copy(dst=lse_t, src=lse_t_psum)
    rows = [(batch.lse[b, h, q0:q0 + qn], lse_t[i:i + 1, 0:qn])
            for i, (qn, b, h, q0) in enumerate(batch.rows)]
    batch.l_all, batch.neg_m_all, batch.rows = None, None, []
    if last:
        return rows
    store_lse_rows(rows)
    return []


def store_lse_rows(rows):
    """Issue the lse row stores ``(dst, src)`` of :func:`flush_lse`, one single-partition DMA each."""
    for dst, src in rows:
        nisa.dma_copy(dst=dst, src=src)
