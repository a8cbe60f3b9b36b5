"""Sensitivity of an estimate to the low-confidence constants (docs/cost-model.md §7.9).

Every ``L``-tagged constant with documented ``bounds`` (:func:`.constants.low_confidence`) is
set, one at a time, to its low and to its high bound; :func:`corners` lists those variants of a
target's table. A figure "holds over the documented ranges" when it holds at the nominal values
and at every corner. One-at-a-time corners are a choice (the figures are close to monotone in
each constant; joint extremes of unrelated constants are not documented as co-occurring).
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import HardwareParams, low_confidence, params

__all__ = ["Corner", "corners", "figure_range"]


@dataclass(frozen=True)
class Corner:
    """``hw`` = the nominal table with constant ``name`` at its ``side`` bound ``value``."""

    name: str
    side: str    # "low" | "high"
    value: float
    hw: HardwareParams

    @property
    def label(self) -> str:
        return f"{self.name}={self.value:g}"


def corners(target: str | HardwareParams) -> list[Corner]:
    """Each bounded low-confidence constant of ``target`` at its low and at its high bound."""
    hw = target if isinstance(target, HardwareParams) else params(target)
    out = []
    for name, (low, high) in sorted(low_confidence(hw).items()):
        for side, value in (("low", low), ("high", high)):
            source = f"sensitivity corner: {hw.param(name).bounds_source}"
            out.append(Corner(name, side, value, hw.with_values(source, **{name: value})))
    return out


def figure_range(nominal: float, values: dict) -> tuple[float, float, str, str]:
    """``(min, max, constant at min, constant at max)`` over the nominal value and the corners."""
    items = [("nominal", nominal), *values.items()]
    low = min(items, key=lambda kv: kv[1])
    high = max(items, key=lambda kv: kv[1])
    return low[1], high[1], low[0], high[0]
