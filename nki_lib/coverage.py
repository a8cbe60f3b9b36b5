"""The coverage ledger: which path served each op call, and why any call fell back.

``nki_lib.coverage()`` returns a ``Coverage`` snapshot: ``{op: {path: PathStats}}`` where
``PathStats`` has ``calls`` and ``fallbacks`` (reason -> count; a fallback is counted under the
path that could not serve the call, and the call itself under ``reference``). It also counts the
distinct kernel specializations per op (each distinct static shape/dtype/flag set is one device
compilation). ``print(nki_lib.coverage())`` prints a table.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class PathStats:
    calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)


class Coverage(dict):
    """Snapshot of the ledger: ``{op: {path: PathStats}}`` plus ``specializations``."""

    def __init__(self, data: dict, specializations: dict[str, int], emulated_aten: Counter | None = None):
        super().__init__(data)
        self.specializations = specializations
        self.emulated_aten = Counter() if emulated_aten is None else emulated_aten

    def __str__(self) -> str:
        header = ("op", "path", "calls", "kernel specializations", "fallback reasons")
        rows = [header]
        for op in sorted(self):
            for path in sorted(self[op]):
                stats = self[op][path]
                reasons = "; ".join(f"{r} (x{n})" for r, n in sorted(stats.fallbacks.items())) or "-"
                spec = str(self.specializations.get(op, 0)) if path != "reference" else "-"
                rows.append((op, path, str(stats.calls), spec, reasons))
        if len(rows) == 1:
            return "coverage: no nki op has been called" + self._emulated_line()
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines) + self._emulated_line()

    def _emulated_line(self, top: int = 8) -> str:
        """Aten calls on emulated neuron tensors (``nki_lib.emulate_neuron``), most frequent first."""
        if not self.emulated_aten:
            return ""
        most = ", ".join(f"{name} x{n}" for name, n in self.emulated_aten.most_common(top))
        return (f"\nemulated aten calls on neuron (CPU underneath): {sum(self.emulated_aten.values())} "
                f"of {len(self.emulated_aten)} ops; {most}")


class _Scope:
    """What the ledger recorded inside one :meth:`_Ledger.scope` block (filled at its end)."""

    def __init__(self) -> None:
        self._snapshot: Coverage | None = None
        self._keys: dict[str, set] = {}

    def snapshot(self) -> Coverage:
        return self._snapshot

    def specialization_keys(self) -> dict[str, set]:
        return self._keys


class _Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, str], None]] = []
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._stats: dict[str, dict[str, PathStats]] = defaultdict(lambda: defaultdict(PathStats))
            self._specializations: dict[str, set] = defaultdict(set)
            self._emulated_aten: Counter = Counter()

    def record_call(self, op: str, path: str) -> None:
        with self._lock:
            self._stats[op][path].calls += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(op, path)

    @contextlib.contextmanager
    def on_call(self, listener: Callable[[str, str], None]) -> Iterator[None]:
        """Call ``listener(op, path)`` for every op call recorded inside the block."""
        with self._lock:
            self._listeners.append(listener)
        try:
            yield
        finally:
            with self._lock:
                self._listeners.remove(listener)

    @contextlib.contextmanager
    def scope(self) -> Iterator[_Scope]:
        """Record the block on its own (read it from the yielded object after the block); the
        process-wide ledger then holds the earlier records plus the block's."""
        scope = _Scope()
        with self._lock:
            saved = (self._stats, self._specializations, self._emulated_aten)
        self.reset()
        try:
            yield scope
        finally:
            scope._snapshot = self.snapshot()
            with self._lock:
                scope._keys = {op: set(keys) for op, keys in self._specializations.items()}
                inner = (self._stats, self._specializations, self._emulated_aten)
                self._stats, self._specializations, self._emulated_aten = saved
                for op, paths in inner[0].items():
                    for path, stats in paths.items():
                        self._stats[op][path].calls += stats.calls
                        self._stats[op][path].fallbacks.update(stats.fallbacks)
                for op, keys in inner[1].items():
                    self._specializations[op] |= keys
                self._emulated_aten.update(inner[2])

    def record_fallback(self, op: str, path: str, reason: str) -> None:
        with self._lock:
            self._stats[op][path].fallbacks[reason] += 1

    def record_specialization(self, op: str, key: tuple) -> None:
        with self._lock:
            self._specializations[op].add(key)

    def record_emulated_aten(self, name: str) -> None:
        with self._lock:
            self._emulated_aten[name] += 1

    def snapshot(self) -> Coverage:
        with self._lock:
            data = {
                op: {p: PathStats(s.calls, Counter(s.fallbacks)) for p, s in paths.items()}
                for op, paths in self._stats.items()
            }
            specs = {op: len(keys) for op, keys in self._specializations.items()}
            emulated = Counter(self._emulated_aten)
        return Coverage(data, specs, emulated)


LEDGER = _Ledger()


def coverage() -> Coverage:
    """Per op and path: calls, fallback reasons with counts, and kernel specializations."""
    return LEDGER.snapshot()


def reset_coverage() -> None:
    LEDGER.reset()
