"""MoE router forward: logits, scores, (group-limited) top-k selection, gathered weights.

Algorithm (docs/contract.md §4.1, per token tile of <= pmax tokens):
  1. ``logits = x @ weight.T``: ``nc_matmul(stationary = x^T (H chunk, T tile), moving = weight^T
     (H chunk, E chunk <= gemm_moving_fmax))`` accumulating over H chunks in one fp32 PSUM bank,
     evicted to an fp32 SBUF tile. ``weight^T`` is built once (TensorE transposes) and stays in SBUF;
     ``x^T`` is built per token tile the same way.
  2. ``scores = softmax(logits)`` (ScalarE exp with -rowmax bias and fp32 row sum, VectorE
     reciprocal) or ``sigmoid(logits)``.
  3. ``key = scores + expert_bias`` (bias row broadcast to all partitions by a stride-0 DMA);
     padding columns E..W-1 hold NEG_BIG; NaN keys become +FLT_MAX (NaN inputs still give
     valid ids, NaN experts first, like a stable descending sort). With num_groups > 1,
     ``moe_router_steps.group_limit``.
  4. ``topk_ids``: ``moe_router_steps.select_topk`` (max8 + nc_find_index8 rounds, ties to lower id).
  5. ``topk_weights[:, j] = scores[:, ids[:, j]]`` (range_select gather), divided by their row sum
     (VectorE reciprocal + multiply) when renormalizing.

Loop structure:  for each E row block (pmax): load weight rows, transpose into weight^T
                 broadcast the bias rows once
                 for each token tile (pmax):   issue the next tile's x load, transpose this tile's x,
                                               matmul per E chunk, steps 2-5 (the x DMA of tile i+1
                                               runs under tile i's work; docs/perf-log.md §8.3)
LNC2 (``NEURON_LOGICAL_NC_CONFIG=2``): the two NeuronCores take alternate token tiles (disjoint
output rows); each builds its own weight^T.

Shapes: x (T, H), weight (E, H), expert_bias (E,) fp32 or None -> logits (T, E) fp32,
topk_weights (T, k) fp32, topk_ids (T, k) int32. T tokens (any >= 1), H hidden, E experts, k top_k.

Limits: x and weight share one dtype (bf16 / fp16 / fp32); E <= FIND8_MAX_FREE; SBUF holds
weight^T (H x E) plus two token tiles of x (checked by the launcher against ``sbuf_fmax_bytes``).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nki, nl
from nki_lib.backend import lnc_degree
from nki_lib.dispatch import KernelLaunch
from nki_lib.moe.kernels import moe_router_steps as rc
from nki_lib.sizes import FP32_BYTES, ceil_div

_FP32_TILES_PER_EXPERT = 6        # logits, scores, key, bias rows, range_select scratch, NaN mask (u8)


@nki.jit
def moe_router_fwd_kernel(x, weight, expert_bias, top_k, score_func, renormalize, num_groups, topk_groups):
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    pmax = nl.tile_size.pmax
    n_chunk = nl.tile_size.gemm_moving_fmax
    h_tiles = ceil_div(hidden, pmax)
    width = rc.padded_width(num_experts)

    logits = nl.ndarray((num_tokens, num_experts), dtype=nl.float32, buffer=nl.shared_hbm)
    topk_weights = nl.ndarray((num_tokens, top_k), dtype=nl.float32, buffer=nl.shared_hbm)
    topk_ids = nl.ndarray((num_tokens, top_k), dtype=nl.int32, buffer=nl.shared_hbm)

    # weight^T (H chunk on partitions, chunk index, E): resident for all token tiles
    weight_t = nl.ndarray((pmax, h_tiles, num_experts), dtype=weight.dtype, buffer=nl.sbuf)
    for ei in range(ceil_div(num_experts, pmax)):
        e0 = ei * pmax
        ec = min(pmax, num_experts - e0)
        w_rows = nl.ndarray((pmax, hidden), dtype=weight.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_rows[:ec, :], src=weight[e0:e0 + ec, :])
        rc.load_transposed(weight_t, w_rows, ec, hidden, weight.dtype, dst_col0=e0)

    # the bias row broadcast to the largest token tile, once
    tile_rows = min(pmax, num_tokens)
    if expert_bias is not None:
        bias_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias_sb[:tile_rows, :], src=expert_bias.ap([[0, tile_rows], [1, num_experts]], offset=0))

    tiles = list(rc.program_tiles(ceil_div(num_tokens, pmax)))
    x_next = _load_x_tile(x, tiles[0], num_tokens) if tiles else None
    for i, ti in enumerate(tiles):
        t0 = ti * pmax
        rows = min(pmax, num_tokens - t0)
        x_sb = x_next                     # the next tile's x is issued before this tile's work
        x_next = _load_x_tile(x, tiles[i + 1], num_tokens) if i + 1 < len(tiles) else None
        x_t = nl.ndarray((pmax, h_tiles, pmax), dtype=x.dtype, buffer=nl.sbuf)
        rc.load_transposed(x_t, x_sb, rows, hidden, x.dtype)

        # 1. logits (fp32 PSUM accumulation over H chunks), one PSUM bank per E chunk
        logits_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        rc.row_matmul(logits_sb, x_t, weight_t, rows, hidden, num_experts, n_chunk)
        nisa.dma_copy(dst=logits[t0:t0 + rows, :], src=logits_sb[:rows, :])

        # 2. scores
        scores_sb = nl.ndarray((pmax, num_experts), dtype=nl.float32, buffer=nl.sbuf)
        rc.router_scores(scores_sb, logits_sb, rows, num_experts, score_func)

        # 3. selection key (+ bias, + group limit); padding columns never win
        key_sb = nl.ndarray((pmax, width), dtype=nl.float32, buffer=nl.sbuf)
        if width > num_experts:
            nisa.memset(dst=key_sb[:rows, num_experts:width], value=rc.NEG_BIG)
        if expert_bias is None:
            nisa.tensor_copy(dst=key_sb[:rows, :num_experts], src=scores_sb[:rows, :])
        else:
            nisa.tensor_tensor(dst=key_sb[:rows, :num_experts], data1=scores_sb[:rows, :], data2=bias_sb[:rows, :],
                               op=nl.add)
        rc.nan_keys_to_top(key_sb, rows, num_experts)
        if num_groups > 1:
            rc.group_limit(key_sb, rows, num_experts, num_groups, topk_groups)

        # 4. top-k ids (fp32 while on chip; exact small integers)
        ids_f = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
        rc.select_topk(ids_f, key_sb, rows, width, top_k)
        ids_i = nl.ndarray((pmax, top_k), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ids_i[:rows, :], src=ids_f[:rows, :])
        nisa.dma_copy(dst=topk_ids[t0:t0 + rows, :], src=ids_i[:rows, :])

        # 5. gathered (renormalized) weights
        weights_sb = nl.ndarray((pmax, top_k), dtype=nl.float32, buffer=nl.sbuf)
        rc.gather_columns(weights_sb, scores_sb, ids_f, rows, num_experts, top_k)
        if renormalize:
            total = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            inv_total = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=total[:rows], op=nl.add, data=weights_sb[:rows, :], axis=1)
            nisa.reciprocal(dst=inv_total[:rows], data=total[:rows])
            nisa.tensor_scalar(dst=weights_sb[:rows, :], data=weights_sb[:rows, :], op0=nl.multiply,
                               operand0=inv_total[:rows])
        nisa.dma_copy(dst=topk_weights[t0:t0 + rows, :], src=weights_sb[:rows, :])
    return logits, topk_weights, topk_ids


def sbuf_bytes_fwd(hidden: int, num_experts: int, itemsize: int) -> int:
    """Per-partition SBUF bytes the forward keeps live (upper bound)."""
    pmax = nl.tile_size.pmax
    h_tiles = ceil_div(hidden, pmax)
    width = rc.padded_width(num_experts)
    resident = h_tiles * num_experts * itemsize                      # weight^T
    per_tile = 3 * hidden * itemsize + h_tiles * pmax * itemsize    # x (this and the next tile), weight rows, x^T
    return resident + per_tile + _FP32_TILES_PER_EXPERT * width * FP32_BYTES


def check_supported(x, weight):
    """Raise ``Unsupported`` (before any launch) for what the router kernel cannot serve."""
    rc.check_supported(weight, sbuf_bytes_fwd(weight.shape[1], weight.shape[0], x.element_size()), "router")


def launch_moe_router_fwd(x, weight, expert_bias, *, top_k, score_func, renormalize, num_groups, topk_groups):
    """The launch of the forward kernel; it returns ``(logits, topk_weights, topk_ids)``."""
    check_supported(x, weight)
    bias = None if expert_bias is None else expert_bias.contiguous()
    return KernelLaunch(moe_router_fwd_kernel,
                        (x.contiguous(), weight.contiguous(), bias, top_k, score_func, renormalize, num_groups,
                         topk_groups),
                        grid=lnc_degree())


def _load_x_tile(x, ti, num_tokens):
    """x rows of token tile ``ti`` into a fresh SBUF tile (pmax, H)."""
    pmax = nl.tile_size.pmax
    t0 = ti * pmax
    rows = min(pmax, num_tokens - t0)
    x_sb = nl.ndarray((pmax, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb[:rows, :], src=x[t0:t0 + rows, :])
    return x_sb
