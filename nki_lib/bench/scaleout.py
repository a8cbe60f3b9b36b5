"""``nki-lib scaleout``: bytes on the wire and estimated collective time of expert-parallel MoE and
ring attention on a Trn2 node, beside the kernel time, so a user sees which one bounds a layer.

Per rank and layer (training: forward and backward), from the layouts of
``nki_lib.moe.expert_parallel`` and ``nki_lib.attention.ring_attention`` (the formulas are
checked against the bytes the implementations actually send, ``collectives.count_traffic``):

* ring attention over P ranks, L = S / P tokens each: forward P - 1 K/V blocks of
  ``2 B Hkv L D`` elements; backward P - 1 K/V blocks plus P float32 dK/dV blocks. One block
  per ring step, on one NeuronLink (a ring on the 4x4 torus uses one link per direction):
  ``step comm = block bytes / (neuronlink_bw_chip / neuronlink_links)``. The transfer overlaps
  the step's kernels, so a step costs ``max(kernel, comm)``.
* expert parallelism over P ranks, T tokens each, C slots per rank pair: each all-to-all sends
  ``(P - 1) C`` rows to other ranks. Forward: tokens (H elements), weights (float32) and expert
  ids (int64) out, expert outputs (H) back; backward: the gradients of the outputs and of the
  tokens (H each) and of the weights (float32). Time: bytes over the chip's whole NeuronLink
  bandwidth (``neuronlink_bw_chip``): a lower bound (it ignores multi-hop routes and contention),
  not overlapped with the experts (they wait for their tokens).

Kernel time: the cost model's estimate (``nki_lib.bench.harness.run_case``, trn2, the kernels on
the simulator) of the kernels one rank runs: ``flash_attention`` (+ backward) on one full L x L
block, scaled per step by the step's visible fraction of that block (from
``ring_attention_plan``; exact for the work, an approximation of the time), and ``moe_experts``
(+ backward) on the ``P C`` received rows with E / P local experts. That is the time of the
kernels on one NeuronCore (the bench's unit); a rank is a chip, so ``chip_kernel_us`` divides it
by ``cores_per_chip`` (the rank's work split evenly over its cores: heads for attention, experts
for MoE; an optimistic bound for the kernel side), and ``bound`` compares the collective with
that.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from nki_lib.attention.ring_attention_plan import plan_block, segments
from nki_lib.moe.expert_parallel import DEFAULT_CAPACITY_FACTOR, capacity_slots

__all__ = [
    "SCALEOUT_CASES",
    "Traffic",
    "expert_parallel_traffic",
    "main",
    "ring_attention_traffic",
    "run",
    "visible_fractions",
]

WEIGHT_BYTES, ID_BYTES, GRAD_ACC_BYTES = 4, 8, 4   # float32 weights, int64 ids, float32 dK/dV


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends to other ranks per layer."""

    forward: int
    backward: int
    steps: int          # collective steps per forward
    step_bytes: int     # bytes of the largest forward step


def ring_attention_traffic(*, batch: int, kv_heads: int, local_len: int, head_dim: int, world: int,
                           dtype_bytes: int) -> Traffic:
    block = 2 * batch * kv_heads * local_len * head_dim
    if world == 1:
        return Traffic(0, 0, 0, 0)
    forward = (world - 1) * block * dtype_bytes
    return Traffic(forward, forward + world * block * GRAD_ACC_BYTES, world - 1, block * dtype_bytes)


def expert_parallel_traffic(*, tokens: int, hidden: int, top_k: int, world: int, dtype_bytes: int,
                            capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR) -> Traffic:
    rows = (world - 1) * capacity_slots(tokens * top_k, world, capacity_factor)
    dispatch = rows * (hidden * dtype_bytes + WEIGHT_BYTES + ID_BYTES)
    combine = rows * hidden * dtype_bytes
    backward = rows * (2 * hidden * dtype_bytes + WEIGHT_BYTES)
    return Traffic(dispatch + combine, backward, 2, dispatch)


