"""Streaming softmax cross-entropy (kernels_xent.py).

Behaviours pinned here: a runtime ``.ap(scalar_offset=..., indirect_dim=1)`` read of an HBM
argument (one (1, 1) gather per row); ``nki.dtype`` as a kernel parameter annotation and an NKI
dtype as a compile-time argument; ``name=`` on instructions; a ``-inf`` memset feeding ``exp``;
LNC2 with an uneven row split; ``nki.jit(platform_target=...)`` refused. Oracle fp64; baseline
PyTorch fp32.
"""

import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("vocab, chunk", [(300, 128), (96, 512)], ids=["three-chunks", "one-chunk"])
def test_softmax_cross_entropy(kernel_module, rng, trn2, grid, vocab, chunk):
    k = kernel_module("xent")
    n_rows = 7
    logits = (4 * rng.standard_normal((n_rows, vocab))).astype(np.float32)
    labels = rng.integers(0, vocab, size=n_rows).astype(np.int32)
    kernel = k.softmax_cross_entropy if grid == 1 else k.softmax_cross_entropy[grid]
    loss, lse = sim.simulate(kernel)(logits, labels, chunk, sim.language.float32)

    x64 = torch.from_numpy(logits.astype(np.float64))
    x32 = torch.from_numpy(logits)
    rows = torch.arange(n_rows)
    target = torch.from_numpy(labels).long()
    lse_oracle, lse_base = torch.logsumexp(x64, dim=1), torch.logsumexp(x32, dim=1)
    assert_parity(torch.from_numpy(lse[:, 0]), lse_oracle, lse_base, kind="output", dtype=torch.float32,
                  name="lse")
    assert_parity(torch.from_numpy(loss[:, 0]), lse_oracle - x64[rows, target], lse_base - x32[rows, target],
                  kind="output", dtype=torch.float32, name="loss")

    report = sim.last_run()
    gathers = [e for e in report.trace if e.opcode == "dma_copy" and e.reads[0].shape == (1, 1)
               and e.reads[0].memory != "sbuf"]
    assert report.grid == grid and len(gathers) == n_rows
    assert sorted(sum(e.program_id == p for e in gathers) for p in range(grid)) == ([7] if grid == 1 else [3, 4])


def test_jit_refuses_platform_target(nki_modules):
    nki, _, _ = nki_modules
    with pytest.raises(TypeError, match="platform_target"):
        nki.jit(platform_target="trn2")
