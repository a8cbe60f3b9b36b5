"""Whole-op estimates of a paged decode call over a head-major pool and over a token-major one
(``kv_layout="NHD"``), for pools of several sizes (docs/perf-log.md §30.1).

gpt-oss-120b's decode at an 8k cache (B=1, Hq=64, Hkv=8, D=64, sinks, 64-token blocks) by default.
The last line prices the whole-pool copy a token-major pool cost before the launcher gathered only
the table's blocks. Run from the repository root (package installed or ``PYTHONPATH=.``)::

    python benchmarks/decode_kv_layouts.py                 # pools of 128 and 2048 blocks, ~10 s
    python benchmarks/decode_kv_layouts.py --spare 0 8064
"""

import argparse

import torch

import nki_lib
from nki_lib.attention.decode_attention_op import make_sample
from nki_lib.bench.whole_op import estimate_call, host_time_ns
from nki_lib.simulator.profile import params

SHAPE = dict(b=1, hq=64, hkv=8, sq=1, d=64, length=8192, block_size=64)   # gpt-oss-120b, 8k cache


def _line(name, est) -> str:
    host = est.host
    return (f"{name:<28} kernel {est.kernel_us:7.1f} / {est.kernel_dependency_bound_us:7.1f} us   host "
            f"{host['time_us']:7.1f} us ({host['launches']} launches, {host['hbm_bytes'] / 2**20:6.2f} MiB)   "
            f"whole op {est.total_us:7.1f} / {est.total_dependency_bound_us:7.1f} us")


def rows(spare: int, target: str = "trn2"):
    """Report lines for a pool of the call's blocks plus ``spare`` unused ones."""
    s = SHAPE
    needed = -(-s["length"] // s["block_size"]) * s["b"]
    sample = make_sample(s["b"], s["hq"], s["hkv"], s["sq"], s["d"], [s["length"]] * s["b"], torch.bfloat16,
                         block_size=s["block_size"], num_blocks=needed + spare, sinks=True)
    q, k_cache, v_cache, lengths, table, sinks, _ = sample.args
    k_tm, v_tm = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    calls = {"head-major (HND)": (k_cache, v_cache, "HND"), "token-major (NHD)": (k_tm, v_tm, "NHD")}
    out = [f"pool of {needed + spare} blocks ({needed} named by the table):"]
    for name, (k, v, layout) in calls.items():
        est = estimate_call(lambda k=k, v=v, layout=layout: nki_lib.decode_attention(
            q, k, v, lengths, block_table=table, sinks=sinks, kv_layout=layout), target)
        out.append("  " + _line(name, est))
    pool_bytes = 2 * 2 * k_cache.numel() * k_cache.element_size()     # K and V, read and written
    out.append(f"  a whole-pool copy of K and V: {host_time_ns(2, pool_bytes, params(target)) * 1e-3:.1f} us "
               f"({pool_bytes / 2**20:.1f} MiB)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spare", type=int, nargs="+", default=[0, 1920], help="unused blocks in the pool")
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args(argv)
    for spare in args.spare:
        for line in rows(spare, args.target):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
