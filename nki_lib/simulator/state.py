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


class BarrierBroken(RuntimeError):
    """The peer program failed or ended without reaching a barrier this program waits at."""


class ProgramBarrier:
    """Barrier between the programs of one run: the k-th wait of each program pairs with the k-th of
    the others. A wait fails (instead of hanging) when a peer failed or finished without reaching it."""

    def __init__(self, parties: int):
        self.cond = threading.Condition()
        self.count = [0] * parties
        self.done = [False] * parties
        self.broken = False

    def wait(self, pid: int) -> None:
        with self.cond:
            self.count[pid] += 1
            n = self.count[pid]
            self.cond.notify_all()
            others = [q for q in range(len(self.count)) if q != pid]
            while True:
                if self.broken:
                    raise BarrierBroken("the other LNC program failed; barrier abandoned")
                if all(self.count[q] >= n for q in others):
                    return
                if any(self.done[q] and self.count[q] < n for q in others):
                    raise NKIRuleError(_opcode_of(pid), "cores", "the other LNC program ended without reaching "
                                       "this barrier (programs must follow the same control flow)",
                                       kernel_source(2))
                self.cond.wait()

    def finish(self, pid: int) -> None:
        with self.cond:
            self.done[pid] = True
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


def _opcode_of(pid):
    prog = current_or_none()
    return prog.opcode if prog is not None else "core_barrier"


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
        self.barrier = ProgramBarrier(grid)
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
        self.physical_mem = {}
        self.scalar_acc = np.zeros(run.spec.pmax, dtype=np.float32)
        self.vector_acc = np.zeros(run.spec.pmax, dtype=np.float32)

    def physical(self, kind: str):
        """(bytes, partition size) of this program's physical SBUF or PSUM."""
        mem = self.physical_mem.get(kind)
        if mem is None:
            row = self.spec.sbuf_usable_bytes if kind == "sbuf" else self.spec.psum_partition_bytes
            data = np.full(self.spec.pmax * row, 0xFF, dtype=np.uint8)
            mem = self.physical_mem[kind] = (data, row)
        return mem

    def check_capacity(self) -> None:
        """Judge SBUF/PSUM capacity on the liveness intervals of the finished trace (sets the peaks)."""
        overflow = self.tracker.finish()
        if overflow is not None:
            life, rule = overflow
            raise NKIRuleError("ndarray", life.label, f"{rule}; {life.describe()} overflows", life.source)

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
