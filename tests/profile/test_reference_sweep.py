"""The reference sweep's plumbing (its figures come from `nki-lib bench --sweep reference`)."""

import torch

import nki_lib
from nki_lib.bench import reference_sweep


def test_sweep_cases_compute_the_same_attention_as_sdpa():
    """Each timed pair computes the same thing (so the ratio compares like with like)."""
    for case in reference_sweep.CASES:
        if case.sinks or case.flags.get("softcap"):
            continue
        small = reference_sweep.RefCase(case.name, case.b, case.hq, case.hkv, 300, 300, 16,
                                        torch.float32, case.flags, case.key_padding)
        q, k, v, sinks, mask = reference_sweep._inputs(small, False)
        ours = reference_sweep._ours(small, q, k, v, sinks, mask)
        theirs = reference_sweep._theirs(small, q, k, v, reference_sweep._sdpa_mask(small, mask))
        torch.testing.assert_close(ours, theirs)


def test_moe_cases_compute_the_same_experts_as_the_loop():
    """The MoE pair computes the same y (parity rule: the loop in float64 as oracle, in float32 as
    baseline), so its ratio compares like with like."""
    from nki_lib.bench import reference_moe
    from nki_lib.numerics import parity

    def pair(dtype):
        case = reference_moe.Case(24, 32, 16, 4, 2, dtype)
        (x, w, block_expert, slots, w_gate_up, w_down), ids = reference_moe._inputs(case, False)
        with nki_lib.use_backend("reference"):
            ours = torch.ops.nki.moe_experts(x, w, block_expert, slots, w_gate_up, w_down)
        return ours, reference_moe.expert_loop(x, w, ids, w_gate_up, w_down)

    ours, base = pair(torch.float32)
    _, oracle = pair(torch.float64)
    check = parity(ours, oracle, base, kind="output", dtype=torch.float32, name="y")
    assert check.ok, str(check)
