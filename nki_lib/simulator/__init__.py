"""nki_lib.simulator: a CPU interpreter of the NKI programming model (see README.md here).

Laid out like the real ``nki`` package: ``jit``, ``simulate``, ``language``, ``isa`` (with
``isa.constants``), ``tile_size``. ``install_as_nki()`` makes ``import nki`` resolve to it.
"""

from __future__ import annotations

from . import isa, language
from .dtypes import NkiDType as dtype
from .errors import NKIRuleError
from .launch import Kernel, install_as_nki, jit, last_run, recording, simulate, uninstall_nki
from .target import get_target, set_target, tile_size
from .trace import Access, RunReport, TraceEntry

__nki_lib_simulator__ = True

__all__ = ["jit", "simulate", "language", "isa", "tile_size", "install_as_nki", "uninstall_nki", "set_target",
           "get_target", "NKIRuleError", "last_run", "recording", "RunReport", "TraceEntry", "Access", "Kernel",
           "dtype"]
