"""Regression: consecutive ``sendrecv`` exchanges on one ``pipe_id`` (legal NKI; the AWS kernels
use a fixed pipe_id in loops) must not lose messages between the two LNC2 cores."""

import numpy as np

from nki_lib import simulator as sim

nl, nisa = sim.language, sim.isa


@sim.jit
def _ping_pong(x):
    out = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    mine = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
    theirs = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[nl.ds(pid, 1), :])
    for _ in range(64):
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        nisa.tensor_scalar(dst=mine, data=theirs, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=out[nl.ds(pid, 1), :], src=mine)
    return out


def test_reused_pipe_id_keeps_every_message():
    x = np.array([[0.0] * 4, [100.0] * 4], dtype=np.float32)
    out = sim.simulate(_ping_pong[2])(x)
    # 64 swaps (even: each core ends with its own lineage) and 64 increments
    np.testing.assert_array_equal(out, x + 64.0)
