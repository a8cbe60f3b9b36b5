"""Storage (one allocation) and per-program SBUF/PSUM capacity by liveness.

Storage is a flat byte buffer. On-chip (SBUF/PSUM) storage is partition-major: ``nparts``
partitions of ``bpp`` bytes each, so flat element ``e`` of any dtype lives in partition
``e // (bpp // itemsize)``. Automatically placed tiles own their buffer (row stride ``bpp``);
tiles placed with ``address=`` are windows onto the program's physical SBUF/PSUM (row stride = the
partition size), so overlapping placements alias like on hardware and a fresh placement reads whatever
an earlier tile left there (physical memory starts as all-ones bytes: NaN for every float dtype).
The matmul-written mask of ``nc_matmul(accumulate=None)`` belongs to the allocation (each PSUM
storage has its own, laid out like an own buffer), so a new allocation starts a new accumulation
group even on bytes an earlier allocation's matmuls wrote.

Liveness rule (as the compiler sees it): an SBUF/PSUM allocation is live from the first to the last
instruction that touches it, in program order; Python references do not matter and an allocation
no instruction touches occupies nothing. Every access stamps the allocation's ``Lifetime`` with the
program's instruction counter; capacity and peaks are judged on those intervals after the trace
(``MemoryTracker.finish``). Capacity: SBUF bytes per partition = sum of the live automatic
allocations' bytes per partition plus the highest end address of the live manually placed
(``address=``) ones, against the usable SBUF per partition of the target. PSUM: every automatic
allocation occupies whole 2 KiB banks (8 per partition); manual ones the banks their byte range
covers.
"""

from __future__ import annotations

import threading
from enum import Enum

import numpy as np

from .dtypes import NkiDType, is_float, is_int, np_dtype
from .target import TargetSpec

__all__ = ["Storage", "Lifetime", "MemoryTracker", "MemoryRegion", "KIND_TO_REGION", "ONCHIP", "HBM_KINDS"]

ONCHIP = ("sbuf", "psum")
HBM_KINDS = ("hbm", "private_hbm", "shared_hbm")
_INT_SENTINEL = 4


