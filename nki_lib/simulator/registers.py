"""``VirtualRegister``: a 32-bit engine register (docs/nki-semantics.md §5.3)."""

from __future__ import annotations

__all__ = ["VirtualRegister"]


class VirtualRegister:
    """A 32-bit engine register; ``frozen`` for dynamic-loop induction variables."""

    __slots__ = ("value", "frozen")

    def __init__(self, value=None, frozen=False):
        self.value = None if value is None else int(value)
        self.frozen = frozen

    def __bool__(self):
        if self.value is None:
            raise ValueError("read of an uninitialised VirtualRegister")
        return self.value != 0

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"
