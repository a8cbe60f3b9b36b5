"""RMS and layer normalisation of the AWS NKI Library's MLP (context encoding), re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/mlp/mlp_cte/mlp_cte_norm.py
(``apply_rms_norm_to_source_tensor_tile``, ``apply_layer_norm_to_source_tensor_tile``), Copyright
Amazon.com, Apache-2.0. Re-typed by hand with the same instruction sequence and arguments (not
copied verbatim); comments are ours. Replaced: the MLP parameter / tile-info objects by plain
arguments, the library's ``allocate`` callback by ``nl.ndarray``, and its shapes
``(nl.par_dim(P), H)`` by ``(P, H)`` (``nl.par_dim`` is a legacy-API name that nki-api.md does not
list). ``rms_norm_kernel`` / ``layer_norm_kernel`` are our test entry points.

RMS: ``activation_reduce(square, reduce_op=add)`` gives sum(x^2) per row; ``activation(rsqrt,
bias=eps, scale=1/H)`` gives 1/sqrt(mean + eps); ``activation(copy, scale=<(P,1) tile>)`` scales x.
Layer: ``bn_stats`` per bn_stats_fmax chunk, ``bn_aggr`` -> (mean, var), ``activation(rsqrt,
bias=eps)``, ``tensor_scalar((x - mean) * rstd)`` with two (P,1) operands on the Vector engine.
Shapes: x [R, H] -> out [R, H], R <= 128. Limits: fp32 here.
"""

import nki
import nki.isa as nisa
import nki.language as nl

BN_STATS_ELEMENTS_PER_TILE = 6
BN_AGGR_ELEMENTS_PER_TILE = 2


def _load_with_vectors(x, epsilon):
    rows, hidden = x.shape
    x_sb = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    zero_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    eps_vector = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero_bias, value=0.0)
    nisa.memset(dst=eps_vector, value=epsilon)
    return x_sb, zero_bias, eps_vector


def _store(x_out_sb):
    out = nl.ndarray(x_out_sb.shape, dtype=x_out_sb.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x_out_sb)
    return out


@nki.jit
def rms_norm_kernel(x, epsilon):
    rows, hidden = x.shape
    source_tile_sbuf, bias_vector, eps_vector = _load_with_vectors(x, epsilon)
    square_result_sbuf = nl.ndarray((rows, hidden), dtype=nl.float32, buffer=nl.sbuf)
    square_accum_result = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    output_tile_sbuf = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)

    nisa.activation_reduce(dst=square_result_sbuf[0:rows, 0:hidden], op=nl.square,
                           data=source_tile_sbuf[0:rows, 0:hidden], reduce_op=nl.add,
                           reduce_res=square_accum_result[0:rows, 0:1], bias=bias_vector[0:rows, 0:1])
    nisa.activation(dst=square_accum_result[0:rows, 0:1], op=nl.rsqrt, data=square_accum_result[0:rows, 0:1],
                    bias=eps_vector[0:rows, 0:1], scale=float(1.0 / hidden))
    nisa.activation(dst=output_tile_sbuf[0:rows, 0:hidden], op=nl.copy, data=source_tile_sbuf[0:rows, 0:hidden],
                    scale=square_accum_result[0:rows, 0:1], bias=bias_vector[0:rows, 0:1])
    return _store(output_tile_sbuf)


@nki.jit
def layer_norm_kernel(x, epsilon):
    rows, hidden = x.shape
    source_tile_sbuf, _, eps_vector = _load_with_vectors(x, epsilon)
    tile = nl.tile_size.bn_stats_fmax
    tile_count = (hidden + tile - 1) // tile
    bn_stats_result_sbuf = nl.ndarray((rows, tile_count * BN_STATS_ELEMENTS_PER_TILE), dtype=nl.float32,
                                      buffer=nl.sbuf)
    bn_aggr_result = nl.ndarray((rows, BN_AGGR_ELEMENTS_PER_TILE), dtype=nl.float32, buffer=nl.sbuf)
    output_tile_sbuf = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.sbuf)

    for hidden_tile_idx in range(tile_count):
        f_hidden_size = min(tile, hidden - hidden_tile_idx * tile)
        nisa.bn_stats(dst=bn_stats_result_sbuf[0:rows, nl.ds(hidden_tile_idx * BN_STATS_ELEMENTS_PER_TILE,
                                                             BN_STATS_ELEMENTS_PER_TILE)],
                      data=source_tile_sbuf[:rows, nl.ds(hidden_tile_idx * tile, f_hidden_size)])
    nisa.bn_aggr(dst=bn_aggr_result[0:rows, 0:BN_AGGR_ELEMENTS_PER_TILE],
                 data=bn_stats_result_sbuf[0:rows, 0:tile_count * BN_STATS_ELEMENTS_PER_TILE])
    nisa.activation(dst=bn_aggr_result[0:rows, 1:2], op=nl.rsqrt, data=bn_aggr_result[0:rows, 1:2],
                    bias=eps_vector[0:rows, 0:1])
    nisa.tensor_scalar(dst=output_tile_sbuf[0:rows, 0:hidden], data=source_tile_sbuf[0:rows, 0:hidden],
                       op0=nl.subtract, op1=nl.multiply, operand0=bn_aggr_result[0:rows, 0:1],
                       operand1=bn_aggr_result[0:rows, 1:2], engine=nisa.vector_engine)
    return _store(output_tile_sbuf)
