"""Engine accumulator registers (docs/nki-semantics.md §8.0.1): one fp32 register per lane, driven by reduce_cmd."""

from __future__ import annotations

import numpy as np

from ..ops import Op
from ..state import Program
from ._common import write
from .constants import reduce_cmd as _reduce_cmd

__all__ = ["accumulate"]


def accumulate(c: Program, acc: np.ndarray, cmd, op: Op | None, row_red, p: int, reduce_res, init=None,
               negate_res=False):
    """Apply ``cmd`` to lanes ``[0, p)`` of ``acc`` with per-lane partial ``row_red`` (fp32, shape (p,))."""
    if not isinstance(cmd, _reduce_cmd):
        c.fail("reduce_cmd", f"must be a nisa.reduce_cmd member, got {cmd!r}")
    if cmd != _reduce_cmd.idle:
        c.check(op is not None, "reduce_op", f"reduce_cmd.{cmd.name} needs a reduce_op")
        c.check(op.reduce_identity is not None and op.alu is not None and not op.bitvec, "reduce_op",
                f"{op!r} is not a legal reduce operator")
        ident = np.float32(op.reduce_identity)
        if cmd == _reduce_cmd.reset:
            acc[:p] = ident
        elif cmd == _reduce_cmd.reset_reduce:
            acc[:p] = op.alu(np.full(p, ident, np.float32), row_red)
        elif cmd == _reduce_cmd.reduce:
            acc[:p] = op.alu(acc[:p], row_red)
        else:  # load_reduce
            c.check(init is not None, "reduce_init", "reduce_cmd.load_reduce needs an initial value")
            acc[:p] = op.alu(np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (p,)).copy(), row_red)
    if reduce_res is not None:
        values = acc[:p].copy()
        write(c, reduce_res, -values if negate_res else values, "reduce_res")
