"""Tile helpers shared by the router forward and backward kernels (plain functions, inlined).

Every helper works on one token tile: ``rows`` (<= pmax) tokens on partitions, experts along the
free dim. Shapes: T tokens, H hidden, E experts, k = top_k, G = num_groups, W = padded width
(>= TOPK_WIDTH) of a tile that ``max8`` / ``nc_find_index8`` scan.

* ``load_transposed``: an HBM row block (rows, cols) -> SBUF (cols, rows) through TensorE
  transposes of <= pmax x pmax pieces (contraction dims must sit on partitions for ``nc_matmul``).
* ``router_scores``: softmax (ScalarE exp with the negated row max as bias, fp32 row sum) or
  sigmoid of fp32 logits.
* ``select_topk``: ids of the k largest entries, descending, ties to the lower id: ``max8`` gives
  the 8 largest values, ``nc_find_index8`` their first occurrences (equal values pair with
  successive positions, so ties come out in ascending id); ``nc_match_replace8`` then pushes
  the found entries to ``NEG_BIG`` and the next 8 are found, ceil(k / 8) rounds in all.
* ``gather_columns``: ``out[:, j] = src[:, ids[:, j]]`` by a ``range_select`` that keeps column
  ``id`` only and max-reduces the row (exact; NC-v3+).
* ``scatter_columns``: ``dst[:, ids[:, j]] += vals[:, j]`` through one-hot rows ``iota == id``
  (exact: 1.0 * v + 0s).
* ``group_limit``: DeepSeek-V3 group-limited selection on the keys (group score = sum of the two
  largest keys; the ``topk_groups`` best groups stay, the others get ``NEG_BIG``).

Limits: rows <= pmax; max8 / nc_find_index8 scan 8..FIND8_MAX_FREE elements per partition
(narrower tiles are padded with NEG_BIG); ids are exact in fp32 (< 2^24); keys must stay far
above NEG_BIG (true for scores in [0, 1] plus any sane bias).
"""

from __future__ import annotations

import numpy as np

from nki_lib._nki import nisa, nl
from nki_lib.dispatch import Unsupported
from nki_lib.sizes import ceil_div

TOPK_WIDTH = 8                                   # values per max8 / nc_find_index8 (ISA)
FIND8_MAX_FREE = 16384                           # max elements per partition max8/find_index8 scan
NEG_BIG = -float(np.finfo(np.float32).max)       # key of excluded or already-selected experts


def program_tiles(n_tiles: int):
    """The token tiles this program serves: alternate tiles under LNC2, all of them under LNC1."""
    return range(nl.program_id(axis=0), n_tiles, nl.num_programs(axes=0))


def padded_width(n: int) -> int:
    """Width of a tile that max8 can scan holding ``n`` real columns."""
    return max(n, TOPK_WIDTH)


def load_transposed(dst_sb, src_sb, rows, cols, dtype, dst_col0=0):
    """``dst_sb[:cc, chunk, dst_col0:dst_col0 + rows] = src_sb[:rows, chunk cols].T`` per pmax chunk.

    ``src_sb`` (rows, cols) in SBUF; ``dst_sb`` (pmax, ceil(cols / pmax), >= dst_col0 + rows) in SBUF."""
    pmax = nl.tile_size.pmax
    for ci in range(ceil_div(cols, pmax)):
        c0 = ci * pmax
        cc = min(pmax, cols - c0)
        t_psum = nl.ndarray((pmax, pmax), dtype=dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum[:cc, :rows], data=src_sb[:rows, c0:c0 + cc], engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=dst_sb[:cc, ci, nl.ds(dst_col0, rows)], src=t_psum[:cc, :rows], engine=nisa.engine.scalar)


def row_matmul(out_sb, lhs_t, rhs_t, rows, k_size, n_size, n_chunk):
    """``out_sb[:rows, :n_size] = lhs @ rhs`` for one token tile: ``lhs_t`` (pmax, k_tiles, pmax) holds
    lhs^T in K tiles, ``rhs_t`` (pmax, k_tiles, n_size) holds rhs in K tiles. fp32 PSUM accumulation over
    the K tiles, one PSUM bank per ``n_chunk`` output columns, evicted by ScalarE."""
    pmax = nl.tile_size.pmax
    for ni in range(ceil_div(n_size, n_chunk)):
        n0 = ni * n_chunk
        nc = min(n_chunk, n_size - n0)
        acc_psum = nl.ndarray((pmax, n_chunk), dtype=nl.float32, buffer=nl.psum)
        for ki in range(ceil_div(k_size, pmax)):
            kc = min(pmax, k_size - ki * pmax)
            nisa.nc_matmul(dst=acc_psum[:rows, :nc], stationary=lhs_t[:kc, ki, :rows],
                           moving=rhs_t[:kc, ki, n0:n0 + nc], accumulate=(ki > 0))
        nisa.tensor_copy(dst=out_sb[:rows, n0:n0 + nc], src=acc_psum[:rows, :nc], engine=nisa.engine.scalar)


