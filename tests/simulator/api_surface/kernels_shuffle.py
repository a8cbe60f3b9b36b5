"""Cross-partition moves inside 32-partition quadrants with ``nc_stream_shuffle`` (written for
this project).

Dimension legend: P rows (partitions, a multiple of Q = 32 unless stated), F columns, Q = 32
partitions per quadrant. Every kernel loads its (P, F) inputs into SBUF, issues shuffles and
stores a (P, F) result.

* ``mirror_quadrants(x)``: out[q*Q + i] = x[q*Q + (Q - 1 - i)]; one shuffle over all quadrants
  (the mask is applied to every quadrant of the operands).
* ``splice_rows(base, patch, quadrant, first, count)``: rows [first, first + count) of quadrant
  ``quadrant`` come from ``patch``, every other row keeps ``base`` (mask entry 255 = keep dst).
  The operands are partition slices starting at quadrant * Q. Limits: first + count <= Q.
* ``spread_row(x, src_quadrant, dst_quadrant)``: all Q rows of quadrant ``dst_quadrant`` become
  row src_quadrant * Q of x (a one-partition source and an all-zero mask); others keep x.
* ``relocate_quadrant(x, src_quadrant, dst_quadrant)``: quadrant ``dst_quadrant`` of the result
  is quadrant ``src_quadrant`` of x; no shuffle: a ``tensor_copy`` whose source and destination
  are Q-partition slices at different start partitions (partition i of one block feeds partition
  i of the other).
"""

import nki
import nki.isa as nisa
import nki.language as nl

QUADRANT = 32
KEEP = 255


def _load(x):
    x_sb = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    return x_sb


def _quadrant(t, q):
    """Partitions [q * Q, (q + 1) * Q) of an SBUF tile."""
    return t[nl.ds(q * QUADRANT, QUADRANT), :]


def _store(x_sb):
    out = nl.ndarray(x_sb.shape, dtype=x_sb.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x_sb)
    return out


@nki.jit
def mirror_quadrants(x):
    x_sb = _load(x)
    out_sb = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.nc_stream_shuffle(dst=out_sb, src=x_sb, shuffle_mask=[QUADRANT - 1 - i for i in range(QUADRANT)])
    return _store(out_sb)


@nki.jit
def splice_rows(base, patch, quadrant, first, count):
    base_sb = _load(base)
    patch_sb = _load(patch)
    mask = [i if first <= i < first + count else KEEP for i in range(QUADRANT)]
    nisa.nc_stream_shuffle(dst=_quadrant(base_sb, quadrant), src=_quadrant(patch_sb, quadrant), shuffle_mask=mask)
    return _store(base_sb)


@nki.jit
def spread_row(x, src_quadrant, dst_quadrant):
    out_sb = _load(x)
    src_row = _load(x)[nl.ds(src_quadrant * QUADRANT, 1), :]
    nisa.nc_stream_shuffle(dst=_quadrant(out_sb, dst_quadrant), src=src_row, shuffle_mask=[0] * QUADRANT)
    return _store(out_sb)


@nki.jit
def relocate_quadrant(x, src_quadrant, dst_quadrant):
    out_sb = _load(x)
    nisa.tensor_copy(dst=_quadrant(out_sb, dst_quadrant), src=_quadrant(_load(x), src_quadrant))
    return _store(out_sb)
