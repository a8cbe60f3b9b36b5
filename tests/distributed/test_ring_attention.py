"""ring_attention on 2 and 4 gloo ranks equals single-process flash_attention (outputs, lse, dq,
dk, dv, dsinks) within the numerics table, on the reference and the simulator path; plus the
pure planning of the visible sub-rectangles against the dense mask."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from hypothesis import example, given
from hypothesis import strategies as st

import nki_lib
from nki_lib.attention import flash_attention, masks, ring_attention
from nki_lib.attention import flash_attention_reference as reference
from nki_lib.attention.ring_attention_plan import plan_block, segments
from nki_lib.numerics import parity

# --------------------------------------------------------------------------- planning (pure)

def _positions(split, size, rank, local_len):
    return torch.cat([torch.arange(s.global_start, s.global_start + s.length)
                      for s in segments(split, size, rank, local_len)])


@given(size=st.integers(1, 4), local_len=st.integers(1, 6).map(lambda n: 2 * n),
       split=st.sampled_from(["contiguous", "zigzag"]), causal=st.booleans(),
       wl=st.integers(-1, 9), wr=st.integers(-1, 9))
@example(size=4, local_len=2, split="zigzag", causal=True, wl=0, wr=-1)
@example(size=2, local_len=4, split="contiguous", causal=False, wl=-1, wr=0)
def test_blocks_tile_the_global_mask(size, local_len, split, causal, wl, wr):
    """Over all (query rank, key rank) pairs, the planned sub-rectangles with flash_attention's
    bottom-right-aligned window reproduce the global mask exactly, and skipped pairs see nothing."""
    total = size * local_len
    full = masks.full_mask(total, total, causal=causal, window_left=wl, window_right=wr,
                           cu_seqlens=None, device="cpu")
    for qr, kr in itertools.product(range(size), repeat=2):
        for q_seg in segments(split, size, qr, local_len):
            for k_seg in segments(split, size, kr, local_len):
                want = full[q_seg.global_start:q_seg.global_start + q_seg.length,
                            k_seg.global_start:k_seg.global_start + k_seg.length]
                got = torch.zeros_like(want)
                block = plan_block(q_seg, k_seg, causal=causal, window=(wl, wr))
                if block is not None:
                    sq, sk = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
                    assert block.window_left >= -1 and block.window_right >= -1
                    got[block.rows, block.cols] = masks.full_mask(
                        sq, sk, causal=False, window_left=block.window_left,
                        window_right=block.window_right, cu_seqlens=None, device="cpu")
                assert torch.equal(got, want), (q_seg, k_seg, block)


# --------------------------------------------------------------------------- distributed parity

def _case_inputs(case, seed):
    """float64 tensors holding values exactly representable in the case's dtype (sinks: float32)."""
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = case["b"], case["hq"], case["hkv"], case["s"], case["d"]
    dtype = case.get("dtype", torch.float32)
    def mk(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = (mk(b, h, s, d).to(dtype).to(torch.float64) for h in (hq, hkv, hkv))
    sinks = mk(hq).to(torch.float32).to(torch.float64) if case.get("sinks") else None
    w_out, w_lse = mk(b, hq, s, d), mk(b, hq, s)
    return q, k, v, sinks, w_out, w_lse


def _flags(case):
    return {"causal": case.get("causal", False), "window": case.get("window", (-1, -1)),
            "softcap": case.get("softcap", 0.0)}


def _grads(fn, q, k, v, sinks, w_out, w_lse):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().requires_grad_(True)
    out, lse = fn(*leaves, sink_leaf)
    loss = (out.to(torch.float64) * w_out).sum() + (lse.to(torch.float64) * w_lse).sum()
    grads = torch.autograd.grad(loss, leaves + ([sink_leaf] if sink_leaf is not None else []))
    return [out.detach(), lse.detach(), *grads]


def _gather_rows(local, positions, world):
    """The global tensor from every rank's rows (dim 2) at their global positions."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    pos = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(pos, positions)
    full = torch.empty(*local.shape[:2], local.shape[2] * world, *local.shape[3:], dtype=local.dtype)
    for part, p in zip(parts, pos):
        full[:, :, p] = part
    return full


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _run_ring(case, tensors, positions, path):
    dtype, flags = case.get("dtype", torch.float32), _flags(case)
    q, k, v, sinks, w_out, w_lse = tensors

    def ring(q_, k_, v_, s_):
        return ring_attention(q_, k_, v_, group=None, sinks=s_, split=case.get("split", "contiguous"),
                              return_lse=True, **flags)

    with nki_lib.use_backend(path), nki_lib.strict(path == "simulator"):
        return _grads(ring, *(t[:, :, positions].to(dtype) for t in (q, k, v)),
                      None if sinks is None else sinks.to(torch.float32),
                      w_out[:, :, positions], w_lse[:, :, positions])


def _run_single(case, tensors, path):
    dtype, flags = case.get("dtype", torch.float32), _flags(case)
    q, k, v, sinks, w_out, w_lse = tensors

    def single(q_, k_, v_, s_):
        return flash_attention(q_, k_, v_, sinks=s_, return_lse=True, **flags)

    def oracle(q_, k_, v_, s_):
        return reference.naive(q_, k_, v_, s_, causal=flags["causal"], window_left=flags["window"][0],
                               window_right=flags["window"][1], softcap=flags["softcap"])

    with nki_lib.use_backend(path), nki_lib.strict(path == "simulator"):
        baseline = _grads(single, *(t.to(dtype) for t in (q, k, v)),
                          None if sinks is None else sinks.to(torch.float32), w_out, w_lse)
    return baseline, _grads(oracle, q, k, v, sinks, w_out, w_lse)


def _ring_rank(rank, world, cases, path):
    """Every case on this rank; rank 0 returns the parity verdicts ``(ok, text)``."""
    verdicts = []
    for index, case in enumerate(cases):
        tensors = _case_inputs(case, seed=index)
        positions = _positions(case.get("split", "contiguous"), world, rank, case["s"] // world)
        ring = _run_ring(case, tensors, positions, path)
        gathered = [_gather_rows(t, positions, world) for t in ring[:5]]
        if tensors[3] is not None:
            dsinks = ring[5].clone()
            dist.all_reduce(dsinks)  # the rank-local shares of a replicated parameter's gradient
            gathered.append(dsinks)
        if rank != 0:
            continue
        single, oracle = _run_single(case, tensors, path)
        dtype = case.get("dtype", torch.float32)
        for name, got, one, want in zip(NAMES, gathered, single, oracle):
            kind = "output" if name in ("out", "lse") else "grad"
            verdict = parity(got, want, one, kind=kind, dtype=dtype, name=f"{case} {name}")
            verdicts.append((verdict.ok, str(verdict)))
    return verdicts


def _check(world, cases, path):
    verdicts = run_ranks(world, _ring_rank, cases, path)[0]
    assert len(verdicts) >= 5 * len(cases)
    failed = [text for ok, text in verdicts if not ok]
    assert not failed, "\n".join(failed)


BASE = {"b": 1, "hq": 4, "hkv": 2, "d": 16}

REFERENCE_CASES = [
    dict(BASE, s=16, causal=False, split="contiguous"),
    dict(BASE, s=16, causal=True, split="contiguous"),
    dict(BASE, s=16, causal=True, split="zigzag"),
    dict(BASE, s=16, causal=False, split="zigzag", window=(3, 2)),
    dict(BASE, s=16, causal=True, split="zigzag", window=(5, -1), sinks=True),
    dict(BASE, s=16, causal=False, split="contiguous", window=(-1, 4), softcap=5.0, sinks=True),
    dict(BASE, hq=2, hkv=1, s=16, causal=True, split="contiguous", dtype=torch.bfloat16),
]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_flash_attention_reference_path(world):
    _check(world, REFERENCE_CASES, "reference")


SIMULATOR_CASES = [
    dict(BASE, s=16, causal=True, split="zigzag", sinks=True),
    dict(BASE, s=16, causal=False, split="contiguous", window=(3, 2)),
]


def test_ring_attention_matches_flash_attention_simulator_path():
    _check(2, SIMULATOR_CASES, "simulator")


def test_ring_attention_rejects_bad_arguments():
    def rank_fn(rank, world):
        q = torch.randn(1, 2, 3, 8)
        errors = []
        for kwargs in ({"split": "zigzag"}, {"split": "spiral"}, {"window": (1,)}):
            try:
                ring_attention(q, q, q, group=None, **kwargs)
            except ValueError as err:
                errors.append(str(err))
        try:
            ring_attention(q, q[:, :, :2], q[:, :, :2], group=None)
        except ValueError as err:
            errors.append(str(err))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        same = torch.equal(ring_attention(q, q, q, group=mesh["cp"]), ring_attention(q, q, q, group=None))
        return errors, same

    errors, same_on_mesh = run_ranks(2, rank_fn)[0]
    assert same_on_mesh
    assert len(errors) == 4
    assert "zigzag" in errors[0] and "split" in errors[1] and "window" in errors[2] and "k" in errors[3]
