"""Tile planning and in-kernel mask helpers shared by the flash-attention kernels (fwd and bwd),
and the running-max constants and the inf-row fix of lse shared with the decode kernel.

Two kinds of helpers live here:

* **Compile-time planning** (plain Python on ints, evaluated while the kernel is traced):
  how a length splits into tiles (:func:`spans`), the query/key/head-dim tilings, which key tiles
  a query tile must visit and which of those need a mask (:func:`plan_row`, from
  ``masks.tile_is_visible`` / ``masks.tile_is_full``), and how many query heads of a GQA group
  fit in one pass (:func:`heads_per_pass`).
* **In-kernel mask helpers** (emit NKI instructions): every mask of docs/contract.md §3.1 -- causal,
  sliding window, ``cu_seqlens`` / ``cu_seqlens_k`` documents and key padding -- restricts the
  keys of query ``i`` to one interval ``[lo_i, hi_i]`` (inclusive, absolute key indices).
  :func:`row_bounds` builds the two bound columns ``(rows, 1)`` float32 for a query tile: iota
  on GpSimd for the causal/window diagonal, or, with per-row key bounds (documents, padding;
  built on the host by ``nki_lib.attention.key_bounds`` with the rules already intersected),
  views of those bounds, cached in SBUF (one DMA per ``BOUNDS_CHUNK_TILES`` query tiles);
  :func:`mask_scores` applies them to a score tile with one VectorE ``range_select`` that also
  returns the row max. Masked scores become ``MASK_FILL`` (the most negative finite float32,
  which ``range_select`` requires), so ``exp(MASK_FILL - m)`` is exactly 0 for any running max
  ``m >= STAT_INIT``.
* **Non-finite rows** (:func:`inf_max_rows`): a row whose running max is +inf (an inf score) has
  ``exp(s - m) = exp(inf - inf) = NaN``, so its sum and log are NaN; its lse is set to +inf, the
  reference's logsumexp (its output stays non-finite, as the reference's).

Conventions (both kernels): queries on partitions, keys on the free axis.
Shapes: query tiles (qn <= pmax = 128 rows), score tiles (qn, kn) with kn <= 512 keys (the matmul
moving size and one fp32 PSUM bank), 128-key blocks for P @ V, head-dim chunks of <= 128; mask
bounds are (qn, 1) float32 columns; per-row key bounds in HBM are (B, pmax, NT, 2) float32
(``bounds_layout``; NT query tiles).
Dimension legend: B batch, Sq/Sk query/key lengths, D head dim, qn/kn rows/keys of one
tile.
Limits: key indices are float32 inside the kernels, so Sq + Sk must stay below ``MAX_INDEX``
(2**24); ``range_select`` needs NC-v3+ (trn2/trn3).
"""

from __future__ import annotations

from nki_lib._nki import nisa, nl
from nki_lib.attention import masks
from nki_lib.sizes import spans

__all__ = ["MASK_FILL", "STAT_INIT", "MAX_INDEX", "MaskSpec", "spans", "query_tiles", "key_tiles",
           "key_tile_width", "key_blocks", "head_dim_chunks", "plan_row", "heads_per_pass",
           "bounds_layout", "KeyRows", "BOUNDS_CHUNK_TILES",
           "all_key_bounds", "row_bounds", "mask_scores", "inf_max_rows"]

MASK_FILL = -3.4028234663852886e38  # most negative finite float32 (range_select's only fill value)
STAT_INIT = MASK_FILL / 2           # initial running max: finite, above MASK_FILL by ~1.7e38
MAX_INDEX = 1 << 24                 # float32 represents every integer index below this
BOUNDS_CHUNK_TILES = 64             # per-row key bounds of this many query tiles (8192 rows) are
                                    # loaded by one DMA: 512 B of SBUF per partition


