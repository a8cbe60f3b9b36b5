"""Compile-time work decomposition of the flash-attention forward kernel (``flash_attention_fwd.py``): groups
(batch, kv head, query tile, pass of query heads), key sections, steps, and the LNC2 split.
Plain Python on ints, evaluated while the kernel is traced.
"""

from __future__ import annotations

from nki_lib._nki import nl
from nki_lib.attention.kernels.tiles import key_blocks, plan_row, query_tiles

__all__ = ["QUERY_SECTION_TILES", "Ctx", "Group", "plan_groups", "trim_plan", "program_share",
           "plan_steps", "section_span", "dma_transposed_steps"]

QUERY_SECTION_TILES = 8  # q^T of this many consecutive query tiles is loaded by one DMA per head
                         # (2 KiB rows in bf16 instead of 256 B: one DMA chunk floor per 1024
                         # queries, docs/cost-model.md §2.6)


DMA_PT_FROM = 0.6        # P^T by DMA transpose only in the last 40 % of the steps (the long causal
                         # rows: K^T and V are resident by then, the DMA queues carry only the
                         # output stores), where TensorE transposes and their PSUM evictions
                         # are the ScalarE/VectorE work that binds (docs/perf-log.md §14.4)
DMA_PT_EVERY = 2         # of the eligible steps there, every DMA_PT_EVERY-th (from the
DMA_PT_FIRST = 0         # DMA_PT_FIRST-th) is transposed by DMA: more makes DMA the busier
                         # engine at dma_chunk_floor_ns=178
DMA_PT_MIN_BLOCKS = 12   # eligible sections have at least this many 128-key blocks; their natural
                         # blocks (all but an interleaved first run, <= 8) then give 2-byte P rows
                         # of >= 2 KiB per partition, 178 ns at half the 23 B/ns engine rate, not
                         # under the top of the chunk floor's range (178 ns, docs/cost-model.md §7.9)
DMA_PT_FROM_PADDED = 0.4       # the same when the kv head's first two V runs are interleaved
DMA_PT_MIN_BLOCKS_PADDED = 8   # (``flash_attention_fwd_values.PADDED_RUNS`` >= 2): a long row's
                               # first section then has no natural block, its second section is
                               # all natural blocks (>= 8: 2 KiB rows, 180 ns at the SBUF -> SBUF
                               # rate), and the DMA freed by the interleaved run 1 takes them from
                               # 40 % of the program on (4096 causal: 110.0 / 107.4 -> 108.4 /
                               # 106.0 us, docs/perf-log.md §16.3)


class Ctx(nl.NKIObject):
    """Kernel-wide inputs, outputs and compile-time flags, passed to the step helpers."""
    q: object              # q (B, Hq, Sq, D) HBM, or its transpose (B, Hq, D, Sq) (not natural)
    k: object              # k (B, Hkv, Sk, D) HBM, or its transpose (B, Hkv, D, Sk)
    natural: bool          # q, k in natural layout, transposed on chip (flash_attention_transposed_loads)
    v: object              # (B, Hkv, Sk, D) HBM
    sinks: object          # (Hq,) fp32 HBM or None
    has_sinks: bool
    sinks_sb: object       # (pmax, Hq) fp32 SBUF: every head's sink on every partition, or None
    d: int                 # head dim D
    chunks: tuple          # head-dim chunks ((start, size), ...) of at most 128
    mask: object           # tiles.MaskSpec
    key_rows: object       # tiles.KeyRows (per-row key bounds cache) or None
    section_keys: int      # keys per K/V section
    stat_init: float       # initial running max (scaled)
    k_cache: object        # cached K^T sections of the current kv head (list) or None
    k_owner: object        # (b, hk) whose K^T the cache holds, or None
    v_cache: object        # flash_attention_fwd_values.ValueCache of the current kv head, or None


class QuerySection(nl.NKIObject):
    """q^T of up to QUERY_SECTION_TILES consecutive query tiles of the same heads, loaded by one
    DMA per head and chunk, shared by the groups of those tiles (released after the last)."""
    q0: int                # first query row
    length: int            # query rows covered
    users: int             # groups that opened it so far
    tiles: object          # per head: list of q^T chunk tiles, or None before loading / after release


class Group(nl.NKIObject):
    """One query tile [q0, q0 + qn) of one pass over (part of) the GQA group of kv head hk: the
    query heads it serves, its key-tile plan, and once opened its resident tiles."""
    b: int                 # batch index
    hk: int                # kv head
    q0: int                # first query row of the tile
    qn: int                # query rows (<= 128)
    heads: tuple           # query heads served
    plan: tuple            # its visible key tiles (trim_plan of plan_row)
    sections: tuple        # the key sections of the plan (key_sections)
    q_sec: QuerySection    # the query section holding this tile's q^T
    q_tiles: object        # per head: q^T chunk tiles (views of q_sec.tiles), or None
    states: object         # per head: fwd_state.RowState, or None
    bounds: object         # per-row visible key bounds (lo, hi), or None
    k: object              # per section: K^T tiles, or None
    v: object              # per section: V tiles, or None


