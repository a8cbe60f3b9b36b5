"""Storage (one allocation) and per-program SBUF/PSUM capacity tracking.

Storage is a flat byte buffer. On-chip (SBUF/PSUM) storage is partition-major: ``nparts``
partitions of ``bpp`` bytes each, so flat element ``e`` of any dtype lives in partition
``e // (bpp // itemsize)``. Automatically placed tiles own their buffer (row stride ``bpp``);
tiles placed with ``address=`` are windows onto the program's physical SBUF/PSUM (row stride = the
partition size), so overlapping placements alias like on hardware and a fresh placement reads whatever
an earlier tile left there (physical memory starts as all-ones bytes: NaN for every float dtype).

Liveness rule: an SBUF/PSUM allocation is live from ``nl.ndarray`` until its storage is garbage
collected (the last view referencing it is dropped; CPython frees it at once) or the kernel ends.
A tile allocated in the body of an unrolled loop is therefore freed when the loop variable is
rebound, so loop-local tiles do not accumulate (at the rebinding point two generations are briefly
live, like a double-buffered tile).
Capacity: SBUF bytes per partition = sum of the live automatic allocations' bytes per partition
plus the highest end address of the live manually placed (``address=``) ones, against the usable
SBUF per partition of the target. PSUM: every allocation occupies whole 2 KiB banks (8 per
partition); manual PSUM allocations occupy the banks their address range covers.
"""

from __future__ import annotations

import threading
import weakref
from enum import Enum

import numpy as np

from .dtypes import NkiDType, is_float, is_int, np_dtype
from .target import TargetSpec

__all__ = ["Storage", "MemoryTracker", "MemoryRegion", "KIND_TO_REGION", "ONCHIP", "HBM_KINDS"]

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
                 "bstart", "manual", "row_bytes", "base", "alloc_dtype", "alloc_shape", "_typed", "__weakref__")

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
        self.row_bytes, self.base = self.bpp, 0
        if physical is not None:                   # window onto the program's physical memory
            buf, self.mm_mask, self.row_bytes = physical
            self.base = self.pstart * self.row_bytes + self.bstart
            self.buf = buf
            return
        if buf is None:
            buf = np.empty(self.nbytes, dtype=np.uint8)
            self._fill_sentinel(buf)
        self.buf = buf
        self.mm_mask = np.zeros(self.nbytes, dtype=np.uint8) if kind == "psum" else None

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


class MemoryTracker:
    """Live SBUF bytes / PSUM banks of one kernel instance, with peaks; overflow is reported by alloc."""

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.lock = threading.RLock()
        self.sbuf_auto = 0
        self.sbuf_manual = {}      # storage id -> end byte
        self.psum_bytes = 0
        self.psum_banks = 0
        self.psum_manual = {}      # storage id -> set of banks
        self.peak_sbuf = 0
        self.peak_psum_bytes = 0
        self.peak_psum_banks = 0
        self.closed = False

    def sbuf_in_use(self) -> int:
        return self.sbuf_auto + max(self.sbuf_manual.values(), default=0)

    def banks_in_use(self) -> int:
        manual = set().union(*self.psum_manual.values()) if self.psum_manual else set()
        return self.psum_banks + len(manual)

    def request(self, storage: Storage) -> str | None:
        """Account for ``storage``; returns a rule text when it does not fit (nothing recorded then)."""
        bank = self.spec.psum_bank_bytes
        with self.lock:
            if storage.kind == "sbuf":
                manual = storage.manual
                if manual:
                    self.sbuf_manual[storage.id] = storage.bstart + storage.bpp
                else:
                    self.sbuf_auto += storage.bpp
                used = self.sbuf_in_use()
                if used > self.spec.sbuf_usable_bytes:
                    self._undo(storage, manual)
                    return (f"SBUF capacity exceeded: {used} bytes per partition live, target "
                            f"{self.spec.name} has {self.spec.sbuf_usable_bytes} usable")
                self.peak_sbuf = max(self.peak_sbuf, used)
                weakref.finalize(storage, self._free_sbuf, storage.id, storage.bpp, manual)
            elif storage.kind == "psum":
                manual = storage.manual
                nbanks = -(-storage.bpp // bank)
                if manual:
                    first = storage.bstart // bank
                    self.psum_manual[storage.id] = set(range(first, first + nbanks))
                else:
                    self.psum_banks += nbanks
                self.psum_bytes += storage.bpp
                used = self.banks_in_use()
                if used > self.spec.psum_num_banks:
                    self._undo(storage, manual, nbanks)
                    return (f"PSUM capacity exceeded: {used} banks of 2 KiB per partition live, "
                            f"only {self.spec.psum_num_banks} exist")
                self.peak_psum_banks = max(self.peak_psum_banks, used)
                self.peak_psum_bytes = max(self.peak_psum_bytes, self.psum_bytes)
                weakref.finalize(storage, self._free_psum, storage.id, storage.bpp, nbanks, manual)
        return None

    def _undo(self, storage, manual, nbanks=0):
        if storage.kind == "sbuf":
            if manual:
                del self.sbuf_manual[storage.id]
            else:
                self.sbuf_auto -= storage.bpp
        else:
            if manual:
                del self.psum_manual[storage.id]
            else:
                self.psum_banks -= nbanks
            self.psum_bytes -= storage.bpp

    def _free_sbuf(self, sid, bpp, manual):
        with self.lock:
            if self.closed:
                return
            if manual:
                self.sbuf_manual.pop(sid, None)
            else:
                self.sbuf_auto -= bpp

    def _free_psum(self, sid, bpp, nbanks, manual):
        with self.lock:
            if self.closed:
                return
            if manual:
                self.psum_manual.pop(sid, None)
            else:
                self.psum_banks -= nbanks
            self.psum_bytes -= bpp

    def close(self):
        with self.lock:
            self.closed = True