def visible_fractions(*, world: int, local_len: int, causal: bool, window=(-1, -1),
                      split: str = "contiguous", rank: int = 0) -> list[float]:
    """Per ring step, the share of the L x L block pair that ``rank`` computes."""
    out = []
    own = segments(split, world, rank, local_len)
    for step in range(world):
        src = (rank - step) % world
        area = 0
        for q_seg in own:
            for k_seg in segments(split, world, src, local_len):
                block = plan_block(q_seg, k_seg, causal=causal, window=window)
                if block is not None:
                    area += _visible_pairs(block)
        out.append(area / (local_len * local_len))
    return out


def _visible_pairs(block) -> int:
    from nki_lib.attention import masks

    sq, sk = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
    return int(masks.full_mask(sq, sk, causal=False, window_left=block.window_left,
                               window_right=block.window_right, cu_seqlens=None, device="cpu").sum())


# --------------------------------------------------------------------------- cases and figures

@dataclass(frozen=True)
class ScaleoutCase:
    kind: str            # "ring_attention" | "expert_parallel"
    model: str
    world: int
    dims: dict           # ring: S (global), B, causal, split; ep: T (per rank), capacity_factor
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.model} {self.kind} P={self.world} {dims}"


SCALEOUT_CASES = (
    ScaleoutCase("ring_attention", "llama3-8b", 16, {"S": 16384, "B": 1, "causal": True, "split": "zigzag"}),
    ScaleoutCase("ring_attention", "llama3-8b", 4, {"S": 4096, "B": 1, "causal": True, "split": "zigzag"}),
    ScaleoutCase("ring_attention", "llama3-8b", 16, {"S": 16384, "B": 1, "causal": False, "split": "contiguous"}),
    ScaleoutCase("ring_attention", "llama3-8b", 16, {"S": 4096, "B": 1, "causal": True, "split": "zigzag"}),
    ScaleoutCase("expert_parallel", "qwen3-30b-a3b", 16, {"T": 1024, "capacity_factor": 1.25}),
    ScaleoutCase("expert_parallel", "qwen3-30b-a3b", 4, {"T": 1024, "capacity_factor": 1.25}),
    ScaleoutCase("expert_parallel", "deepseek-v3", 16, {"T": 256, "capacity_factor": 1.25}),
)


_KERNEL_CACHE: dict[str, dict] = {}


def _kernel_us(case) -> dict:
    """Forward and backward kernel time (us, trn2) of the kernel case (once per case label)."""
    if case.label not in _KERNEL_CACHE:
        _KERNEL_CACHE[case.label] = _estimate_kernels(case)
    return _KERNEL_CACHE[case.label]


def _estimate_kernels(case) -> dict:
    """Forward and backward kernel time (us, trn2) of the kernel case; raises if not estimated."""
    from nki_lib.bench.harness import run_case

    res = run_case(case, ("trn2",), steady=False, cpu_paths=False)
    if res.status != "ok":
        raise RuntimeError(f"{case.label}: {res.status}")
    parts = res.estimates["trn2"].get("parts", {})
    fwd, bwd = (parts[name]["time_us"] for name in sorted(parts, key=len))
    return {"forward": fwd, "backward": bwd, "sim_dims": res.sim_dims, "extrapolation": res.extrapolation}


def _dtype_bytes(name: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, name)).element_size()


