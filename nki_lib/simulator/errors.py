"""The one exception type for hardware-rule violations, and how the kernel source line is found."""

from __future__ import annotations

import os
import sys

__all__ = ["NKIRuleError", "kernel_source"]

_SIM_DIR = os.path.dirname(os.path.abspath(__file__))


_INSIDE: dict = {}   # code object -> True when it belongs to the simulator


def kernel_source(depth: int = 1) -> str:
    """``"file.py:LINE"`` of the innermost stack frame outside ``nki_lib/simulator``."""
    frame = sys._getframe(depth)
    inside = _INSIDE
    while frame is not None:
        code = frame.f_code
        flag = inside.get(code)
        if flag is None:
            flag = inside[code] = code.co_filename.startswith(_SIM_DIR)
        if not flag:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
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