class MaskSpec(nl.NKIObject):
    """The static part of the mask (compile time), with windows normalised: a window side that
    cannot exclude any key (``window_left >= Sk - 1``, ``window_right >= Sq - 1``) becomes -1.
    ``has_docs``: per-row key bounds are given (documents or key padding); they make every
    visited tile partial, and skipping stays with the static rules."""

    def __init__(self, sq: int, sk: int, causal: bool, window_left: int, window_right: int,
                 has_docs: bool):
        self.sq = sq
        self.sk = sk
        self.causal = causal
        self.window_left = -1 if window_left >= sk - 1 else window_left
        self.window_right = -1 if window_right >= sq - 1 else window_right
        self.has_docs = has_docs

    @property
    def offset(self) -> int:
        """Bottom-right alignment: query i is aligned with key ``i + offset``."""
        return self.sk - self.sq

    def _flags(self) -> dict:
        return dict(sq=self.sq, sk=self.sk, causal=self.causal, window_left=self.window_left,
                    window_right=self.window_right)

    def tile_visible(self, q0: int, qn: int, k0: int, kn: int) -> bool:
        return masks.tile_is_visible(q0, q0 + qn, k0, k0 + kn, **self._flags())

    def tile_full(self, q0: int, qn: int, k0: int, kn: int) -> bool:
        """No key of the tile is masked for any query (per-row key bounds make every tile partial)."""
        return not self.has_docs and masks.tile_is_full(q0, q0 + qn, k0, k0 + kn, **self._flags())


def key_tile_width() -> int:
    """Keys per score tile: the matmul moving free size and one fp32 PSUM bank (both 512)."""
    return min(nl.tile_size.gemm_moving_fmax, nl.tile_size.psum_fmax)


def query_tiles(sq: int) -> tuple:
    return spans(sq, nl.tile_size.pmax)


def key_tiles(sk: int) -> tuple:
    return spans(sk, key_tile_width())


def key_blocks(kn: int) -> tuple:
    """128-key blocks of a key tile (the contraction tiles of P @ V)."""
    return spans(kn, nl.tile_size.pmax)


def head_dim_chunks(d: int) -> tuple:
    """Partition-sized chunks of the head dim (contraction tiles of Q @ K^T; D <= 256 gives 2)."""
    return spans(d, nl.tile_size.pmax)


def plan_row(mask: MaskSpec, q0: int, qn: int) -> tuple:
    """The key tiles query rows ``[q0, q0 + qn)`` must visit: ``((k0, kn, masked), ...)``.

    Tiles that no query of the row can see are skipped whole; ``masked`` is False for tiles that
    every query sees entirely (no mask instruction is emitted for them)."""
    plan = []
    for k0, kn in key_tiles(mask.sk):
        if mask.tile_visible(q0, qn, k0, kn):
            plan.append((k0, kn, not mask.tile_full(q0, qn, k0, kn)))
    return tuple(plan)


def bounds_layout(bounds):
    """Launcher glue: per-row key bounds (B, 2, Sq) float32 (``key_bounds.plan``) -> the kernels'
    partition-major layout (B, pmax, NT, 2) with ``[b, p, t, :] = bounds[b, :, t * pmax + p]``
    (rows past Sq see no key: lo = 0, hi = -1), so one DMA puts the bounds of many query tiles
    on partitions with one contiguous run per partition."""
    import torch

    pmax = nl.tile_size.pmax
    b, _, sq = bounds.shape
    pad = -sq % pmax
    if pad:
        empty = torch.tensor([0.0, -1.0], dtype=bounds.dtype, device=bounds.device)
        bounds = torch.cat([bounds, empty.reshape(1, 2, 1).expand(b, 2, pad)], dim=2)
    return bounds.reshape(b, 2, -1, pmax).permute(0, 3, 2, 1).contiguous()


class KeyRows(nl.NKIObject):
    """SBUF cache of the per-row key bounds (HBM (B, pmax, NT, 2), :func:`bounds_layout`): the
    bounds of ``BOUNDS_CHUNK_TILES`` consecutive query tiles of one batch row, one DMA each."""

    def __init__(self, bounds):
        self.bounds = bounds
        self.key = None
        self.bounds_sb = None