def ring_figures(case: ScaleoutCase, hw) -> dict:
    from nki_lib.bench.shapes import MODELS, Case

    m, d, p = MODELS[case.model], case.dims, case.world
    local = d["S"] // p
    traffic = ring_attention_traffic(batch=d["B"], kv_heads=m.kv_heads, local_len=local, head_dim=m.head_dim,
                                     world=p, dtype_bytes=_dtype_bytes(case.dtype))
    fractions = visible_fractions(world=p, local_len=local, causal=d["causal"], split=d["split"])
    block = Case("flash_attention", "train", case.model,
                 {"B": d["B"], "Hq": m.heads, "Hkv": m.kv_heads, "Sq": local, "Sk": local, "D": m.head_dim,
                  "causal": False}, case.dtype)
    kernel = _kernel_us(block)
    link_bw = hw.neuronlink_bw_chip / hw.neuronlink_links          # B/ns
    out = {"traffic": asdict(traffic), "visible_fractions": fractions, "block_kernel_us": kernel}
    for part in ("forward", "backward"):
        comm = getattr(traffic, part) / link_bw * 1e-3
        per_step = comm / p                     # spread over the P compute steps it overlaps
        kernels = [f * kernel[part] for f in fractions]
        chip = [k / hw.cores_per_chip for k in kernels]
        out[part] = {"kernel_us": sum(kernels), "chip_kernel_us": sum(chip), "comm_us": comm,
                     "comm_us_per_step": per_step, "overlapped_chip_us": sum(max(k, per_step) for k in chip),
                     "bound": "collective" if comm > sum(chip) else "kernel"}
    return out


def ep_figures(case: ScaleoutCase, hw) -> dict:
    from nki_lib.bench.shapes import MODELS, Case

    m, d, p = MODELS[case.model], case.dims, case.world
    cap = capacity_slots(d["T"] * m.top_k, p, d["capacity_factor"])
    traffic = expert_parallel_traffic(tokens=d["T"], hidden=m.hidden, top_k=m.top_k, world=p,
                                      dtype_bytes=_dtype_bytes(case.dtype), capacity_factor=d["capacity_factor"])
    experts = Case("moe_experts", "train", case.model,
                   {"T": p * cap, "H": m.hidden, "I": m.intermediate, "E": m.experts // p, "k": 1,
                    "block_size": 128}, case.dtype)
    kernel = _kernel_us(experts)
    out = {"traffic": asdict(traffic), "capacity": cap, "rows": p * cap, "experts_kernel_us": kernel}
    for part, nbytes in (("forward", traffic.forward), ("backward", traffic.backward)):
        comm = nbytes / hw.neuronlink_bw_chip * 1e-3
        chip = kernel[part] / hw.cores_per_chip
        out[part] = {"kernel_us": kernel[part], "chip_kernel_us": chip, "comm_us": comm,
                     "serial_chip_us": chip + comm, "bound": "collective" if comm > chip else "kernel"}
    return out


def run(cases=SCALEOUT_CASES) -> list[dict]:
    from nki_lib.simulator.profile import params

    hw = params("trn2")
    rows = []
    for case in cases:
        fn = ring_figures if case.kind == "ring_attention" else ep_figures
        try:
            rows.append({"label": case.label, "case": asdict(case), **fn(case, hw)})
        except Exception as exc:  # noqa: BLE001  (a failing case is a row, not the end of the run)
            rows.append({"label": case.label, "case": asdict(case), "error": f"{type(exc).__name__}: {exc}"})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'case':58s} {'part':8s} {'MB/rank':>9s} {'core us':>10s} {'chip us':>9s} {'comm us':>9s} "
            f"{'bound':>10s}")
    lines = [head, "-" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['label']:58s} error: {row['error']}")
            continue
        for part in ("forward", "backward"):
            fig = row[part]
            lines.append(f"{row['label']:58s} {part:8s} {row['traffic'][part] / 1e6:9.2f} "
                         f"{fig['kernel_us']:10.1f} {fig['chip_kernel_us']:9.1f} {fig['comm_us']:9.1f} "
                         f"{fig['bound']:>10s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nki-lib scaleout", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for scaleout.jsonl and scaleout.txt")
    p.add_argument("--limit", type=int, default=None, help="only the first N cases")
    args = p.parse_args(argv)
    rows = run(SCALEOUT_CASES[: args.limit])
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scaleout.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        with open(os.path.join(args.out, "scaleout.txt"), "w") as f:
            f.write(text + "\n")
    return 1 if any("error" in r for r in rows) else 0