class MemoryRegion(str, Enum):
    """``nl.sbuf`` / ``nl.psum`` / ``nl.private_hbm`` (= ``nl.hbm``) / ``nl.shared_hbm``."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    def __str__(self) -> str:
        return self.value

    hbm = "private_hbm"  # alias (Enum makes it the same member)


KIND_TO_REGION = {"sbuf": MemoryRegion.sbuf, "psum": MemoryRegion.psum, "hbm": MemoryRegion.private_hbm,
                   "private_hbm": MemoryRegion.private_hbm, "shared_hbm": MemoryRegion.shared_hbm}


class Storage:
    """One allocation: a byte buffer plus placement metadata."""

    __slots__ = ("id", "kind", "nbytes", "bpp", "nparts", "buf", "mm_mask", "name", "pstart",
                 "bstart", "manual", "row_bytes", "base", "alloc_dtype", "alloc_shape", "_typed", "life",
                 "__weakref__")

    def __init__(self, sid, kind, alloc_dtype: NkiDType, alloc_shape, name="", buf=None, address=None,
                 physical=None):
        self.id = sid
        self.kind = kind
        self.name = name
        self.alloc_dtype = alloc_dtype
        self.alloc_shape = tuple(alloc_shape)
        itemsize = alloc_dtype.itemsize
        count = int(np.prod(self.alloc_shape, dtype=np.int64))
        if kind in ONCHIP:
            self.nparts = self.alloc_shape[0]
            self.bpp = (count // self.nparts) * itemsize
        else:
            self.nparts = 1
            self.bpp = count * itemsize
        self.nbytes = count * itemsize
        self.manual = address is not None
        self.pstart, self.bstart = (0, 0) if address is None else address
        self._typed = {}
        self.life = None                           # Lifetime, set by MemoryTracker.request (on-chip)
        self.row_bytes, self.base = self.bpp, 0
        self.mm_mask = np.zeros(self.nbytes, dtype=np.uint8) if kind == "psum" else None
        if physical is not None:                   # window onto the program's physical memory
            buf, self.row_bytes = physical
            self.base = self.pstart * self.row_bytes + self.bstart
            self.buf = buf
            return
        if buf is None:
            buf = np.empty(self.nbytes, dtype=np.uint8)
            self._fill_sentinel(buf)
        self.buf = buf

    def _fill_sentinel(self, buf):
        typed = buf.view(np_dtype(self.alloc_dtype))
        if is_float(self.alloc_dtype):
            typed.fill(np.nan)
        elif is_int(self.alloc_dtype):
            typed.fill(_INT_SENTINEL)
        else:
            buf.fill(0xFF if self.alloc_dtype != "bool" else 1)

    def typed(self, dtype: NkiDType) -> np.ndarray:
        """The whole storage as a 1-D array of ``dtype`` (a view, cached)."""
        arr = self._typed.get(dtype)
        if arr is None:
            itemsize = dtype.itemsize
            usable = self.nbytes - self.nbytes % itemsize
            arr = self.buf[:usable].view(np_dtype(dtype))
            self._typed[dtype] = arr
        return arr

    def elements(self, dtype: NkiDType) -> int:
        return self.nbytes // dtype.itemsize

    def partition_elems(self, dtype: NkiDType) -> int:
        return self.bpp // dtype.itemsize


class Lifetime:
    """First and last instruction (program order) that touched one on-chip allocation."""

    __slots__ = ("clock", "first", "last", "label", "source", "kind", "bpp", "manual", "bstart", "what")

    def __init__(self, clock, storage, source):
        self.clock = clock                         # the owning Program (its n_instr is the time)
        self.first = self.last = None
        self.label = storage.name or "ndarray"
        self.source = source
        self.kind, self.bpp, self.manual, self.bstart = storage.kind, storage.bpp, storage.manual, storage.bstart
        self.what = (storage.alloc_shape, str(storage.alloc_dtype))

    def describe(self) -> str:
        shape, dtype = self.what
        name = f"{self.label!r} " if self.label != "ndarray" else ""
        place = f" at byte {self.bstart}" if self.manual else ""
        return f"the {self.kind.upper()} allocation {name}{shape} {dtype}{place} (allocated at {self.source})"

    def touch(self):
        now = self.clock.n_instr
        if self.first is None:
            self.first = now
        self.last = now


class MemoryTracker:
    """SBUF bytes / PSUM banks of one kernel instance by liveness, with peaks and the first overflow."""

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.lock = threading.RLock()
        self.lives: list[Lifetime] = []
        self.peak_sbuf = 0
        self.peak_psum_bytes = 0
        self.peak_psum_banks = 0

    def request(self, storage: Storage, clock, source: str) -> None:
        """Start tracking ``storage`` (an on-chip allocation made at kernel line ``source``)."""
        storage.life = Lifetime(clock, storage, source)
        with self.lock:
            self.lives.append(storage.life)

    def finish(self):
        """Sweep the lifetimes in program order: set the peaks; the first overflow as
        ``(lifetime, rule text)`` or None."""
        sbuf = _Usage(self.spec.sbuf_usable_bytes, "SBUF", self.spec)
        psum = _Usage(self.spec.psum_num_banks, "PSUM", self.spec)
        overflow = None
        for when, start, life in _events(self.lives):
            usage = sbuf if life.kind == "sbuf" else psum
            if not start:
                usage.remove(life)
                continue
            usage.add(life)
            if overflow is None and usage.over():
                overflow = (life, usage.rule())
        self.peak_sbuf = sbuf.peak
        self.peak_psum_banks, self.peak_psum_bytes = psum.peak, psum.peak_bytes
        return overflow


def _events(lives):
    """(time, is_start, lifetime): an allocation is live over [first, last]; at one time the ends of
    allocations last used before it come first."""
    events = []
    for life in lives:
        if life.first is not None:
            events.append((life.first, 1, life))
            events.append((life.last + 1, 0, life))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


class _Usage:
    """Live bytes (SBUF, per partition) or banks (PSUM) of the allocations added and not removed."""

    def __init__(self, capacity, label, spec):
        self.capacity, self.label, self.bank = capacity, label, spec.psum_bank_bytes
        self.auto = 0                      # SBUF bytes / PSUM banks of automatic allocations
        self.manual = {}                   # lifetime -> end byte (SBUF) / set of banks (PSUM)
        self.bank_count = {}               # PSUM bank -> live manual allocations on it
        self.bytes = 0
        self.peak = self.peak_bytes = 0

    def _banks(self, life):
        return -(-life.bpp // self.bank)

    def add(self, life):
        self.bytes += life.bpp
        if self.label == "SBUF":
            if life.manual:
                self.manual[life] = life.bstart + life.bpp
            else:
                self.auto += life.bpp
        elif life.manual:
            first = life.bstart // self.bank
            for b in range(first, first + self._banks(life)):
                self.bank_count[b] = self.bank_count.get(b, 0) + 1
        else:
            self.auto += self._banks(life)
        used = self.used()
        self.peak = max(self.peak, used)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def remove(self, life):
        self.bytes -= life.bpp
        if self.label == "SBUF":
            if life.manual:
                del self.manual[life]
            else:
                self.auto -= life.bpp
        elif life.manual:
            first = life.bstart // self.bank
            for b in range(first, first + self._banks(life)):
                self.bank_count[b] -= 1
                if not self.bank_count[b]:
                    del self.bank_count[b]
        else:
            self.auto -= self._banks(life)

    def used(self) -> int:
        if self.label == "SBUF":
            return self.auto + max(self.manual.values(), default=0)
        return self.auto + len(self.bank_count)

    def over(self) -> bool:
        return self.used() > self.capacity

    def rule(self) -> str:
        if self.label == "SBUF":
            return (f"SBUF capacity exceeded: {self.used()} bytes per partition live (first to last use, "
                    f"in program order), only {self.capacity} usable")
        return (f"PSUM capacity exceeded: {self.used()} banks of 2 KiB per partition live (first to last "
                f"use, in program order), only {self.capacity} exist")
