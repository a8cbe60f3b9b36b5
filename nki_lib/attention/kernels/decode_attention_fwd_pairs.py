"""Decode-attention kernel: K^T of several key slots per PE transpose at D <= 64 (paged single-chunk
path with shared gathers).

Algorithm: a TensorE transpose costs 128 cycles whatever its free size up to 128 (docs/cost-model.md,
TensorE row), so one transpose of ``P = 128 / D`` consecutive slots of a chunk (a (128, P*D) view: the
slots are adjacent in each partition's row) gives K^T of P slots at once, slot c0 + i on partitions
i*D .. (i+1)*D. That is the folded K^T form of the multi-chunk DMA transposes
(``decode_attention_fwd.k_t_fold``): each slot's score matmul is a row tile of the PE array over its
own D partitions against q^T in P copies (``load_q_t(copies=P)``; ``decode_attention_fwd_steps``
``_slot_operands``). A single matmul over all 128 partitions with a block-diagonal q^T would halve the
score matmuls too, but multiplies the other slots' keys by zero: 0 x NaN of a stale or masked key is
NaN (docs/perf-log.md §24.2). Per P slots: one transpose and one eviction instead of P.

Shapes: K chunk (128, M*D); packed K^T block (P*D, 1, nk/P, 128): element [i*D + e, 0, g, p] is
element e of key p*M + c0 + g*P + i (the chunk's slot c0 + g*P + i), handed on as (tile, 0, D).
Dimension legend as in ``decode_attention_fwd_steps``; P slots per transpose.

Limits: 32 <= D <= 64 dividing 128 (P >= 2; D = 32 takes 32-row tiles, NC-v3+; D = 16 would need
16-row tiles, which nc_matmul does not take, so it transposes one slot at a time), one head-dim
chunk, K^T blocks and the chunk of a multiple of P slots.
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention.kernels.decode_attention_fwd_io import slot_cols

__all__ = ["slots_per_transpose", "packed_keys_transposed"]


MIN_ROW_TILE = 32     # the smallest nc_matmul row tile (tile_size entries 32, 64, 128; 32 needs NC-v3+)


def slots_per_transpose(d, kt_slots, m):
    """P = 128 / D key slots per PE transpose when 32 <= D <= 64 divides 128 (each slot's score matmul
    is a row tile of D rows, and no row tile is smaller than ``MIN_ROW_TILE``) and P divides the K^T
    blocks (``kt_slots``) and the chunk (M slots); else 1 (one slot per transpose)."""
    pmax = nl.tile_size.pmax
    pack = pmax // d if pmax % d == 0 and d >= MIN_ROW_TILE else 1
    return pack if pack > 1 and kt_slots % pack == 0 and m % pack == 0 else 1


def packed_keys_transposed(k_chunk, block, d, pack, dtype, engine):
    """K^T of one K^T block (slots c0 .. c0 + n, c0 a multiple of P = ``pack``) in the folded form:
    [(tile (P*D, 1, n/P, 128), 0, D)], slot c0 + j on partitions (j % P)*D .., column block j // P;
    one PE transpose per P slots, evicted from PSUM by ``engine``."""
    pmax = nl.tile_size.pmax
    c0, n = block
    groups = n // pack
    k_t_psum = nl.ndarray((pack * d, groups * pmax), dtype=dtype, buffer=nl.psum)
    for g in range(groups):
        c = c0 + g * pack
        nisa.nc_transpose(dst=k_t_psum[:, g * pmax:(g + 1) * pmax], data=slot_cols(k_chunk, d, c, n=pack))
    k_t_sb = nl.ndarray((pack * d, 1, groups, pmax), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=k_t_sb.reshape((pack * d, groups * pmax)), src=k_t_psum, engine=engine)
    return [(k_t_sb, 0, d)]
