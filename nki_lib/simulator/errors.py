"""The one exception type for hardware-rule violations, and how the kernel source line is found."""

from __future__ import annotations

import os
import sys

__all__ = ["NKIRuleError", "kernel_source", "fail"]



_PKG = __name__.rpartition(".")[0]          # "nki_lib.simulator"
_SOURCES: dict = {}                          # (filename, line) -> "file.py:LINE"


def kernel_source(depth: int = 1) -> str:
    """``"file.py:LINE"`` of the innermost stack frame outside ``nki_lib/simulator``."""
    frame = sys._getframe(depth)
    while frame is not None:
        if not frame.f_globals.get("__name__", "").startswith(_PKG):
            key = (frame.f_code.co_filename, frame.f_lineno)
            text = _SOURCES.get(key)
            if text is None:
                text = _SOURCES[key] = f"{os.path.basename(key[0])}:{key[1]}"
            return text
        frame = frame.f_back
    return "<unknown>:0"


class NKIRuleError(ValueError):
    """A kernel broke a hardware or NKI API rule.

    Attributes: ``instruction`` (e.g. ``"nc_matmul"``), ``operand`` (the argument name, e.g.
    ``"moving"``), ``rule`` (what was violated) and ``source`` (``"file.py:LINE"`` of the kernel
    line that issued the instruction).
    """

    def __init__(self, instruction: str, operand: str, rule: str, source: str | None = None):
        self.instruction = instruction
        self.operand = operand
        self.rule = rule
        self.source = source if source is not None else kernel_source(2)
        super().__init__(
            f"{self.instruction}: operand '{self.operand}' breaks rule: {self.rule} (kernel line {self.source})"
        )

    def __reduce__(self):
        return (type(self), (self.instruction, self.operand, self.rule, self.source))


def fail(instruction: str, operand: str, rule: str):
    """Raise an NKIRuleError for the innermost kernel line."""
    raise NKIRuleError(instruction, operand, rule, kernel_source(2))
