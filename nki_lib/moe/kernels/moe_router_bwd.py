"""MoE router backward: gradients to x and weight through logits and topk_weights.

Algorithm (per token tile of <= pmax tokens; s = scores, g = dtopk_weights, ids = topk_ids):
  1. Recompute ``s`` from the saved fp32 logits (softmax or sigmoid, as in the forward).
  2. Through the renormalization (if any): with ``sel = s[ids]``, ``S = sum(sel)``,
     ``g' = (g - sum(g * sel) / S) / S``; else ``g' = g``.
  3. Scatter ``g'`` into ``d_scores`` (T, E) (one-hot rows, ids distinct per token).
  4. Score Jacobian: softmax ``d = s * (d_scores - sum(d_scores * s))``; sigmoid
     ``d = d_scores * s * (1 - s)``; ``dlogits_total = d + dlogits`` (fp32), cast to the matmul
     dtype (x's dtype: TensorE pairs fp32 only with fp32).
  5. ``dx = dlogits_total @ weight``: ``nc_matmul(stationary = dlogits_total^T (E chunk, T tile),
     moving = weight rows (E chunk, H chunk <= gemm_moving_fmax))``, fp32 PSUM accumulation over E.
  6. ``dweight += dlogits_total^T @ x``: ``nc_matmul(stationary = dlogits_total (T tile, E chunk),
     moving = x (T tile, H chunk))`` per token tile, summed over tiles into an fp32 SBUF
     accumulator in a fixed order (deterministic), cast and stored after the last tile.
The selection bias and group limit do not enter: ids are given.

Loop structure:  load weight rows (E blocks of pmax) once; zero the fp32 dweight accumulator
                 for each token tile: steps 1-6
                 store dweight.
LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two NeuronCores take alternate token tiles; their
fp32 dweight partials are swapped with ``sendrecv`` per (E block, H chunk) and added (the same sum on
both cores), and each core stores alternate E blocks.

Shapes: dlogits (T, E) fp32, dtopk_weights (T, k) fp32, x (T, H), weight (E, H),
logits (T, E) fp32, topk_ids (T, k) int32 -> dx (T, H) x.dtype, dweight (E, H) weight.dtype.

Limits: SBUF holds weight (E x H) and the fp32 dweight accumulator (E x H) plus one token tile
(checked by the launcher against ``sbuf_fmax_bytes``); E <= FIND8_MAX_FREE as in the forward.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch, Unsupported
from nki_lib.moe.kernels import moe_router_steps as rc
from nki_lib.sizes import FP32_BYTES, ceil_div

_FP32_TILES_PER_EXPERT = 7        # dlogits, logits, scores, d_scores, iota, one-hot, dlogits_total


@nki.jit
def moe_router_bwd_kernel(dlogits, dtopk_weights, x, weight, logits, topk_ids, score_func, renormalize):
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    top_k = topk_ids.shape[1]
    pmax = nl.tile_size.pmax
    n_chunk = nl.tile_size.gemm_moving_fmax
    e_tiles = ceil_div(num_experts, pmax)

    dx = nl.ndarray((num_tokens, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    dweight = nl.ndarray((num_experts, hidden), dtype=weight.dtype, buffer=nl.shared_hbm)

    # weight rows (E chunk on partitions) and the fp32 dweight accumulator, resident
    weight_sb = nl.ndarray((pmax, e_tiles, hidden), dtype=weight.dtype, buffer=nl.sbuf)
    dweight_acc = nl.ndarray((pmax, e_tiles, hidden), dtype=nl.float32, buffer=nl.sbuf)
    for ei in range(e_tiles):
        e0 = ei * pmax
        ec = min(pmax, num_experts - e0)
        nisa.dma_copy(dst=weight_sb[:ec, ei, :], src=weight[e0:e0 + ec, :])
        nisa.memset(dst=dweight_acc[:ec, ei, :], value=0.0)

    iota_sb = rc.expert_iota(min(pmax, num_tokens), num_experts)
    for ti in rc.program_tiles(ceil_div(num_tokens, pmax)):
        t0 = ti * pmax
        rows = min(pmax, num_tokens - t0)
        logits_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        dlogits_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        grad_w = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
        ids_i = nl.ndarray((pmax, top_k), dtype=nl.int32, buffer=nl.sbuf)
        x_sb = nl.ndarray((pmax, hidden), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=logits_sb[:rows, :], src=logits[t0:t0 + rows, :])
        nisa.dma_copy(dst=dlogits_sb[:rows, :], src=dlogits[t0:t0 + rows, :])
        nisa.dma_copy(dst=grad_w[:rows, :], src=dtopk_weights[t0:t0 + rows, :])
        nisa.dma_copy(dst=ids_i[:rows, :], src=topk_ids[t0:t0 + rows, :])
        nisa.dma_copy(dst=x_sb[:rows, :], src=x[t0:t0 + rows, :])
        ids_f = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ids_f[:rows, :], src=ids_i[:rows, :])

        # 1. scores
        scores_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        rc.router_scores(scores_sb, logits_sb, rows, num_experts, score_func)

        # 2. through the renormalization: g' = (g - sum(g * sel) / S) / S
        if renormalize:
            selected = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
            rc.gather_columns(selected, scores_sb, ids_f, rows, num_experts, top_k)
            total = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            inv_total = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            g_dot = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            prod = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=total[:rows], op=nl.add, data=selected[:rows, :], axis=1)
            nisa.reciprocal(dst=inv_total[:rows], data=total[:rows])
            nisa.tensor_tensor(dst=prod[:rows, :], data1=grad_w[:rows, :], data2=selected[:rows, :], op=nl.multiply)
            nisa.tensor_reduce(dst=g_dot[:rows], op=nl.add, data=prod[:rows, :], axis=1)
            nisa.tensor_tensor(dst=g_dot[:rows], data1=g_dot[:rows], data2=inv_total[:rows], op=nl.multiply)
            nisa.tensor_scalar(dst=grad_w[:rows, :], data=grad_w[:rows, :], op0=nl.subtract, operand0=g_dot[:rows],
                               op1=nl.multiply, operand1=inv_total[:rows])

        # 3. d_scores = scatter(g')
        d_scores = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=d_scores[:rows, :], value=0.0)
        rc.scatter_columns(d_scores, grad_w, ids_f, iota_sb, rows, num_experts, top_k)

        # 4. score Jacobian + dlogits, fp32; then the matmul dtype
        d_total = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        if score_func == "sigmoid":
            one_minus = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=one_minus[:rows, :], data=scores_sb[:rows, :], op0=nl.multiply, operand0=-1.0,
                               op1=nl.add, operand1=1.0)
            nisa.tensor_tensor(dst=one_minus[:rows, :], data1=one_minus[:rows, :], data2=scores_sb[:rows, :],
                               op=nl.multiply)
            nisa.tensor_tensor(dst=d_total[:rows, :], data1=d_scores[:rows, :], data2=one_minus[:rows, :],
                               op=nl.multiply)
        else:
            ds_dot = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=d_total[:rows, :], data1=d_scores[:rows, :], data2=scores_sb[:rows, :],
                               op=nl.multiply)
            nisa.tensor_reduce(dst=ds_dot[:rows], op=nl.add, data=d_total[:rows, :], axis=1)
            nisa.scalar_tensor_tensor(dst=d_total[:rows, :], data=d_scores[:rows, :], op0=nl.subtract,
                                      operand0=ds_dot[:rows], op1=nl.multiply, operand1=scores_sb[:rows, :])
        nisa.tensor_tensor(dst=d_total[:rows, :], data1=d_total[:rows, :], data2=dlogits_sb[:rows, :], op=nl.add)
        d_mm = nl.ndarray((pmax, num_experts), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=d_mm[:rows, :], src=d_total[:rows, :])

        # 5. dx = d_total @ weight (contraction over E on partitions)
        d_mm_t = nl.ndarray((pmax, e_tiles, pmax), dtype=x.dtype, buffer=nl.sbuf)
        rc.load_transposed(d_mm_t, d_mm, rows, num_experts, x.dtype)
        dx_sb = nl.ndarray((pmax, hidden), dtype=x.dtype, buffer=nl.sbuf)
        rc.row_matmul(dx_sb, d_mm_t, weight_sb, rows, num_experts, hidden, n_chunk)
        nisa.dma_copy(dst=dx[t0:t0 + rows, :], src=dx_sb[:rows, :])

        # 6. dweight += d_total^T @ x (contraction over this tile's tokens on partitions)
        for ei in range(e_tiles):
            e0 = ei * pmax
            ec = min(pmax, num_experts - e0)
            for ni in range(ceil_div(hidden, n_chunk)):
                n0 = ni * n_chunk
                nc = min(n_chunk, hidden - n0)
                dw_psum = nl.ndarray((pmax, n_chunk), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=dw_psum[:ec, :nc], stationary=d_mm[:rows, e0:e0 + ec], moving=x_sb[:rows, n0:n0 + nc],
                               accumulate=False)
                nisa.tensor_tensor(dst=dweight_acc[:ec, ei, n0:n0 + nc], data1=dweight_acc[:ec, ei, n0:n0 + nc],
                                   data2=dw_psum[:ec, :nc], op=nl.add)

    n_prog, pid = nl.num_programs(axes=0), nl.program_id(axis=0)
    for ei in range(e_tiles):
        e0 = ei * pmax
        ec = min(pmax, num_experts - e0)
        if n_prog > 1:
            # LNC2: swap the partial sums with the peer core, H chunk by H chunk, and add
            # (a + b == b + a bitwise: both cores hold the same total); each core then stores
            # alternate E blocks
            n_h_chunks = ceil_div(hidden, n_chunk)
            for ni in range(n_h_chunks):
                n0 = ni * n_chunk
                nc = min(n_chunk, hidden - n0)
                peer_acc = nl.ndarray((pmax, n_chunk), dtype=nl.float32, buffer=nl.sbuf)
                nisa.sendrecv(src=dweight_acc[:ec, ei, n0:n0 + nc], dst=peer_acc[:ec, :nc], send_to_rank=1 - pid,
                              recv_from_rank=1 - pid, pipe_id=ei * n_h_chunks + ni)
                nisa.tensor_tensor(dst=dweight_acc[:ec, ei, n0:n0 + nc], data1=dweight_acc[:ec, ei, n0:n0 + nc],
                                   data2=peer_acc[:ec, :nc], op=nl.add)
        if ei % n_prog == pid:
            dw_sb = nl.ndarray((pmax, hidden), dtype=weight.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dw_sb[:ec, :], src=dweight_acc[:ec, ei, :])
            nisa.dma_copy(dst=dweight[e0:e0 + ec, :], src=dw_sb[:ec, :])
    return dx, dweight


def sbuf_bytes_bwd(hidden: int, num_experts: int, itemsize: int) -> int:
    """Per-partition SBUF bytes the backward keeps live (upper bound)."""
    pmax = nl.tile_size.pmax
    e_tiles = ceil_div(num_experts, pmax)
    resident = e_tiles * hidden * (itemsize + FP32_BYTES)            # weight rows + fp32 dweight
    resident += nl.tile_size.gemm_moving_fmax * FP32_BYTES           # LNC2 receive chunk
    per_tile = 3 * hidden * itemsize + e_tiles * pmax * itemsize     # x, dx, dweight cast, d^T
    return resident + per_tile + _FP32_TILES_PER_EXPERT * num_experts * FP32_BYTES


def check_supported(x, weight):
    """Raise ``Unsupported`` (before any launch) for what the router backward kernel cannot serve."""
    rc.check_supported(weight, sbuf_bytes_bwd(weight.shape[1], weight.shape[0], x.element_size()), "router backward")


def launch_moe_router_bwd(dlogits, dtopk_weights, x, weight, logits, topk_ids, *, score_func, renormalize):
    """The launch of the backward kernel; it returns ``(dx, dweight)``."""
    check_supported(x, weight)
    if dlogits.dtype != logits.dtype or dtopk_weights.dtype != logits.dtype:
        raise Unsupported(f"gradients must be {logits.dtype} like the router outputs, got dlogits "
                          f"{dlogits.dtype} and dtopk_weights {dtopk_weights.dtype}")
    return KernelLaunch(moe_router_bwd_kernel,
                        (dlogits.contiguous(), dtopk_weights.contiguous(), x.contiguous(), weight.contiguous(),
                         logits.contiguous(), topk_ids.contiguous(), score_func, renormalize),
                        grid=lnc_degree())
