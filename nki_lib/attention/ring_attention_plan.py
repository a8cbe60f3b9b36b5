"""Where each rank's tokens sit in the global sequence, and which part of a (query, key) block
pair a ring step computes, with the mask expressed in ``flash_attention``'s own terms.

Global semantics: self-attention over the full sequence of length S = P * L (L tokens per rank),
so the global mask has no offset: key position kp is visible to query position qp iff
``not causal or kp <= qp``, ``wl < 0 or kp >= qp - wl`` and ``wr < 0 or kp <= qp + wr``.

Splits (``segments``): ``"contiguous"`` gives rank r the positions ``[r L, (r + 1) L)``;
``"zigzag"`` cuts the sequence into 2P chunks of c = L / 2 and gives rank r chunks r and
2P - 1 - r (causal load balance: every rank gets one early and one late chunk).

A block pair (``plan_block``) is a query segment (global start qs, length Lq) against a key segment
(ks, Lk). The rows that see at least one key and the keys that at least one of them sees form a
sub-rectangle [q0, q1) x [k0, k1); on it the global constraints become
``ki <= qi + (Lk' - Lq') + (r + q1 - k1)`` and ``ki >= qi + (Lk' - Lq') - (wl + k1 - q1)``, i.e.
``flash_attention``'s bottom-right-aligned window with ``window_right = r + q1 - k1`` (r = 0 for
causal, else wr) and ``window_left = wl + k1 - q1``, both >= 0 by construction of the rectangle.
Pairs with no visible key are skipped. Rows of a segment outside [q0, q1) see no key of that block
(lse = -inf there, which the merge treats as an empty contribution).
"""

from __future__ import annotations

from dataclasses import dataclass

SPLITS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    local_start: int   # first row in this rank's local tensor
    global_start: int  # its position in the global sequence
    length: int


@dataclass(frozen=True)
class Block:
    rows: slice          # rows of the query segment (relative to its local_start)
    cols: slice          # keys of the key segment (relative to its local_start)
    window_left: int     # flash_attention's window on the sub-rectangle (-1: unbounded)
    window_right: int


def segments(split: str, size: int, rank: int, local_len: int) -> tuple[Segment, ...]:
    """The global placement of a rank's ``local_len`` tokens."""
    if split == "contiguous":
        return (Segment(0, rank * local_len, local_len),)
    chunk = local_len // 2
    return (Segment(0, rank * chunk, chunk), Segment(chunk, (2 * size - 1 - rank) * chunk, chunk))


def right_bound(causal: bool, window_right: int) -> int | None:
    """Largest kp - qp allowed (None: unbounded)."""
    bounds = ([0] if causal else []) + ([window_right] if window_right >= 0 else [])
    return min(bounds) if bounds else None


def plan_block(q_seg: Segment, k_seg: Segment, *, causal: bool, window: tuple[int, int]) -> Block | None:
    """The visible sub-rectangle of a (query segment, key segment) pair, or None."""
    wl = window[0] if window[0] >= 0 else None
    right = right_bound(causal, window[1])
    q0, q1 = q_seg.global_start, q_seg.global_start + q_seg.length
    k0, k1 = k_seg.global_start, k_seg.global_start + k_seg.length
    if right is not None:
        q0 = max(q0, k0 - right)
    if wl is not None:
        q1 = min(q1, k1 + wl)
    if q0 >= q1:
        return None
    if right is not None:
        k1 = min(k1, q1 + right)
    if wl is not None:
        k0 = max(k0, q0 - wl)
    if k0 >= k1:
        return None
    rows = slice(q0 - q_seg.global_start, q1 - q_seg.global_start)
    cols = slice(k0 - k_seg.global_start, k1 - k_seg.global_start)
    return Block(rows, cols,
                 window_left=-1 if wl is None else wl + k1 - q1,
                 window_right=-1 if right is None else right + q1 - k1)
