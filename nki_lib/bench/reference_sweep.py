"""``nki-lib bench --sweep reference``: the CPU reference path against PyTorch's SDPA.

Each case times ``torch.ops.nki.flash_attention`` on the reference path and
``torch.nn.functional.scaled_dot_product_attention`` on the same call (forward, and forward +
backward), **interleaved** (ours, SDPA, ours, SDPA, ...) so that both see the same machine load;
the figure is the ratio of the medians. Where SDPA cannot state the call (softcap, sinks) it runs
the same shape without them (the cost of the attention itself). Targets (issue 12): ratio <= 1.3
where SDPA expresses the call, <= 2 with softcap or sinks. A last line measures the peak RSS of
fwd + bwd at S = 16384 in a fresh process against one dense fp32 S x S matrix (target < 25%).

``--threads N`` sets torch's CPU threads for both sides. On a small shared machine use 1: with
2 threads every parallel op waits at a barrier for a core another process holds (measured: a
tensor op of ~0.05 ms taking ~20 ms at load 12 on 2 cores), which inflates the side issuing more
ops, whatever their work.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import torch

import nki_lib

__all__ = ["CASES", "run", "main"]

SDPA_TARGET = 1.3
EXTRA_TARGET = 2.0
MEMORY_TARGET = 0.25


@dataclass(frozen=True)
class RefCase:
    name: str
    b: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dtype: torch.dtype
    flags: dict = field(default_factory=dict)
    key_padding: bool = False
    sinks: bool = False

    @property
    def target(self) -> float:
        return EXTRA_TARGET if self.sinks or self.flags.get("softcap", 0) else SDPA_TARGET


def _cases():
    bf16, fp32 = torch.bfloat16, torch.float32
    out = []
    for dtype in (bf16, fp32):
        tag = "bf16" if dtype == bf16 else "fp32"
        out += [
            RefCase(f"full {tag}", 1, 8, 8, 1024, 1024, 64, dtype),
            RefCase(f"causal {tag}", 1, 8, 8, 2048, 2048, 64, dtype, dict(causal=True)),
            RefCase(f"causal gqa 8:2 {tag}", 1, 8, 2, 2048, 2048, 128, dtype, dict(causal=True)),
            RefCase(f"window 256 {tag}", 1, 8, 8, 2048, 2048, 64, dtype,
                    dict(causal=True, window_left=255)),
            RefCase(f"key padding {tag}", 4, 4, 4, 512, 512, 64, dtype, dict(causal=True),
                    key_padding=True),
            RefCase(f"softcap {tag}", 1, 8, 8, 1024, 1024, 64, dtype, dict(causal=True, softcap=30.0)),
            RefCase(f"sinks+window {tag}", 1, 8, 8, 2048, 2048, 64, dtype,
                    dict(causal=True, window_left=127), sinks=True),
        ]
    return out


CASES = _cases()


def _inputs(case, requires_grad):
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(case.dtype).requires_grad_(requires_grad)  # noqa: E731
    q = mk(case.b, case.hq, case.sq, case.d)
    k, v = mk(case.b, case.hkv, case.sk, case.d), mk(case.b, case.hkv, case.sk, case.d)
    sinks = torch.randn(case.hq, generator=gen).requires_grad_(requires_grad) if case.sinks else None
    mask = None
    if case.key_padding:
        lengths = torch.tensor([case.sk - 97 * i for i in range(case.b)])
        mask = (torch.arange(case.sk)[None, :] >= case.sk - lengths[:, None]).reshape(case.b, 1, 1, case.sk)
    return q, k, v, sinks, mask


def _sdpa_mask(case, key_mask):
    """The dense boolean mask SDPA needs for windows / padding (None when is_causal does)."""
    wl = case.flags.get("window_left", -1)
    if wl < 0 and key_mask is None:
        return None
    i = torch.arange(case.sq)[:, None] + case.sk - case.sq
    j = torch.arange(case.sk)[None, :]
    keep = j <= i
    if wl >= 0:
        keep = keep & (j >= i - wl)
    keep = keep[None, None]
    return keep if key_mask is None else keep & key_mask


def _ours(case, q, k, v, sinks, mask):
    out, _ = torch.ops.nki.flash_attention(q, k, v, sinks, None, None, mask, **case.flags)
    return out


def _theirs(case, q, k, v, dense):
    causal = dense is None and case.flags.get("causal", False)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, is_causal=causal, enable_gqa=case.hq != case.hkv)


def _time(fn, backward):
    t0 = time.perf_counter()
    out = fn()
    if backward:
        out.float().sum().backward()
    return time.perf_counter() - t0


def run(case, backward, repeats=5):
    q, k, v, sinks, mask = _inputs(case, backward)
    dense = _sdpa_mask(case, mask)
    ours, theirs = [], []
    with nki_lib.use_backend("reference"):
        for _ in range(repeats + 1):   # the first pair warms up
            ours.append(_time(lambda: _ours(case, q, k, v, sinks, mask), backward))
            theirs.append(_time(lambda: _theirs(case, q, k, v, dense), backward))
    a, b = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return a, b, a / b


_MEMORY_CODE = textwrap.dedent("""
    import os, resource, threading, time, torch, nki_lib
    PAGE = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    S, D = 16384, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, S, D, generator=g).bfloat16().requires_grad_(True) for _ in range(3))
    base, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(SAMPLE_S)
    sampler = threading.Thread(target=sample)
    sampler.start()
    out, lse = torch.ops.nki.flash_attention(q, k, v, causal=True)
    out.float().sum().backward()
    done.set()
    sampler.join()
    print(max(peak[0], rss()) - base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")
SAMPLE_S = 0.0005   # RSS sampling period: touching a large buffer's pages takes far longer


def memory_ratio() -> tuple[float, float]:
    """Peak memory of fwd+bwd at S = 16384 (bf16, causal, D = 64) over one dense fp32 S x S, in
    a fresh process (Linux): the growth of the resident set past the inputs, sampled every
    :data:`SAMPLE_S` by a thread while the op runs (the op's own peak), and the whole process's
    high-water mark (imports included; on Linux a spawned child also inherits the parent's
    high-water mark at fork, which is why the growth is not taken from ``ru_maxrss``: an upper
    bound only)."""
    code = _MEMORY_CODE.replace("SAMPLE_S", repr(SAMPLE_S))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth, peak = (int(x) for x in proc.stdout.strip().splitlines()[-1].split())
    dense = 16384 * 16384 * 4
    return growth / dense, peak / dense


def _moe_rows(rows, limit) -> bool:
    """The MoE reference cases (``nki_lib.bench.reference_moe``: bf16 experts op on the reference
    path against a loop over experts; target ratio <= 1)."""
    from nki_lib.bench import reference_moe

    ok = True
    for case in reference_moe.CASES[:limit] if limit else reference_moe.CASES:
        for backward in (False, True):
            r = reference_moe.measure(case, backward=backward)
            good = r["ratio"] <= reference_moe.TARGET
            ok &= good
            rows.append((f"moe_experts {r['case']}", r["pass_"], f"{r['reference_ms']:.1f}", f"{r['loop_ms']:.1f}",
                         f"{r['ratio']:.2f}", f"<= {reference_moe.TARGET} (vs expert loop, {r['pairs']} pairs)",
                         "PASS" if good else "FAIL"))
            print("  ".join(rows[-1]), flush=True)
    return ok


def _header(threads) -> None:
    """Print the conditions of the run (the machine may be shared: its load average is printed
    at the start and the end; absolute times scale with it, ratios much less)."""
    if threads:
        torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), "
          f"{os.cpu_count()} cores, load average {_load()}", flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(args=None) -> int:
    limit = getattr(args, "limit", None)
    _header(getattr(args, "threads", None))
    cases = CASES[:limit] if limit else CASES
    rows = [("case", "pass", "ours ms", "sdpa ms", "ratio", "target", "")]
    ok = True
    for case in cases:
        for backward in (False, True):
            a, b, ratio = run(case, backward)
            good = ratio <= case.target
            ok &= good
            rows.append((case.name, "fwd+bwd" if backward else "fwd", f"{a * 1e3:.1f}",
                         f"{b * 1e3:.1f}", f"{ratio:.2f}", f"<= {case.target}", "PASS" if good else "FAIL"))
            print("  ".join(rows[-1]), flush=True)
    ok &= _moe_rows(rows, limit)
    mem, whole = memory_ratio()
    ok &= mem < MEMORY_TARGET
    print(f"memory fwd+bwd S=16384 bf16 causal: peak resident-set growth {mem:.3f} of a dense fp32 SxS "
          f"(whole process high-water mark incl. imports: {whole:.3f}) (target < {MEMORY_TARGET}) "
          f"{'PASS' if mem < MEMORY_TARGET else 'FAIL'}")
    print(f"load average at the end {_load()}")
    return 0 if ok else 1
