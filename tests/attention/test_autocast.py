"""SDPA's autocast policy: inputs cast to the region's dtype, outputs in it (eager and compiled)."""

import pytest
import torch

import nki_lib  # noqa: F401


def _call(q, k, v, sinks):
    return torch.ops.nki.flash_attention(q, k, v, sinks, causal=True)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_casts_mixed_inputs_like_sdpa(dtype):
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8).to(torch.bfloat16)          # HF under autocast: fp32 q/k, bf16 v
    sinks = torch.randn(2)
    with torch.autocast("cpu", dtype=dtype):
        eager = _call(q, k, v, sinks)
        compiled = torch.compile(_call, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert eager.dtype == want.dtype == compiled.dtype == dtype
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
