"""The reference sweep's plumbing (its figures come from `nki-lib bench --sweep reference`)."""

import torch

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
