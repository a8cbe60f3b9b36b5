"""Two-core (LNC2) kernels: ordering shared HBM with ``core_barrier`` and exchanging tiles with
``sendrecv`` (written for this project).

* ``swap_column_halves(x, block)``: out = x with its left and right column halves exchanged.
  Dimension legend: R rows (a multiple of ``block``), C columns (even), n programs. Program i
  owns column half i of every row block (one program owns both at LNC1). Per block (a
  ``sequential_range``): each owned half is copied into a one-block ``stage`` tensor in
  ``shared_hbm``; ``core_barrier`` makes both writes visible; the program then reads the other
  half from ``stage`` and writes it into its own half of ``out``; a second barrier keeps the next
  block's writes from overtaking the peer's reads of ``stage``. Limits: block <= pmax.
* ``barrier_on_one_core(x)``: calls ``core_barrier(out, (0))``, i.e. ``cores=0``; the docs accept
  only ``cores=(0, 1)``, so it must be refused.
* ``rms_normalize_split_hidden(x, eps)``: y = x / sqrt(mean(x**2, axis=1) + eps) for x (T, D),
  with D split between the programs. Each program reduces the squares of its D / n columns
  (``activation_reduce``), the two partial sums are exchanged with ``sendrecv`` on the GpSimd DMA
  queue and added, rstd = rsqrt(sum / D + eps) is one ``activation`` with ``scale=1/D`` and an
  immediate ``bias=eps``, and each program scales and stores its columns. Token tiles of up to
  pmax rows. Limits: D % n == 0, fp32.
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def swap_column_halves(x, block):
    n_rows, n_cols = x.shape
    half = n_cols // 2
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    owned = (0, 1) if n_prog == 1 else (pid,)
    out = nl.ndarray((n_rows, n_cols), dtype=x.dtype, buffer=nl.shared_hbm)
    stage = nl.ndarray((block, n_cols), dtype=x.dtype, buffer=nl.shared_hbm)
    for blk in nl.sequential_range(n_rows // block):
        rows = nl.ds(blk * block, block)
        for side in owned:
            nisa.dma_copy(dst=stage[:, nl.ds(side * half, half)], src=x[rows, nl.ds(side * half, half)])
        nisa.core_barrier(stage, (0, 1))
        for side in owned:
            other_sb = nl.ndarray((block, half), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=other_sb, src=stage[:, nl.ds((1 - side) * half, half)])
            nisa.dma_copy(dst=out[rows, nl.ds(side * half, half)], src=other_sb)
        nisa.core_barrier(stage, (0, 1))
    return out


@nki.jit
def barrier_on_one_core(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    nisa.core_barrier(out, (0))  # rejected: cores must be (0, 1)
    return out


def _row_rstd(x_sb, dim, eps, n_prog, pid):
    """(rows, 1) fp32 rsqrt(sum of squares over all D columns / D + eps)."""
    rows = x_sb.shape[0]
    squares_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
    partial_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=squares_sb, op=nl.square, data=x_sb, reduce_op=nl.add, reduce_res=partial_sb)
    if n_prog == 2:
        peer_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=partial_sb, dst=peer_sb, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0,
                      dma_engine=nisa.dma_engine.gpsimd_dma)
        nisa.tensor_tensor(dst=partial_sb, data1=partial_sb, data2=peer_sb, op=nl.add)
    rstd_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd_sb, op=nl.rsqrt, data=partial_sb, scale=1.0 / dim, bias=eps)
    return rstd_sb


@nki.jit
def rms_normalize_split_hidden(x, eps):
    n_tokens, dim = x.shape
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    width = dim // n_prog
    cols = nl.ds(pid * width, width)
    out = nl.ndarray((n_tokens, dim), dtype=x.dtype, buffer=nl.shared_hbm)
    pmax = nl.tile_size.pmax
    for t0 in range(0, n_tokens, pmax):
        span = min(pmax, n_tokens - t0)
        rows = nl.ds(t0, span)
        x_sb = nl.ndarray((span, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x[rows, cols])
        rstd_sb = _row_rstd(x_sb, dim, eps, n_prog, pid)
        y_sb = nl.ndarray(x_sb.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=rstd_sb)
        nisa.dma_copy(dst=out[rows, cols], src=y_sb)
    return out
