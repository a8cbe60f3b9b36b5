"""Rotary position embedding on interleaved feature pairs (written for this project).

``rotary_embedding(x, cos, sin, relayout_by_matmul)``: x (T, D) holds feature pairs
(x[t, 2i], x[t, 2i + 1]); each pair is rotated by the angle whose cosine and sine are
cos[t, i], sin[t, i]: out[t, 2i] = x[t, 2i] c - x[t, 2i + 1] s, out[t, 2i + 1] = x[t, 2i + 1] c +
x[t, 2i] s. Dimension legend: T tokens, D features (even), H = D / 2 pairs, n programs (LNC).

Algorithm: program i owns T / n consecutive tokens, processed in tiles of up to pmax tokens on
partitions. Each tile is first brought to the "halves" layout [even features | odd features]:
* DMA path: two HBM reads with stride-2 ``.ap()`` patterns (offsets 0 and 1);
* matmul path: a contiguous load, a TensorE ``nc_transpose`` to (D, rows) in PSUM evicted with
  ``activation(op=nl.copy)``, then one ``nc_matmul`` against a (D, D) permutation whose columns
  are the even then the odd columns of an identity. The identity is trace-time data
  (``nki.tensor.identity``) placed in HBM by ``nl.shared_constant`` and read back with stride-2
  ``.ap()`` patterns.
The cosines (and sines) are read once per half with a stride-0 ``.ap()`` dim, giving [c | c] and
[s | s]; the first sine half is negated. The partner of every feature, [odd | even], is an
``.ap()`` view of the halves tile with a negative stride. Then y = halves * [c | c] + partner *
[-s | s], written back interleaved with stride-2 ``.ap()`` destinations. Limits: rows per tile
<= pmax, D <= pmax on the matmul path, fp32.
"""

import nki
import nki.isa as nisa
import nki.language as nl
import nki.tensor as ntensor


def _pairs(tensor, row0, rows, parity):
    """HBM view of the even (parity 0) or odd (parity 1) features of rows [row0, row0 + rows)."""
    dim = tensor.shape[1]
    return tensor.ap([[dim, rows], [2, dim // 2]], offset=row0 * dim + parity)


def _halves_by_dma(x, row0, rows):
    dim = x.shape[1]
    halves_sb = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf)
    for parity in (0, 1):
        nisa.dma_copy(dst=halves_sb[:, nl.ds(parity * (dim // 2), dim // 2)], src=_pairs(x, row0, rows, parity))
    return halves_sb


def _pair_split_permutation(dim):
    """(D, D) SBUF matrix whose column j selects feature 2j (j < H) or 2(j - H) + 1 (j >= H)."""
    eye_hbm = nl.shared_constant(ntensor.identity(dim, dtype=nl.float32))
    perm_sb = nl.ndarray((dim, dim), dtype=nl.float32, buffer=nl.sbuf)
    for parity in (0, 1):
        nisa.dma_copy(dst=perm_sb[:, nl.ds(parity * (dim // 2), dim // 2)], src=_pairs(eye_hbm, 0, dim, parity))
    return perm_sb


def _evict(src_psum):
    dst_sb = nl.ndarray(src_psum.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=dst_sb, op=nl.copy, data=src_psum)
    return dst_sb


def _halves_by_matmul(x, row0, rows, perm_sb):
    dim = x.shape[1]
    x_sb = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x[nl.ds(row0, rows), :])
    x_t_psum = nl.ndarray((dim, rows), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=x_t_psum, data=x_sb, engine=nisa.tensor_engine)
    halves_psum = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=halves_psum, stationary=_evict(x_t_psum), moving=perm_sb)
    return _evict(halves_psum)


def _twice(table, row0, rows):
    """(rows, 2, H) SBUF tile [table rows | table rows] read with a stride-0 dim."""
    half = table.shape[1]
    both_sb = nl.ndarray((rows, 2, half), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=both_sb, src=table.ap([[half, rows], [0, 2], [1, half]], offset=row0 * half))
    return both_sb


def _rotate(halves_sb, cos, sin, row0, rows):
    dim = halves_sb.shape[1]
    half = dim // 2
    cos_sb = _twice(cos, row0, rows)
    sin_sb = _twice(sin, row0, rows)
    nisa.tensor_scalar(dst=sin_sb[:, 0, :], data=sin_sb[:, 0, :], op0=nl.multiply, operand0=-1.0)
    partner = halves_sb.ap([[dim, rows], [-half, 2], [1, half]], offset=half)   # [odd | even]
    rot_sb = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=rot_sb, data1=halves_sb, data2=cos_sb, op=nl.multiply)
    cross_sb = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=cross_sb, data1=partner, data2=sin_sb, op=nl.multiply)
    nisa.tensor_tensor(dst=rot_sb, data1=rot_sb, data2=cross_sb, op=nl.add)
    return rot_sb


@nki.jit
def rotary_embedding(x, cos, sin, relayout_by_matmul):
    tokens, dim = x.shape
    half = dim // 2
    per_program = tokens // nl.num_programs(axes=0)
    first = nl.program_id(axis=0) * per_program
    out = nl.ndarray((tokens, dim), dtype=x.dtype, buffer=nl.shared_hbm)
    perm_sb = _pair_split_permutation(dim) if relayout_by_matmul else None
    pmax = nl.tile_size.pmax
    for row0 in range(first, first + per_program, pmax):
        rows = min(pmax, first + per_program - row0)
        if relayout_by_matmul:
            halves_sb = _halves_by_matmul(x, row0, rows, perm_sb)
        else:
            halves_sb = _halves_by_dma(x, row0, rows)
        rot_sb = _rotate(halves_sb, cos, sin, row0, rows)
        for parity in (0, 1):
            nisa.dma_copy(dst=_pairs(out, row0, rows, parity), src=rot_sb[:, nl.ds(parity * half, half)])
    return out