def _cached_rows(rows: KeyRows, b: int, q0: int, qn: int):
    """``(lo, hi)`` (qn, 1) views of the cached bounds of rows ``[q0, q0 + qn)`` of batch row b."""
    t = q0 // nl.tile_size.pmax
    c0 = t - t % BOUNDS_CHUNK_TILES
    if rows.key != (b, c0):
        cn = min(BOUNDS_CHUNK_TILES, rows.bounds.shape[2] - c0)
        rows.bounds_sb = nl.ndarray((nl.tile_size.pmax, cn, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows.bounds_sb, src=rows.bounds[b, :, c0:c0 + cn, :])
        rows.key = (b, c0)
    return rows.bounds_sb[:qn, t - c0, 0:1], rows.bounds_sb[:qn, t - c0, 1:2]


def heads_per_pass(group: int, per_head_bytes: int, budget_bytes: int) -> int:
    """How many query heads of a GQA group share one pass over K/V, so that their resident state
    (``per_head_bytes`` per partition each) stays within ``budget_bytes``."""
    return max(1, min(group, budget_bytes // max(1, per_head_bytes)))


# --------------------------------------------------------------------------- in-kernel helpers

def _diagonal_column(rows: int, first: int):
    """``(rows, 1)`` float32 column with value ``first + p`` on partition p (GpSimd iota)."""
    col_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=col_sb, pattern=[[1, 1]], offset=first, channel_multiplier=1)
    return col_sb


def _constant_column(rows: int, value: float):
    col_sb = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=col_sb, value=float(value), engine=nisa.engine.gpsimd)   # DVE carries the scores
    return col_sb


def all_key_bounds():
    """``(lo_sb, hi_sb)``, each ``(pmax, 1)`` float32, that every key index passes (-1 and
    MAX_INDEX): :func:`mask_scores` with them evicts an unmasked score tile and takes its row
    max in one ``range_select`` (the instruction AWS documents for that attention step)."""
    return (_constant_column(nl.tile_size.pmax, -1.0),
            _constant_column(nl.tile_size.pmax, float(MAX_INDEX)))


def row_bounds(mask: MaskSpec, q0: int, qn: int, key_rows: KeyRows | None = None, b: int = 0):
    """Visible-key interval of each query row of the tile ``[q0, q0 + qn)`` of batch row ``b``.

    Returns ``(lo_sb, hi_sb)``, each ``(qn, 1)`` float32: query ``q0 + p`` may see key j iff
    ``lo_sb[p] <= j <= hi_sb[p]``. With per-row key bounds (``mask.has_docs``; ``key_rows``,
    built on the host by ``key_bounds.plan`` with the causal/window rules, documents and key
    padding already intersected) they are views of the cached bounds (one DMA per
    ``BOUNDS_CHUNK_TILES`` query tiles). Without them the interval is the causal/window
    diagonal (GpSimd iota) or the whole key range.
    """
    if mask.has_docs:
        return _cached_rows(key_rows, b, q0, qn)
    diag = q0 + mask.offset
    if mask.window_left >= 0:
        lo_sb = _diagonal_column(qn, diag - mask.window_left)
    else:
        lo_sb = _constant_column(qn, 0.0)
    hi_shifts = [0] if mask.causal else []
    if mask.window_right >= 0:
        hi_shifts.append(mask.window_right)
    if hi_shifts:
        hi_sb = _diagonal_column(qn, diag + min(hi_shifts))
    else:
        hi_sb = _constant_column(qn, mask.sk - 1)
    return lo_sb, hi_sb


def mask_scores(scores_sb, lo_sb, hi_sb, k0: int, rowmax_sb, reduce_cmd=None, src=None):
    """In place: scores of keys outside ``[lo, hi]`` become ``MASK_FILL``; ``rowmax_sb`` (rows, 1)
    receives the row max of the masked tile. ``scores_sb`` (rows, kn) float32 holds the keys
    ``k0 .. k0 + kn - 1``. One VectorE ``range_select``.

    ``reduce_cmd`` (default ``reset_reduce``) lets a caller chain the max over several tiles in
    the VectorE accumulator (``reduce`` continues it); ``rowmax_sb=None`` skips the read-out.
    ``src`` (default: ``scores_sb`` itself) is read instead, e.g. the raw scores in PSUM."""
    if reduce_cmd is None:
        reduce_cmd = nisa.reduce_cmd.reset_reduce
    nisa.range_select(dst=scores_sb, on_true_tile=scores_sb if src is None else src,
                      comp_op0=nl.greater_equal, comp_op1=nl.less_equal, bound0=lo_sb, bound1=hi_sb,
                      reduce_cmd=reduce_cmd, reduce_res=rowmax_sb,
                      reduce_op=nl.maximum, range_start=k0, on_false_value=MASK_FILL)


def inf_max_rows(lse_sb, neg_m_sb):
    """In place: ``lse = +inf`` on the rows whose running max is +inf (``neg_m = -inf``), where the
    online softmax gives NaN (see the module docstring). ``lse_sb`` and ``neg_m_sb`` are float32
    (rows, n). Two small instructions: the predicate on GpSimd, the predicated copy of the +inf
    immediate on VectorE."""
    inf_rows = nl.ndarray(lse_sb.shape, dtype=nl.uint8, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=inf_rows, data=neg_m_sb, op0=nl.equal, operand0=float("-inf"),
                       engine=nisa.engine.gpsimd)
    nisa.tensor_copy_predicated(dst=lse_sb, src=float("inf"), predicate=inf_rows)
