"""Trainium cost model on the simulator trace (``docs/cost-model.md`` §7).

``estimate(report_or_trace, target=...) -> Estimate`` schedules a recorded trace on a model of
one NeuronCore per program (TensorE, VectorE, ScalarE, GpSimd, sync, 16 DMA engines) and
reports estimated time, per-engine busy time and utilisation, the critical engine, lower and
upper bounds, and MFU / roofline fractions for an :class:`OpCost`. Every constant lives in
:mod:`.constants` with its source and confidence; the per-instruction rules are in
:mod:`.costs`, the scheduler in :mod:`.schedule`, the rooflines in :mod:`.roofline`.
"""

from .constants import TARGETS, HardwareParams, Param, low_confidence, params
from .costs import InstrCost, instruction_cost
from .estimate import Estimate, estimate
from .roofline import ElementWork, OpCost, Roofline, element_time_ns, roofline
from .sensitivity import Corner, corners, figure_range

__all__ = ["TARGETS", "HardwareParams", "Param", "params", "low_confidence", "InstrCost", "instruction_cost",
           "Estimate", "estimate", "ElementWork", "OpCost", "Roofline", "element_time_ns", "roofline", "Corner",
           "corners", "figure_range"]
