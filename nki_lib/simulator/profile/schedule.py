"""List scheduler over a simulator trace (``docs/cost-model.md`` §7.4).

Each physical core (one program of an LNC launch) has its own engines: ``tensor``, ``vector``,
``scalar``, ``gpsimd``, ``sync`` and a pool of 16 DMA engines. Instructions are visited in
program order. An instruction starts when

* its engine is free (each compute engine runs its stream in program order), and
* every instruction it depends on is complete. Dependencies are RAW, WAR and WAW overlaps of
  buffer regions ``(buffer_id, partitions, byte_range)``; a producer is complete ``latency_ns``
  after its service ends (PE result latency, DVE/ACT semaphore intercepts, DMA 1.3 us), except
  that TensorE runs its own dependent instructions (PSUM accumulation groups) back to back, and
* (PSUM accesses) its PSUM banks are free: a bank holds one buffer at a time, and a buffer that
  takes over a bank waits until every access to the previous buffer there has completed
  (see :class:`_PsumBanks` for how buffers are mapped to banks).

A DMA occupies the ``E_used`` earliest-free DMA engines for its service time; with ``hwdge`` or
``swdge`` its descriptor generation first occupies the triggering engine (in that engine's
program order). ScalarE pays ``act_table_load_ns`` whenever it runs a table function other than
the one loaded. TensorE throttling (§2.1): a PE instruction that starts after the PE has been
idle long enough for utilisation to fall below the threshold starts a new ramp; until the ramp
ends it runs at ``start_frac + (1 - start_frac) * t / ramp`` of full speed.

TensorE matmuls on disjoint PE row / column tiles (``tile_position``) run in parallel
(:mod:`.pe_array`).

``core_barrier`` joins the programs of an LNC2 launch: every program resumes at the latest
arrival plus ``barrier_ns``; the barrier is a fence for all engines of its program. Under LNC1
it is a no-op costing one sync-engine slot.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

from .constants import HardwareParams
from .costs import InstrCost, instruction_cost
from .pe_array import GapPe, InOrderPe, area, cells_of, uses_tiles

__all__ = ["ENGINES", "ProgramResult", "schedule_programs"]

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma", "sync")
_BARRIERS = ("core_barrier", "barrier")


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _contains(outer: tuple, inner: tuple) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1] and outer[2] <= inner[2] and inner[3] <= outer[3]


def _region(access) -> tuple:
    return (access.partitions[0], access.partitions[1], access.byte_range[0], access.byte_range[1])


_WHOLE_BUFFER = float("inf")


def _key(access):
    """Which memory a region lives in: tiles placed with ``address=`` share the program's physical
    SBUF/PSUM (their byte ranges are physical), every other allocation is its own buffer."""
    return ("placed", access.memory) if access.placed else access.buffer_id


def footprint(entry) -> tuple[list, list]:
    """``(reads, writes)`` of ``entry`` as ``(key, region)`` pairs for the hazard tables.

    The HBM side of a DMA with runtime offsets (``attrs["indirect"]``) may touch any row of its
    tensor, so it covers the whole buffer.
    """
    dynamic = bool(entry.attrs.get("indirect")) if entry.engine == "dma" else False

    def one(acc):
        region = _region(acc)
        if dynamic and acc.memory not in ("sbuf", "psum"):
            region = (region[0], region[1], 0, _WHOLE_BUFFER)
        return _key(acc), region

    return [one(a) for a in entry.reads], [one(a) for a in entry.writes]


class _RegionTable:
    """Records keyed by region for one buffer, indexed by byte-range buckets for fast overlap queries.

    The bucket size is fixed per buffer from its first region (a power of two >= 4 KiB), so a
    buffer accessed in many equal slices (an HBM tensor tiled by a loop) costs O(1) per query.
    Whole-buffer regions (the HBM side of an indirect DMA) live in one extra bucket.
    """

    MIN_BUCKET = 4096

    def __init__(self) -> None:
        self.bucket = 0
        self.buckets: dict[int, dict[tuple, tuple]] = defaultdict(dict)

    WHOLE = -1  # the bucket of whole-buffer regions, visited by every query

    def _span(self, region: tuple) -> range:
        if region[3] == _WHOLE_BUFFER:
            return range(self.WHOLE, self.WHOLE + 1)
        if not self.bucket:
            size = max(region[3] - region[2], self.MIN_BUCKET)
            self.bucket = 1 << (int(size) - 1).bit_length()
        return range(region[2] // self.bucket, max(region[3] - 1, region[2]) // self.bucket + 1)

    def _visit(self, region: tuple):
        if region[3] == _WHOLE_BUFFER:
            return list(self.buckets)
        return (self.WHOLE, *self._span(region))

    def overlapping(self, region: tuple):
        for b in self._visit(region):
            bucket = self.buckets.get(b)
            if bucket:
                for other, rec in bucket.items():
                    if _overlap(region, other):
                        yield other, rec

    def get(self, region: tuple):
        for b in self._span(region):
            return self.buckets.get(b, {}).get(region)
        return None

    def put(self, region: tuple, rec: tuple) -> None:
        for b in self._span(region):
            self.buckets[b][region] = rec

    def drop_contained(self, region: tuple) -> None:
        covered = {other for other, _ in self.overlapping(region) if _contains(region, other)}
        for other in covered:
            for b in self._span(other):
                self.buckets[b].pop(other, None)


class _Regions:
    """Completion times of the last writes and reads of every buffer region.

    Each record is ``(done, in_order, engine, position)``: ``done`` is when another engine may
    use the result; ``in_order`` is when a later instruction of the *same* engine may: TensorE
    runs dependent matmuls (PSUM accumulation groups) back to back in its in-order pipeline, so
    for it ``in_order`` is the end of service; other engines pay their completion latency.
    ``position`` is the producer's position in program order (for the critical path).
    """

    def __init__(self) -> None:
        self.writes: dict = defaultdict(_RegionTable)   # key (see _key) -> table
        self.reads: dict = defaultdict(_RegionTable)

    def ready(self, foot, engine: str) -> tuple[float, int | None]:
        reads, writes = foot
        t, who = 0.0, None
        tables = [(key, region, (self.writes,)) for key, region in reads]                # RAW
        tables += [(key, region, (self.writes, self.reads)) for key, region in writes]   # WAW, WAR
        for key, region, kinds in tables:
            for table in kinds:
                for _, (done, in_order, producer, position) in table[key].overlapping(region):
                    when = in_order if producer == engine else done
                    if when > t:
                        t, who = when, position
        return t, who

    def commit(self, foot, done: float, end: float, engine: str, position: int) -> None:
        reads, writes = foot
        in_order = end if engine == "tensor" else done
        for key, region in reads:
            table = self.reads[key]
            old = table.get(region)
            if old is None or old[0] <= done:
                table.put(region, (done, in_order, engine, position))
        for key, region in writes:
            self.writes[key].drop_contained(region)
            self.reads[key].drop_contained(region)
            self.writes[key].put(region, (done, in_order, engine, position))


class _PsumBanks:
    """PSUM banks as resources: a pool of ``psum_banks`` banks of ``psum_bank_bytes``.

    * A tile placed with ``address=`` occupies exactly the banks its byte range covers (its byte
      range is physical). It waits for an automatic buffer that held those banks to finish;
      between placed tiles the byte-level hazards of :class:`_Regions` order the accesses (two
      placed tiles may share a bank on disjoint bytes).
    * An automatic allocation's byte ranges are relative to the allocation, so it is mapped to
      banks when it is first accessed: it takes ``ceil(extent / bank_bytes)`` banks (its largest
      byte extent over the trace), preferring banks that are empty or whose owner is dead (no
      later access in the trace), earliest released first, and waits until every access to their
      previous owners has completed. A buffer accessed again after losing a bank takes it back
      the same way.
    """

    def __init__(self, hw: HardwareParams, entries: list) -> None:
        self.bank_bytes = hw.psum_bank_bytes
        self.last_use: dict[int, int] = {}   # buffer id -> position of its last access in program order
        self.need: dict[int, int] = {}       # automatic buffer id -> banks it spans
        self.placed: set[int] = set()
        for pos, entry in enumerate(entries):
            for acc in (*entry.reads, *entry.writes):
                if acc.memory != "psum":
                    continue
                self.last_use[acc.buffer_id] = pos
                if acc.placed:
                    self.placed.add(acc.buffer_id)
                else:
                    banks = max(1, -(-acc.byte_range[1] // self.bank_bytes))
                    self.need[acc.buffer_id] = min(hw.psum_banks, max(self.need.get(acc.buffer_id, 1), banks))
        self.position = 0
        self.owner: list[int | None] = [None] * hw.psum_banks
        self.release = [0.0] * hw.psum_banks
        self.release_by: list[int | None] = [None] * hw.psum_banks
        self.banks_of: dict[int, list[int]] = {}

    def covered(self, acc) -> list[int]:
        """The physical banks a placed access's byte range covers."""
        lo, hi = acc.byte_range
        last = min(len(self.owner), -(-hi // self.bank_bytes)) - 1
        return list(range(min(lo // self.bank_bytes, last), last + 1))

    def _claim(self, acc) -> tuple[list[int], float]:
        if acc.placed:
            banks = self.covered(acc)
            others = [b for b in banks if self.owner[b] not in (None, acc.buffer_id)]
            waits = [self.release[b] for b in others if self.owner[b] not in self.placed]
            return banks, max(waits, default=0.0)
        banks = self.banks_of.get(acc.buffer_id)
        if banks is not None and all(self.owner[b] == acc.buffer_id for b in banks):
            return banks, 0.0
        order = sorted(range(len(self.owner)), key=lambda b: (self._live(b), self.owner[b] is not None,
                                                              self.release[b]))
        banks = sorted(order[:self.need[acc.buffer_id]])
        return banks, max(self.release[b] for b in banks)

    def _live(self, bank: int) -> bool:
        owner = self.owner[bank]
        return owner is not None and self.last_use.get(owner, -1) >= self.position

    def ready(self, entry) -> tuple[float, int | None]:
        t, who = 0.0, None
        for acc in (*entry.reads, *entry.writes):
            if acc.memory == "psum":
                banks, when = self._claim(acc)
                if when > t:
                    t = when
                    who = max((self.release_by[b] for b in banks if self.release[b] == when), default=None)
        return t, who

    def commit(self, entry, done: float, position: int) -> None:
        for acc in (*entry.reads, *entry.writes):
            if acc.memory == "psum":
                banks, _ = self._claim(acc)
                for b in banks:
                    if self.owner[b] != acc.buffer_id or done >= self.release[b]:
                        self.release_by[b] = position
                    self.owner[b] = acc.buffer_id
                    self.release[b] = max(self.release[b], done)
                if not acc.placed:
                    self.banks_of[acc.buffer_id] = banks


class _InOrderLane:
    """One engine running its instructions in program order: free from the end of the last one."""

    def __init__(self) -> None:
        self.free, self.last = 0.0, None

    def fit(self, ready: float, service: float, cells=None) -> tuple[float, int | None]:
        """Earliest start >= ``ready`` and the position that kept the engine busy until then
        (``cells``: ignored, the engine is one resource; see :mod:`.pe_array`)."""
        return (self.free, self.last) if self.free > ready else (ready, None)

    def take(self, start: float, end: float, position: int, cells=None) -> None:
        self.free, self.last = end, position


class _GapLane:
    """One engine whose instructions may run in any order (the dependency-bound schedule).

    Free time is a sorted list of gaps ``[starts[i], ends[i])`` (the last one open-ended); an
    instruction takes the first gap after its ready time that holds its service. At most
    ``SCAN`` gaps are tried before the open end (a bounded search: the schedule stays valid,
    it only reorders less).
    """

    SCAN = 64
    MIN_GAP_NS = 1e-3

    def __init__(self) -> None:
        self.starts, self.ends = [0.0], [math.inf]
        self.before: list[int | None] = [None]   # position whose instruction ends where the gap starts

    def fit(self, ready: float, service: float, cells=None) -> tuple[float, int | None]:
        last = len(self.starts) - 1
        first = max(bisect.bisect_right(self.starts, ready) - 1, 0)
        for j in (*range(first, min(first + self.SCAN, last)), last):
            start = max(ready, self.starts[j])
            if self.ends[j] - start >= service - 1e-9:
                return start, (self.before[j] if start > ready else None)
        raise AssertionError("unreachable: the last gap is open-ended")

    def take(self, start: float, end: float, position: int, cells=None) -> None:
        j = bisect.bisect_right(self.starts, start + 1e-9) - 1
        gap_start, gap_end, before = self.starts[j], self.ends[j], self.before[j]
        pieces = []
        if start - gap_start > self.MIN_GAP_NS:
            pieces.append((gap_start, start, before))
        if gap_end - end > self.MIN_GAP_NS:
            pieces.append((end, gap_end, position))
        self.starts[j:j + 1] = [p[0] for p in pieces]
        self.ends[j:j + 1] = [p[1] for p in pieces]
        self.before[j:j + 1] = [p[2] for p in pieces]


class _InOrderDma:
    """The DMA engines in program order: a DMA takes the ``n`` earliest-free engines together."""

    def __init__(self, engines: int) -> None:
        self.free = [(0.0, None)] * engines   # (free time, position of the last user)

    def place(self, ready: float, n: int, service: float, position: int) -> tuple[float, float, int | None]:
        """(start, end, position that held the engines) of a DMA on ``n`` engines."""
        self.free.sort(key=lambda f: f[0])
        used = self.free[n - 1]
        start, who = (used[0], used[1]) if used[0] > ready else (ready, None)
        end = start + service
        self.free[:n] = [(end, position)] * n
        return start, end, who


class _GapDma:
    """The DMA engines with reordering: each engine fills its own gaps; a DMA ends with its last part."""

    def __init__(self, engines: int) -> None:
        self.lanes = [_GapLane() for _ in range(engines)]

    def place(self, ready: float, n: int, service: float, position: int) -> tuple[float, float, int | None]:
        fits = sorted((lane.fit(ready, service), i) for i, lane in enumerate(self.lanes))[:n]
        for (start, _), i in fits:
            self.lanes[i].take(start, start + service, position)
        start, who = fits[-1][0]
        return start, start + service, who


@dataclass
class ProgramResult:
    """What the scheduler found for one program (physical core)."""

    program_id: int
    makespan_ns: float = 0.0
    busy_ns: dict = field(default_factory=lambda: dict.fromkeys(ENGINES, 0.0))
    instructions: dict = field(default_factory=lambda: dict.fromkeys(ENGINES, 0))
    serial_ns: float = 0.0
    act_table_loads: int = 0
    throttle_ns: float = 0.0
    unmodelled: dict = field(default_factory=dict)
    timeline: list | None = None  # (index, engine, opcode, start_ns, end_ns, done_ns) when requested
    critical_path: list = field(default_factory=list)  # (entry, engine, ns on the path, waited on)


class _Program:
    """The schedule of one program. ``services=None``: program order (each engine in order; the
    ACT table switches and the PE throttle are computed here and logged in ``service_log``).
    Otherwise the dependency-bound schedule: engines take instructions in any order (subject to
    the data, PSUM-bank and barrier constraints), each compute instruction with the service the
    program-order schedule found for it."""

    def __init__(self, hw: HardwareParams, program_id: int, keep_timeline: bool, entries: list,
                 services: list | None = None) -> None:
        self.hw = hw
        self.result = ProgramResult(program_id, timeline=[] if keep_timeline else None)
        self.services = services
        self.service_log: list = []
        lane = _InOrderLane if services is None else _GapLane
        self.lanes = {e: lane() for e in ENGINES if e != "dma"}
        self.pe_tiles = uses_tiles(entries)   # PE row / column tiles run in parallel (pe_array)
        if self.pe_tiles:
            self.lanes["tensor"] = InOrderPe() if services is None else GapPe(_GapLane)
        self.dma = (_InOrderDma if services is None else _GapDma)(hw.dma_engines)
        self.regions = _Regions()
        self.banks = _PsumBanks(hw, entries)
        self.fence, self.fence_by = 0.0, None
        self.position = 0
        self.table: str | None = None
        self.pe_last_end: float | None = None
        self.pe_ramp_start = 0.0
        self.end, self.last = 0.0, None
        self.records: list = []  # per position: (entry, engine, start, done, predecessor, why)

    def _pe_service(self, start: float, service: float) -> float:
        """Stretch a PE service by the dI/dt throttle ramp (docs/cost-model.md §2.1)."""
        hw = self.hw
        idle_limit = hw.pe_throttle_ramp_ns * (1.0 - hw.pe_throttle_util_threshold)
        if self.pe_last_end is None or start - self.pe_last_end >= idle_limit:
            self.pe_ramp_start = start
        elapsed = start - self.pe_ramp_start
        if elapsed >= hw.pe_throttle_ramp_ns:
            return service
        rate = hw.pe_throttle_start_frac + (1.0 - hw.pe_throttle_start_frac) * elapsed / hw.pe_throttle_ramp_ns
        return service / rate

    def arrive(self, entry, cost: InstrCost) -> float:
        """Time the barrier ``entry`` would start on its engine."""
        deps = max(self.regions.ready(footprint(entry), cost.engine)[0], self.fence)
        return self.lanes[cost.engine].fit(deps, cost.service_ns)[0]

    def _compute_service(self, cost: InstrCost, start: float, position: int) -> float:
        """Service of a compute instruction: program order adds table loads and the PE throttle."""
        if self.services is not None:
            return self.services[position]
        res, hw = self.result, self.hw
        service = cost.service_ns
        if cost.table_func is not None and cost.table_func != self.table:
            service += hw.act_table_load_ns
            self.table = cost.table_func
            res.act_table_loads += 1
        if cost.engine == "tensor":
            stretched = self._pe_service(start, service)
            res.throttle_ns += stretched - service
            service = stretched
        return service

    def run(self, entry, cost: InstrCost, release: float | None = None) -> None:
        res, hw = self.result, self.hw
        position = self.position
        self.banks.position = position
        self.position += 1
        # the latest constraint decides the start; remember who imposed it (critical path)
        foot = footprint(entry)
        ready, pred, why = max((*self.regions.ready(foot, cost.engine), "data"),
                               (*self.banks.ready(entry), "psum bank"), (self.fence, self.fence_by, "barrier"),
                               key=lambda c: c[0])
        if not cost.modelled:
            res.unmodelled[entry.opcode] = res.unmodelled.get(entry.opcode, 0) + 1
        if cost.engine == "dma":
            if cost.issue_engine is not None:
                lane = self.lanes[cost.issue_engine]
                issue_start, who = lane.fit(ready, cost.issue_ns)
                if issue_start > ready:
                    ready, pred, why = issue_start, who, "issue engine"
                lane.take(ready, ready + cost.issue_ns, position)
                res.busy_ns[cost.issue_engine] += cost.issue_ns
            path_start = ready  # the descriptor issue belongs to this DMA on the critical path
            ready += cost.issue_ns
            start, end, who = self.dma.place(ready, cost.dma_engines, cost.service_ns, position)
            if start > ready:
                pred, why, path_start = who, "dma engines", start
            res.busy_ns["dma"] += cost.service_ns * cost.dma_engines / hw.dma_engines
            serial = cost.issue_ns + cost.service_ns + cost.latency_ns
            self.service_log.append(None)
        else:
            lane = self.lanes[cost.engine]
            cells = cells_of(entry.attrs.get("tile")) if self.pe_tiles and cost.engine == "tensor" else None
            known = self.services[position] if self.services is not None else 0.0
            start, who = lane.fit(ready, known, cells)
            if start > ready:
                pred, why = who, "engine"
            service = self._compute_service(cost, start, position)
            if release is not None and release - cost.latency_ns - service > start:  # barrier: joint release
                start, why = lane.fit(release - cost.latency_ns - service, service, cells)[0], "other core"
            end = start + service
            path_start = start
            lane.take(start, end, position, cells)
            if cost.engine == "tensor":
                self.pe_last_end = max(end, self.pe_last_end or 0.0)
            res.busy_ns[cost.engine] += service * (area(cells) if cells else 1.0)
            serial = service + cost.latency_ns
            self.service_log.append(service)
        done = end + cost.latency_ns
        if release is not None:
            done = max(done, release)
            self.fence, self.fence_by = max(self.fence, done), position
        self.regions.commit(foot, done, end, cost.engine, position)
        self.banks.commit(entry, done, position)
        res.instructions[cost.engine] += 1
        res.serial_ns += serial
        if done >= self.end:
            self.end, self.last = done, position
        self.records.append((entry, cost.engine, path_start, done, pred, why))
        if res.timeline is not None:
            res.timeline.append((entry.index, cost.engine, entry.opcode, start, end, done))

    def critical_path(self) -> list:
        """Walk back from the last completion along the constraint that set each start.

        Each step is ``(entry, engine, ns, waited_on)``: ``ns`` runs from the instruction's start
        to the start of the next instruction on the path (its service plus the latency or gap
        the next one waited for), so the steps add up to the makespan.
        """
        path, position, until = [], self.last, self.end
        while position is not None:
            entry, engine, start, _, pred, why = self.records[position]
            path.append((entry, engine, until - start, why))
            until, position = start, pred
        if until > 0:
            path.append((None, "-", until, "kernel start"))
        return path[::-1]


def _schedule(programs: dict[int, list], hw: HardwareParams, keep_timeline: bool,
              services: dict[int, list] | None) -> list[_Program]:
    states = {pid: _Program(hw, pid, keep_timeline, entries, None if services is None else services[pid])
              for pid, entries in programs.items()}
    cursors = dict.fromkeys(programs, 0)
    while True:
        waiting = {}
        for pid, entries in programs.items():
            state, i = states[pid], cursors[pid]
            while i < len(entries):
                entry = entries[i]
                cost = instruction_cost(entry, hw)
                if entry.opcode in _BARRIERS:
                    if len(programs) > 1:
                        waiting[pid] = (entry, cost)
                        break
                    cost = InstrCost(cost.engine, cost.service_ns, 0.0)  # LNC1: a no-op barrier
                state.run(entry, cost)
                i += 1
            cursors[pid] = i
        if not waiting:
            break
        arrivals = {pid: states[pid].arrive(e, c) + c.service_ns for pid, (e, c) in waiting.items()}
        release = max(arrivals.values()) + hw.barrier_ns
        for pid, (entry, cost) in waiting.items():
            states[pid].run(entry, cost, release=release)
            cursors[pid] += 1
    for state in states.values():
        state.result.makespan_ns = state.end
        state.result.critical_path = state.critical_path()
    return list(states.values())


def schedule_programs(programs: dict[int, list], hw: HardwareParams, *, keep_timeline: bool = False,
                      reordered: bool = False) -> list[ProgramResult] | tuple[list[ProgramResult], list[ProgramResult]]:
    """Schedule each program's entries in program order; barriers join all programs.

    With ``reordered=True`` also the dependency-bound schedule (same services, engines reorder
    freely) and return ``(in_order_results, reordered_results)``.
    """
    in_order = _schedule(programs, hw, keep_timeline, None)
    if not reordered:
        return [s.result for s in in_order]
    services = {s.result.program_id: s.service_log for s in in_order}
    free = _schedule(programs, hw, False, services)
    return [s.result for s in in_order], [s.result for s in free]