def expert_iota(rows, width):
    """fp32 (pmax, width) tile with every row 0, 1, ..., width - 1."""
    iota_sb = nl.ndarray((nl.tile_size.pmax, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=iota_sb[:rows, :], pattern=[[1, width]], offset=0, channel_multiplier=0)
    return iota_sb


def router_scores(scores_sb, logits_sb, rows, num_experts, score_func):
    """``scores_sb[:rows, :E] = softmax(logits) or sigmoid(logits)`` (fp32 in, fp32 out)."""
    pmax = nl.tile_size.pmax
    logits = logits_sb[:rows, :num_experts]
    scores = scores_sb[:rows, :num_experts]
    if score_func == "sigmoid":
        nisa.activation(dst=scores, op=nl.sigmoid, data=logits)
        return
    neg_max = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    row_sum = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    inv_sum = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max[:rows], op=nl.maximum, data=logits, axis=1, negate=True)
    nisa.activation(dst=scores, op=nl.exp, data=logits, bias=neg_max[:rows], reduce_op=nl.add,
                    reduce_res=row_sum[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.reciprocal(dst=inv_sum[:rows], data=row_sum[:rows])
    nisa.tensor_scalar(dst=scores, data=scores, op0=nl.multiply, operand0=inv_sum[:rows])


def nan_keys_to_top(key_sb, rows, cols):
    """Replace NaN keys by +FLT_MAX (in place), so that rows with NaN scores still yield valid
    ids: NaN experts first, in ascending id, as a stable descending sort ranks NaN."""
    nan_mask = nl.ndarray((nl.tile_size.pmax, cols), dtype=nl.uint8, buffer=nl.sbuf)
    keys = key_sb[:rows, :cols]
    nisa.tensor_tensor(dst=nan_mask[:rows, :], data1=keys, data2=keys, op=nl.not_equal)
    nisa.tensor_copy_predicated(dst=keys, src=-NEG_BIG, predicate=nan_mask[:rows, :])


def select_topk(ids_f, key_sb, rows, width, k):
    """``ids_f[:rows, :k]`` (fp32) = ids of the k largest ``key_sb[:rows, :width]``, descending,
    ties to the lower id. ``key_sb`` is clobbered (selected entries become ``NEG_BIG``)."""
    pmax = nl.tile_size.pmax
    vals8 = nl.ndarray((pmax, TOPK_WIDTH), dtype=nl.float32, buffer=nl.sbuf)
    idx8_u = nl.ndarray((pmax, TOPK_WIDTH), dtype=nl.uint32, buffer=nl.sbuf)
    key = key_sb[:rows, :width]
    for r in range(ceil_div(k, TOPK_WIDTH)):
        nisa.max8(dst=vals8[:rows], src=key)
        nisa.nc_find_index8(dst=idx8_u[:rows], data=key, vals=vals8[:rows])
        n = min(TOPK_WIDTH, k - r * TOPK_WIDTH)
        nisa.tensor_copy(dst=ids_f[:rows, nl.ds(r * TOPK_WIDTH, n)], src=idx8_u[:rows, :n])
        if (r + 1) * TOPK_WIDTH < k:
            # the 8 found entries -> NEG_BIG; equal values replace their first occurrences, in
            # ascending position, so the higher ids of a tie remain for the next round
            nisa.nc_match_replace8(dst=key, data=key, vals=vals8[:rows], imm=NEG_BIG)


def gather_columns(out_sb, src_sb, ids_f, rows, cols, k):
    """``out_sb[:rows, j] = src_sb[:rows, ids_f[:, j]]`` for j < k: one VectorE ``range_select``
    per column keeps only position ``id`` (``id <= i <= id``) and max-reduces the row (exact)."""
    pmax = nl.tile_size.pmax
    selected_sb = nl.ndarray((pmax, cols), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(k):
        id_j = ids_f[:rows, nl.ds(j, 1)]
        nisa.range_select(dst=selected_sb[:rows, :cols], on_true_tile=src_sb[:rows, :cols],
                          comp_op0=nl.greater_equal, comp_op1=nl.less_equal, bound0=id_j, bound1=id_j,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=out_sb[:rows, nl.ds(j, 1)],
                          reduce_op=nl.maximum, range_start=0, on_false_value=NEG_BIG)


def scatter_columns(dst_sb, vals_sb, ids_f, iota_sb, rows, cols, k):
    """``dst_sb[:rows, ids_f[:, j]] += vals_sb[:rows, j]`` for j < k (ids distinct per row)."""
    pmax = nl.tile_size.pmax
    onehot_sb = nl.ndarray((pmax, cols), dtype=nl.float32, buffer=nl.sbuf)
    for j in range(k):
        nisa.tensor_scalar(dst=onehot_sb[:rows, :cols], data=iota_sb[:rows, :cols], op0=nl.equal,
                           operand0=ids_f[:rows, nl.ds(j, 1)], op1=nl.multiply,
                           operand1=vals_sb[:rows, nl.ds(j, 1)])
        nisa.tensor_tensor(dst=dst_sb[:rows, :cols], data1=dst_sb[:rows, :cols], data2=onehot_sb[:rows, :cols],
                           op=nl.add)


def group_limit(key_sb, rows, num_experts, num_groups, topk_groups):
    """Push the keys of all but the ``topk_groups`` best groups to ``NEG_BIG`` (in place).

    Group score = sum of the group's two largest keys (its only key for groups of one);
    group ties go to the lower group id (``select_topk`` on the group scores)."""
    pmax = nl.tile_size.pmax
    group_size = num_experts // num_groups
    group_width = padded_width(num_groups)
    scan_width = padded_width(group_size)
    group_score = nl.ndarray((pmax, group_width), dtype=nl.float32, buffer=nl.sbuf)
    scan_sb = nl.ndarray((pmax, scan_width), dtype=nl.float32, buffer=nl.sbuf)
    top8 = nl.ndarray((pmax, TOPK_WIDTH), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=group_score[:rows, :], value=NEG_BIG)
    nisa.memset(dst=scan_sb[:rows, :], value=NEG_BIG)
    for g in range(num_groups):
        nisa.tensor_copy(dst=scan_sb[:rows, :group_size], src=key_sb[:rows, nl.ds(g * group_size, group_size)])
        nisa.max8(dst=top8[:rows], src=scan_sb[:rows, :])
        if group_size >= 2:
            nisa.tensor_tensor(dst=group_score[:rows, nl.ds(g, 1)], data1=top8[:rows, 0:1], data2=top8[:rows, 1:2],
                               op=nl.add)
        else:
            nisa.tensor_copy(dst=group_score[:rows, nl.ds(g, 1)], src=top8[:rows, 0:1])

    group_iota = expert_iota(rows, group_width)
    group_ids = nl.ndarray((pmax, topk_groups), dtype=nl.float32, buffer=nl.sbuf)
    select_topk(group_ids, group_score, rows, group_width, topk_groups)
    kept = nl.ndarray((pmax, group_width), dtype=nl.float32, buffer=nl.sbuf)
    ones = nl.ndarray((pmax, topk_groups), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=kept[:rows, :], value=0.0)
    nisa.memset(dst=ones[:rows, :], value=1.0)
    scatter_columns(kept, ones, group_ids, group_iota, rows, group_width, topk_groups)
    # penalty (kept - 1) * -NEG_BIG: 0 for kept groups, NEG_BIG for the others
    penalty = nl.ndarray((pmax, group_width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=penalty[:rows, :], data=kept[:rows, :], op0=nl.subtract, operand0=1.0,
                       op1=nl.multiply, operand1=-NEG_BIG)
    for g in range(num_groups):
        group_keys = key_sb[:rows, nl.ds(g * group_size, group_size)]
        nisa.tensor_scalar(dst=group_keys, data=group_keys, op0=nl.add, operand0=penalty[:rows, nl.ds(g, 1)])


def check_supported(weight, need_sbuf, kernel):
    """Host side, before any launch: raise ``Unsupported`` for what the router ``kernel``
    (``"router"`` / ``"router backward"``) cannot serve: more experts than one max8 scan, or
    ``need_sbuf`` bytes per partition beyond SBUF."""
    num_experts, hidden = weight.shape
    if num_experts > FIND8_MAX_FREE:
        raise Unsupported(f"E={num_experts} exceeds the max8/nc_find_index8 scan limit {FIND8_MAX_FREE}")
    if need_sbuf > nl.tile_size.sbuf_fmax_bytes:
        raise Unsupported(f"{kernel} needs {need_sbuf} SBUF bytes per partition (H={hidden}, E={num_experts}), "
                          f"more than {nl.tile_size.sbuf_fmax_bytes}")
