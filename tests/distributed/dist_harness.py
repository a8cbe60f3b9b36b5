"""Run a function on P local processes joined by a gloo process group (loopback only).

``run_ranks(world, fn, *args)`` forks ``world`` processes (fork: the test process's imports are
reused, so a group starts in well under a second), each joins a gloo group on 127.0.0.1 at a free
port, runs ``fn(rank, world, *args)`` and reports its return value (pickled by value: tensors are
copied, not shared with a process that exits) or its traceback.
Every wait is bounded: a group that does not finish within ``timeout`` seconds is terminated and
the test fails with what each rank reported.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 60   # a collective that waits longer than this raises inside the rank
RUN_TIMEOUT_S = 150    # the whole group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    torch.set_num_threads(1)   # forked children share 2 cores; no OpenMP pool across fork
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        value = fn(rank, world, *args)
        dist.barrier()   # no rank tears the group down while another is still connecting or sending
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, False, pickle.dumps(traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = RUN_TIMEOUT_S) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, computed on ``world`` ranks."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[bool, object]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(reports) < world:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs if p.pid) and results.empty():
                    break
                continue
            reports[rank] = (ok, pickle.loads(value))
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(reports.items()) if not ok]
    missing = [r for r in range(world) if r not in reports]
    if missing:
        failures.append(f"ranks {missing} did not report within {timeout}s "
                        f"(exit codes {[p.exitcode for p in procs]})")
    if failures:
        raise AssertionError("\n".join(failures))
    return [reports[r][1] for r in range(world)]
