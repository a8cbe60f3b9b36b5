"""End-to-end test kernels written exactly as real NKI kernels are (``import nki``).

This module is imported by the ``nki_style_kernels`` fixture after
``nki_lib.simulator.install_as_nki()``; nothing in it refers to nki_lib, so it runs unchanged on
the real ``nki`` package.

Dimension legend: M, N output rows/columns, K contraction, R rows, C columns, S sequence,
D feature, P = nl.tile_size.pmax partitions per tile.
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def tiled_matmul(a_t, b):
    """out (M, N) fp32 = a_t.T @ b for a_t (K, M), b (K, N) in HBM.

    Loops: M in tiles of pmax (stationary free), N in tiles of gemm_moving_fmax, K in tiles of
    pmax accumulated in one PSUM tile per (m, n) (auto accumulate: the PSUM tile is allocated
    inside the (m, n) body, so each output tile starts a fresh accumulation group).
    Limits: M % pmax == 0, N % gemm_moving_fmax == 0, K % pmax == 0.
    """
    K, M = a_t.shape
    _, N = b.shape
    tile_m = nl.tile_size.gemm_stationary_fmax
    tile_n = nl.tile_size.gemm_moving_fmax
    tile_k = nl.tile_size.pmax
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // tile_m):
        for n in nl.affine_range(N // tile_n):
            acc_psum = nl.ndarray((tile_m, tile_n), dtype=nl.float32, buffer=nl.psum)
            for k in nl.sequential_range(K // tile_k):
                a_sb = nl.ndarray((tile_k, tile_m), dtype=a_t.dtype, buffer=nl.sbuf)
                b_sb = nl.ndarray((tile_k, tile_n), dtype=b.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a_sb, src=a_t[nl.ds(k * tile_k, tile_k), nl.ds(m * tile_m, tile_m)])
                nisa.dma_copy(dst=b_sb, src=b[nl.ds(k * tile_k, tile_k), nl.ds(n * tile_n, tile_n)])
                nisa.nc_matmul(dst=acc_psum, stationary=a_sb, moving=b_sb)
            out_sb = nl.ndarray((tile_m, tile_n), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out_sb, src=acc_psum)
            nisa.dma_copy(dst=out[nl.ds(m * tile_m, tile_m), nl.ds(n * tile_n, tile_n)], src=out_sb)
    return out


@nki.jit
def row_softmax(x):
    """out (R, C) = softmax of each row of x (R, C), fp32 math.

    Per row tile of up to pmax rows: row max (VectorE, negated), exp(x - max) with the row sum
    in the same ScalarE instruction, reciprocal of the sum, scale. Limits: C * 4 bytes per
    partition must fit SBUF.
    """
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    pmax = nl.tile_size.pmax
    for r0 in range(0, R, pmax):
        rows = min(pmax, R - r0)
        x_sb = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x[r0:r0 + rows, :])
        neg_max = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=x_sb, axis=1, negate=True)
        exp_sb = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
        row_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=exp_sb, op=nl.exp, data=x_sb, bias=neg_max, reduce_op=nl.add,
                        reduce_res=row_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv_sum, data=row_sum)
        y_sb = nl.ndarray((rows, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sb, data=exp_sb, op0=nl.multiply, operand0=inv_sum)
        nisa.dma_copy(dst=out[r0:r0 + rows, :], src=y_sb)
    return out


@nki.jit
def blocked_transpose(x):
    """out (C, R) = x.T for x (R, C), through the TensorE transpose in pmax x pmax blocks.

    Each block goes SBUF -> nc_transpose (TensorE, PSUM, same dtype) -> tensor_copy -> HBM.
    Limits: R % pmax == 0 and C % pmax == 0.
    """
    R, C = x.shape
    pmax = nl.tile_size.pmax
    out = nl.ndarray((C, R), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in range(R // pmax):
        for j in range(C // pmax):
            block_sb = nl.ndarray((pmax, pmax), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=block_sb, src=x[nl.ds(i * pmax, pmax), nl.ds(j * pmax, pmax)])
            block_t_psum = nl.ndarray((pmax, pmax), dtype=x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=block_t_psum, data=block_sb, engine=nisa.tensor_engine)
            block_t_sb = nl.ndarray((pmax, pmax), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=block_t_sb, src=block_t_psum)
            nisa.dma_copy(dst=out[nl.ds(j * pmax, pmax), nl.ds(i * pmax, pmax)], src=block_t_sb)
    return out


@nki.jit
def cumsum_rows(x):
    """out (S, D) fp32 = cumulative sum of x (S, D) along S (the partition axis).

    The prefix sum of sequence tile t is one PSUM accumulation group:
    ones.T @ x_u for every earlier tile u (column totals, broadcast to all rows) plus
    tri.T @ x_t with tri[k, m] = 1 if k <= m (built with memset + affine_select).
    Limits: S % pmax == 0, D <= gemm_moving_fmax, x bf16/fp16 (exact integer sums < 2**24).
    """
    S, D = x.shape
    pmax = nl.tile_size.pmax
    out = nl.ndarray((S, D), dtype=nl.float32, buffer=nl.shared_hbm)
    ones_sb = nl.ndarray((pmax, pmax), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones_sb, value=1.0)
    tri_sb = nl.ndarray((pmax, pmax), dtype=x.dtype, buffer=nl.sbuf)
    # keep (partition k, column m) where m - k >= 0
    nisa.affine_select(tri_sb, pattern=[[1, pmax]], channel_multiplier=-1, on_true_tile=ones_sb,
                       on_false_value=0.0, cmp_op=nl.greater_equal, offset=0)
    x_tiles = []
    for t in range(S // pmax):
        x_sb = nl.ndarray((pmax, D), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x[nl.ds(t * pmax, pmax), :])
        x_tiles.append(x_sb)
        acc_psum = nl.ndarray((pmax, D), dtype=nl.float32, buffer=nl.psum)
        for u in range(t):
            nisa.nc_matmul(dst=acc_psum, stationary=ones_sb, moving=x_tiles[u])
        nisa.nc_matmul(dst=acc_psum, stationary=tri_sb, moving=x_sb)
        out_sb = nl.ndarray((pmax, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sb, src=acc_psum)
        nisa.dma_copy(dst=out[nl.ds(t * pmax, pmax), :], src=out_sb)
    return out


@nki.jit
def lnc_split_rows(x):
    """(doubled, swapped), both (R, C): doubled = 2 * x; swapped = doubled with the row halves of
    the programs exchanged (program i reads the half program 1 - i wrote, after core_barrier).

    Work split on program_id: with n = num_programs programs, program i owns rows
    [i * R / n, (i + 1) * R / n). Limits: R / n <= pmax.
    """
    R, C = x.shape
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    rows = R // n_prog
    peer = n_prog - 1 - pid
    doubled = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    swapped = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((rows, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x[nl.ds(pid * rows, rows), :])
    y_sb = nl.ndarray((rows, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.activation(dst=y_sb, op=nl.copy, data=x_sb, scale=2.0)
    nisa.dma_copy(dst=doubled[nl.ds(pid * rows, rows), :], src=y_sb)
    nisa.core_barrier(doubled, (0, 1))
    peer_sb = nl.ndarray((rows, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=peer_sb, src=doubled[nl.ds(peer * rows, rows), :])
    nisa.dma_copy(dst=swapped[nl.ds(pid * rows, rows), :], src=peer_sb)
    return doubled, swapped


@nki.jit
def lnc_exchange(x):
    """out (2 * R, C): program i sends its tile x[i] (R, C) to program 1 - i with sendrecv and
    stores what it received at rows [i * R, (i + 1) * R). Needs LNC2 (two programs)."""
    _, R, C = x.shape
    pid = nl.program_id(axis=0)
    out = nl.ndarray((2 * R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    mine_sb = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine_sb, src=x[pid])
    theirs_sb = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=mine_sb, dst=theirs_sb, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    nisa.dma_copy(dst=out[nl.ds(pid * R, R), :], src=theirs_sb)
    return out


@nki.jit
def attention_tile(q, k, v):
    """out (Sq, D) = softmax(q @ k.T / sqrt(D)) @ v for one query tile, flash-style.

    q (Sq, D), k (Sk, D), v (Sk, D) fp32 in HBM; Sq <= pmax, D <= pmax, Sk % pmax == 0.
    Loop over key blocks of pmax rows with an online softmax: scores = qT.T @ kT_blk (TensorE,
    PSUM), running row max m and row sum l (VectorE/ScalarE), probabilities transposed through
    TensorE, acc = acc * exp(m_old - m_new) + p @ v_blk; out = acc / l.
    """
    Sq, D = q.shape
    Sk, _ = k.shape
    pmax = nl.tile_size.pmax
    scale = 1.0 / (D ** 0.5)
    out = nl.ndarray((Sq, D), dtype=q.dtype, buffer=nl.shared_hbm)

    q_sb = nl.ndarray((Sq, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=q_sb, src=q)
    q_t_psum = nl.ndarray((D, Sq), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=q_t_psum, data=q_sb, engine=nisa.tensor_engine)
    q_t_sb = nl.ndarray((D, Sq), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=q_t_sb, op=nl.copy, data=q_t_psum, scale=scale)   # fold 1/sqrt(D) into q

    row_max = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
    row_sum = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
    acc_sb = nl.ndarray((Sq, D), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=row_max, value=-3.0e38)
    nisa.memset(dst=row_sum, value=0.0)
    nisa.memset(dst=acc_sb, value=0.0)
    for blk in range(Sk // pmax):
        k_sb = nl.ndarray((pmax, D), dtype=nl.float32, buffer=nl.sbuf)
        v_sb = nl.ndarray((pmax, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=k_sb, src=k[nl.ds(blk * pmax, pmax), :])
        nisa.dma_copy(dst=v_sb, src=v[nl.ds(blk * pmax, pmax), :])
        k_t_psum = nl.ndarray((D, pmax), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=k_t_psum, data=k_sb, engine=nisa.tensor_engine)
        k_t_sb = nl.ndarray((D, pmax), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=k_t_sb, src=k_t_psum)
        scores_psum = nl.ndarray((Sq, pmax), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=scores_psum, stationary=q_t_sb, moving=k_t_sb)

        blk_max = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=blk_max, op=nl.maximum, data=scores_psum, axis=1)
        new_max = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=new_max, data1=row_max, data2=blk_max, op=nl.maximum)
        neg_max = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg_max, data=new_max, op0=nl.multiply, operand0=-1.0)
        correction = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=correction, op=nl.exp, data=row_max, bias=neg_max)
        nisa.tensor_copy(dst=row_max, src=new_max)

        probs_sb = nl.ndarray((Sq, pmax), dtype=nl.float32, buffer=nl.sbuf)
        blk_sum = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=probs_sb, op=nl.exp, data=scores_psum, bias=neg_max, reduce_op=nl.add,
                        reduce_res=blk_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.scalar_tensor_tensor(dst=row_sum, data=row_sum, op0=nl.multiply, operand0=correction,
                                  op1=nl.add, operand1=blk_sum)

        probs_t_psum = nl.ndarray((pmax, Sq), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=probs_t_psum, data=probs_sb, engine=nisa.tensor_engine)
        probs_t_sb = nl.ndarray((pmax, Sq), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=probs_t_sb, src=probs_t_psum)
        pv_psum = nl.ndarray((Sq, D), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=pv_psum, stationary=probs_t_sb, moving=v_sb)
        nisa.scalar_tensor_tensor(dst=acc_sb, data=acc_sb, op0=nl.multiply, operand0=correction,
                                  op1=nl.add, operand1=pv_psum)

    inv_sum = nl.ndarray((Sq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv_sum, data=row_sum)
    out_sb = nl.ndarray((Sq, D), dtype=q.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out_sb, data=acc_sb, op0=nl.multiply, operand0=inv_sum)
    nisa.dma_copy(dst=out, src=out_sb)
    return out