def plan_groups(mask, n_batch, n_kv_heads, group, n_pass, section_keys):
    q_spans = query_tiles(mask.sq)
    n_tiles = len(q_spans)
    groups = []
    for b in range(n_batch):
        for hk in range(n_kv_heads):
            passes = [tuple(hk * group + g for g in range(g0, min(group, g0 + n_pass)))
                      for g0 in range(0, group, n_pass)]
            q_secs = []
            for t0 in range(0, n_tiles, QUERY_SECTION_TILES):
                t1 = min(n_tiles, t0 + QUERY_SECTION_TILES)
                first = q_spans[t0][0]
                span = q_spans[t1 - 1][0] + q_spans[t1 - 1][1] - first
                q_secs.append([QuerySection(q0=first, length=span, users=0, tiles=None)
                              for _ in passes])
            for t, (q0, qn) in enumerate(q_spans):
                plan = trim_plan(mask, q0, qn, plan_row(mask, q0, qn))
                for pi, heads in enumerate(passes):
                    groups.append(Group(b=b, hk=hk, q0=q0, qn=qn, heads=heads, plan=plan,
                                        sections=key_sections(plan, section_keys),
                                        q_sec=q_secs[t // QUERY_SECTION_TILES][pi],
                                        q_tiles=None, states=None, bounds=None, k=None, v=None))
    return groups


def trim_plan(mask, q0, qn, plan):
    """``plan_row`` with every tile cut to its 128-key blocks that some query of the tile can see
    (the causal diagonal tile keeps ``128 * j`` keys instead of 512; a window's first tile loses
    its leading blocks), so no score, exp, transpose or P @ V is spent on keys no row sees.
    ``masked`` is recomputed for the cut tile. Returns ``((k0, kn, masked), ...)``."""
    trimmed = []
    for k0, kn, _ in plan:
        seen = [(k0 + j0, bn) for j0, bn in key_blocks(kn)
                if mask.tile_visible(q0, qn, k0 + j0, bn)]
        t0 = seen[0][0]
        tn = seen[-1][0] + seen[-1][1] - t0
        trimmed.append((t0, tn, not mask.tile_full(q0, qn, t0, tn)))
    return tuple(trimmed)


def key_sections(plan, max_keys):
    """Key sections of a plan: runs of consecutive visible tiles (adjacent keys) within one
    aligned span ``[a * max_keys, (a + 1) * max_keys)`` of keys, the unit of one step (aligned,
    so that a section is a slice of the K^T span cached by ``flash_attention_fwd_pipeline.section_k``).
    Returns ``((first tile, last tile), ...)``."""
    sections = []
    for ti in range(len(plan)):
        if len(sections) > 0:
            first, last = sections[-1]
            adjacent = plan[last][0] + plan[last][1] == plan[ti][0]
            if adjacent and plan[ti][0] // max_keys == plan[first][0] // max_keys:
                sections[-1] = (first, ti)
                continue
        sections.append((ti, ti))
    return tuple(sections)


def program_share(groups, n_prog, pid):
    """The contiguous run of groups program ``pid`` of ``n_prog`` (LNC2: one per NeuronCore)
    serves, cut so that every program gets about the same number of steps (causal rows differ)."""
    work = [max(1, len(grp.plan) * len(grp.heads)) for grp in groups]   # score tiles
    total = sum(work)
    lo, hi, done = 0, 0, 0
    for i in range(len(groups)):
        if done * n_prog < total * pid:
            lo = i + 1
        if done * n_prog < total * (pid + 1):
            hi = i + 1
        done += work[i]
    return groups[lo:hi]


def plan_steps(groups):
    """Program order of the work: ``(group, key section, head)`` per step; a group with no
    visible key tile gets one step ``(group, -1, -1)`` (it only initialises and stores)."""
    steps = []
    for gi, grp in enumerate(groups):
        if len(grp.sections) == 0:
            steps.append((gi, -1, -1))
        for si in range(len(grp.sections)):
            for hi in range(len(grp.heads)):
                steps.append((gi, si, hi))
    return tuple(steps)


def section_span(grp, si):
    """(first key, number of keys, its score tiles) of key section si of a group."""
    first, last = grp.sections[si]
    s0 = grp.plan[first][0]
    return s0, grp.plan[last][0] + grp.plan[last][1] - s0, grp.plan[first:last + 1]


def dma_transposed_steps(groups, steps, drain_steps, padded_runs=0):
    """Steps whose P^T comes from one SBUF -> SBUF DMA transpose instead of TensorE transposes
    and PSUM evictions (``flash_attention_fwd_step.dma_transpose_p``; 2-byte P only, checked by
    the caller; the step still falls back to TensorE when its V is not in natural blocks): of the
    steps from ``DMA_PT_FROM`` of the program on whose section has at least ``DMA_PT_MIN_BLOCKS``
    blocks (``DMA_PT_FROM_PADDED`` / ``DMA_PT_MIN_BLOCKS_PADDED`` with ``padded_runs`` >= 2 padded
    V runs), every ``DMA_PT_EVERY``-th from the ``DMA_PT_FIRST``-th. Returns a frozenset of step
    indices."""
    pmax = nl.tile_size.pmax
    start, min_blocks = ((DMA_PT_FROM_PADDED, DMA_PT_MIN_BLOCKS_PADDED) if padded_runs >= 2
                         else (DMA_PT_FROM, DMA_PT_MIN_BLOCKS))
    eligible = [s for s in range(int(start * len(steps)), len(steps) - drain_steps)
                if steps[s][1] >= 0
                and section_span(groups[steps[s][0]], steps[s][1])[1] >= min_blocks * pmax]
    return frozenset(eligible[DMA_PT_FIRST::DMA_PT_EVERY])
