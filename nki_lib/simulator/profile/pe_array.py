"""TensorE as an array of PE tiles (``docs/cost-model.md`` §7.4, "PE tiling").

The nki.isa.nc_matmul page (Tiling mode): the 128 x 128 systolic array can be sliced into row
tiles (2 x 64 rows on NeuronCore-v2+, 4 x 32 on v3+) and column tiles (the same for columns), "which
allow multiple nc_matmul instructions with a stationary tile size smaller than [128, 128] to run in
parallel". The scheduler models that as resources: the array is ``CELLS_PER_SIDE`` x
``CELLS_PER_SIDE`` cells of the smallest tile (32 x 32); an instruction occupies the cells of its
``tile`` (``(start_row, rows, start_column, columns)``, from the trace) or, untiled, every cell.
Instructions on disjoint cells overlap; an instruction waits for the cells it needs.

* Program order (:class:`InOrderPe`): TensorE issues in program order, so an instruction starts no
  earlier than the one before it started, and no earlier than its cells are free.
* Dependency bound (:class:`GapPe`): each cell keeps its free gaps (a :class:`GapLane`); an
  instruction takes the earliest start at or after its ready time at which every cell it needs is
  free for its whole service.

Busy time is counted by area (service x cells used / all cells), so the busiest-engine lower bound
stays a bound. A program with no tiled instruction uses the plain lanes (same results, less work).
"""

from __future__ import annotations

from ..hw import MATMUL_TILE_SIZES

PE_SIDE = MATMUL_TILE_SIZES[-1]            # the systolic array is PE_SIDE x PE_SIDE
CELL = MATMUL_TILE_SIZES[0]                # the smallest row / column tile
CELLS_PER_SIDE = PE_SIDE // CELL
ALL_CELLS = tuple(range(CELLS_PER_SIDE * CELLS_PER_SIDE))
GAP_ROUNDS = 256                           # GapPe: gap-alignment rounds before taking the open end


def cells_of(tile) -> tuple[int, ...]:
    """The cells a trace entry's ``tile`` attribute covers (every cell when untiled)."""
    if not tile:
        return ALL_CELLS
    row0, rows, col0, cols = tile
    return tuple(r * CELLS_PER_SIDE + c
                 for r in range(row0 // CELL, (row0 + rows) // CELL)
                 for c in range(col0 // CELL, (col0 + cols) // CELL))


def area(cells: tuple[int, ...]) -> float:
    """The share of the array the cells are."""
    return len(cells) / len(ALL_CELLS)


def uses_tiles(entries) -> bool:
    """Whether any TensorE entry of a program names a tile (otherwise the plain lanes serve)."""
    return any(e.engine == "tensor" and e.attrs.get("tile") for e in entries)


class InOrderPe:
    """TensorE in program order over its cells: start >= the previous start and >= the cells' free times."""

    def __init__(self) -> None:
        self.free = [0.0] * len(ALL_CELLS)
        self.last: list[int | None] = [None] * len(ALL_CELLS)
        self.issued, self.issued_by = 0.0, None

    def fit(self, ready: float, service: float, cells=ALL_CELLS) -> tuple[float, int | None]:
        start, who = self.issued, self.issued_by
        for c in cells:
            if self.free[c] > start:
                start, who = self.free[c], self.last[c]
        return (start, who) if start > ready else (ready, None)

    def take(self, start: float, end: float, position: int, cells=ALL_CELLS) -> None:
        for c in cells:
            self.free[c], self.last[c] = end, position
        self.issued, self.issued_by = start, position


class GapPe:
    """TensorE with reordering: one gap lane per cell; an instruction needs a common gap."""

    def __init__(self, lane_type) -> None:
        self.lanes = [lane_type() for _ in ALL_CELLS]

    def fit(self, ready: float, service: float, cells=ALL_CELLS) -> tuple[float, int | None]:
        t, who = ready, None
        for _ in range(GAP_ROUNDS):
            fits = [self.lanes[c].fit(t, service) for c in cells]
            latest = max(fits, key=lambda f: f[0])
            if latest[0] <= t + 1e-9:
                return t, who
            t, who = latest
        t = max(self.lanes[c].starts[-1] for c in cells)   # every cell's open-ended gap holds it
        return max(t, ready), None

    def take(self, start: float, end: float, position: int, cells=ALL_CELLS) -> None:
        for c in cells:
            self.lanes[c].take(start, end, position)
