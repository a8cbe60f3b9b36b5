"""Per-run and per-program (kernel instance) state; the calling thread's current program."""

from __future__ import annotations

import itertools
import threading

import numpy as np

from .errors import NKIRuleError, kernel_source
from .memory import MemoryTracker
from .target import TargetSpec
from .trace import TraceEntry

__all__ = ["Run", "Program", "current", "current_or_none", "set_current"]

_tls = threading.local()


class Run:
    """One ``simulate`` call: shared across its programs (LNC2: two threads)."""

    def __init__(self, kernel_name: str, spec: TargetSpec, grid: int, grid_given: bool, recording: bool):
        self.kernel_name = kernel_name
        self.spec = spec
        self.grid = grid
        self.grid_given = grid_given
        self.recording = recording
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.shared_allocs: list = []          # k-th shared_hbm allocation -> Storage
        self.barrier = threading.Barrier(grid)
        self.mailbox: dict = {}
        self.arg_storages: set = set()

    def next_id(self) -> int:
        with self.lock:
            return next(self.ids)


class Program:
    """One kernel instance: its memory tracker, trace, engine accumulators and counters."""

    def __init__(self, run: Run, pid: int):
        self.run = run
        self.pid = pid
        self.spec = run.spec
        self.tracker = MemoryTracker(run.spec)
        self.trace = [] if run.recording else None
        self.n_instr = 0
        self.opcode = "kernel"
        self.shared_seq = 0
        self.scalar_acc = np.zeros(run.spec.pmax, dtype=np.float32)
        self.vector_acc = np.zeros(run.spec.pmax, dtype=np.float32)

    def begin(self, opcode: str) -> "Program":
        self.opcode = opcode
        return self

    def fail(self, operand: str, rule: str):
        raise NKIRuleError(self.opcode, operand, rule, kernel_source(2))

    def check(self, cond: bool, operand: str, rule: str):
        if not cond:
            raise NKIRuleError(self.opcode, operand, rule, kernel_source(2))

    def record(self, engine, reads, writes, shape, dtype, elements, nbytes, attrs=None):
        index = self.n_instr
        self.n_instr = index + 1
        if self.trace is not None:
            self.trace.append(TraceEntry(
                index, self.pid, engine, self.opcode,
                tuple(t._access() for t in reads), tuple(t._access() for t in writes),
                tuple(shape), str(dtype), int(elements), int(nbytes), attrs or {}, kernel_source(2)))


def current() -> Program:
    prog = getattr(_tls, "program", None)
    if prog is None:
        raise RuntimeError("NKI kernel code ran outside a simulated kernel: call it through "
                           "nki_lib.simulator.simulate(kernel)(...) or a @jit kernel")
    return prog


def current_or_none() -> Program | None:
    return getattr(_tls, "program", None)


def set_current(prog: Program | None) -> None:
    _tls.program = prog
