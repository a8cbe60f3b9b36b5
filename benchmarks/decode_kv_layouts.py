"""Whole-op estimates of a paged decode call over a head-major pool and over a token-major one
(``kv_layout="NHD"``), for pools of several sizes (docs/perf-log.md §30.1, §30.2).

The decode calls at an 8k cache with 64-token blocks of gpt-oss-120b (B=1, Hq=64, Hkv=8, D=64,
sinks) and llama3-8b (B=1, Hq=32, Hkv=8, D=128), with a block table of 128 columns (one chunk: the
kernel's single-chunk path) and of 512 (a 32k capacity: the multi-chunk path). The last line of
each pool prices the whole-pool copy a token-major pool cost before round 13. Run from the
repository root (package installed or ``PYTHONPATH=.``)::

    python benchmarks/decode_kv_layouts.py                 # both models, both tables, 2 pools each, ~2 min
    python benchmarks/decode_kv_layouts.py --models gpt-oss-120b --capacities 8192 --spare 0 8064
    python benchmarks/decode_kv_layouts.py --spare 0 --lengths 8192 8000   # a length off the chunk edge

``--lengths`` sets the sequence length (default 8192: every chunk interior; a length that is not a
whole number of chunks makes its last chunk an edge chunk, whose V rows past L_b are cleaned,
docs/perf-log.md §32.2).
"""

import argparse

import torch

import nki_lib
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.bench.whole_op import estimate_call, host_time_ns
from nki_lib.simulator.profile import estimate, params
from nki_lib.simulator.profile.sensitivity import corners, figure_range

SHAPES = {"gpt-oss-120b": dict(b=1, hq=64, hkv=8, sq=1, d=64, length=8192, block_size=64, sinks=True),
          "llama3-8b": dict(b=1, hq=32, hkv=8, sq=1, d=128, length=8192, block_size=64, sinks=False)}


def _worst_corner(est, target) -> str:
    """The kernel's worst in-order and dependency-bound estimates over the documented bounds of the
    low-confidence constants (``--sensitivity``)."""
    (_, run), = est.runs
    nominal = estimate(run, target)
    at = {c.label: estimate(run, c.hw) for c in corners(target)}
    _, in_order, _, in_order_at = figure_range(nominal.time_us, {k: e.time_us for k, e in at.items()})
    _, dep, _, dep_at = figure_range(nominal.dependency_bound_us, {k: e.dependency_bound_us for k, e in at.items()})
    return f"worst corner {in_order:6.1f} ({in_order_at}) / {dep:6.1f} ({dep_at}) us"


def _line(name, call, target) -> str:
    est = estimate_call(call, target)
    host = est.host
    return (f"{name:<18} kernel {est.kernel_us:6.1f} / {est.kernel_dependency_bound_us:6.1f} us, "
            f"{_worst_corner(est, target)}; host {host['time_us']:6.1f} us ({host['launches']} launches, "
            f"{host['hbm_bytes'] / 2**20:5.2f} MiB); whole op {est.total_us:6.1f} / "
            f"{est.total_dependency_bound_us:6.1f} us")


def rows(model: str, capacity: int, spare: int, target: str = "trn2", length: int | None = None):
    """Report lines for ``model``'s call with a block table of ``capacity`` keys (the table's width
    times the block size) over a pool of its blocks plus ``spare`` unused ones, at the model's length
    or ``length``."""
    s = dict(SHAPES[model], **({} if length is None else {"length": length}))
    needed = -(-s["length"] // s["block_size"]) * s["b"]
    sample = make_sample(s["b"], s["hq"], s["hkv"], s["sq"], s["d"], [s["length"]] * s["b"], torch.bfloat16,
                         block_size=s["block_size"], num_blocks=needed + spare, capacity_=capacity, sinks=s["sinks"])
    q, k_cache, v_cache, lengths, table, sinks, _ = sample.args
    k_tm, v_tm = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    calls = {"head-major (HND)": (k_cache, v_cache, "HND"), "token-major (NHD)": (k_tm, v_tm, "NHD")}
    out = [f"{model}, L={s['length']}, table of {capacity // s['block_size']} columns: pool of "
           f"{needed + spare} blocks ({needed} named by the table):"]
    for name, (k, v, layout) in calls.items():
        call = (lambda k=k, v=v, layout=layout: nki_lib.decode_attention(
            q, k, v, lengths, block_table=table, sinks=sinks, kv_layout=layout))
        out.append("  " + _line(name, call, target))
    pool_bytes = 2 * 2 * k_cache.numel() * k_cache.element_size()     # K and V, read and written
    out.append(f"  a whole-pool copy of K and V: {host_time_ns(2, pool_bytes, params(target)) * 1e-3:.1f} us "
               f"({pool_bytes / 2**20:.1f} MiB)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--capacities", type=int, nargs="+", default=[8192, 32768],
                        help="block table capacities in keys (8192: one chunk, the single-chunk path)")
    parser.add_argument("--spare", type=int, nargs="+", default=[0, 1920], help="unused blocks in the pool")
    parser.add_argument("--lengths", type=int, nargs="+", default=[None],
                        help="sequence lengths (default: each model's, 8192)")
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args(argv)
    for model in args.models:
        for capacity in args.capacities:
            for spare in args.spare:
                for length in args.lengths:
                    for line in rows(model, capacity, spare, args.target, length):
                        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
