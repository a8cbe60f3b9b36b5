"""Kernels built from the tile-returning ``nki.language`` wrappers (written for this project).

* ``axpby(x, y, alpha, beta)``: out (R, C) = alpha * x + beta * y, row tiles of pmax rows, with
  ``nl.load`` / ``nl.multiply`` / ``nl.add`` / ``nl.store`` (each wrapper allocates its own SBUF
  tile). Dimension legend: R rows, C columns. Limits: C * itemsize per partition fits SBUF.
* ``private_result(x)``: returns a tensor allocated in ``nl.hbm``. Since NKI 0.3 a returned
  tensor must be ``nl.shared_hbm``, so launching it must fail.
"""

import nki
import nki.language as nl


@nki.jit
def axpby(x, y, alpha, beta):
    rows, cols = x.shape
    pmax = nl.tile_size.pmax
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    for r0 in range(0, rows, pmax):
        span = min(pmax, rows - r0)
        x_sb = nl.load(x[r0:r0 + span, :])
        y_sb = nl.load(y[r0:r0 + span, :])
        total_sb = nl.add(nl.multiply(x_sb, alpha), nl.multiply(y_sb, beta))
        nl.store(out[r0:r0 + span, :], total_sb)
    return out


@nki.jit
def private_result(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.hbm)
    nl.store(out, nl.load(x))
    return out
