"""Hugging Face continuous batching (``generate_batch``) served by nki's attention
(``nki_hf.serve_continuous_batching``) on tiny models built from configs: the greedy tokens equal
the model's own implementation's, every attention call runs on the kernels, and the block mask
continuous batching passes with ``cu_seq_lens_*`` (``is_causal=False``) maps onto the documents'
flags only when it is exactly theirs (``_documents_form``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import nki_lib
from nki_lib.numerics import assert_parity, parity

transformers = pytest.importorskip("transformers")
from nki_lib.integrations import transformers as nki_hf  # noqa: E402
from tests.integrations.test_transformers_attention import COMMON, MODELS, _model  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
NEW_TOKENS = 4


def _generate(model):
    config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
    with torch.no_grad():
        out = model.generate_batch(inputs=PROMPTS, generation_config=config)
    return {request: result.generated_tokens for request, result in out.items()}


@contextlib.contextmanager
def _served():
    """nki's attention behind continuous batching's implementations, on the simulator path (the
    manager's thread does not see ``use_backend``: the process-wide backend), both put back after."""
    backend = nki_lib.get_backend()
    restore = nki_hf.serve_continuous_batching()
    nki_lib.set_backend("simulator")
    try:
        yield
    finally:
        nki_lib.set_backend(backend)
        restore()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_generate_batch_equals_the_models_own_attention(name):
    """Three requests of different lengths (prefill packed, then decode steps of one query each):
    the same greedy tokens as transformers' own sdpa / paged|eager, and every attention call on the
    kernels (sliding windows, softcap and sinks included) with no fallback."""
    impl = MODELS[name][3]
    want = _generate(_model(name, impl))
    nki_lib.reset_coverage()
    with _served():
        got = _generate(_model(name, impl))
    assert got == want
    stats = nki_lib.coverage()["flash_attention"]["simulator"]
    assert stats.calls == COMMON["num_hidden_layers"] * NEW_TOKENS and not stats.fallbacks
    assert nki_hf.attention_forward not in [transformers.AttentionInterface._global_mapping.get(n)
                                            for n in nki_hf.CONTINUOUS_BATCHING_NAMES]   # put back


def _documents_mask(cu_q, cu_k, causal=True, window_left=-1):
    """The (1, 1, Sq, Sk) bool mask of packed documents, bottom-right aligned (the reference rule)."""
    seen = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        diag = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        key = torch.arange(k1 - k0)[None, :]
        block = key <= diag if causal else torch.ones_like(key <= diag)
        if window_left >= 0:
            block &= key >= diag - window_left
        seen[q0:q1, k0:k1] = block
    return seen[None, None]


def _additive(mask):
    """Continuous batching's form: 0 where allowed, ``finfo.min`` elsewhere (float32)."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


CU_Q, CU_K = [0, 3, 4, 9], [0, 5, 9, 14]     # a prefill after a cached prefix, a decode step, a prefill


@pytest.mark.parametrize("causal, window_left", [(True, -1), (True, 1), (False, -1)])
def test_documents_form_reads_the_block_mask(causal, window_left):
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (CU_Q, CU_K))
    mask = _documents_mask(CU_Q, CU_K, causal, window_left)
    for form in (mask, _additive(mask)):
        assert nki_hf._documents_form(form, cu_q, cu_k, window_left) is causal
    flipped = mask.clone()
    flipped[0, 0, 5, 2] ^= True                  # one key of another document
    assert nki_hf._documents_form(flipped, cu_q, cu_k, window_left) is None
    assert nki_hf._documents_form(mask, cu_q, cu_k, window_left + 2) is None   # another window
    padded = torch.nn.functional.pad(mask, (0, 0, 0, 1))      # a padding query row past the documents
    assert nki_hf._documents_form(padded, cu_q, cu_k, window_left) is None
    other = _additive(mask).masked_fill(~mask & (torch.rand(mask.shape) < 0.5), -1.0)
    assert nki_hf._documents_form(other, cu_q, cu_k, window_left) is None


@pytest.mark.parametrize("window_left", [-1, 1])
def test_a_block_mask_with_is_causal_false_runs_the_documents(window_left):
    """The inputs of a continuous-batching call (packed q/k/v, cu_seq_lens, the additive block mask,
    ``is_causal=False``) give transformers' sdpa's result within the parity rule, on the kernels;
    taking ``is_causal=False`` at its word with the cu_seq_lens (no causal mask within a document)
    would not (the fault this guards against)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((4, CU_Q[-1]), (2, CU_K[-1]), (2, CU_K[-1])))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    mask = _additive(_documents_mask(CU_Q, CU_K, True, window_left))
    kw = dict(cu_seq_lens_q=torch.tensor(CU_Q, dtype=torch.int32), cu_seq_lens_k=torch.tensor(CU_K, dtype=torch.int32),
              max_length_q=5, max_length_k=5, is_causal=False)
    sliding = None if window_left < 0 else window_left + 1
    nki_lib.reset_coverage()
    with nki_lib.use_backend("simulator"), nki_lib.strict():
        got, _ = nki_hf.attention_forward(module, q, k, v, mask, scaling=0.25, sliding_window=sliding, **kw)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25, **kw)
    exact, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), mask.double(), scaling=0.25, **kw)
    assert_parity(got, exact, want, kind="output", dtype=torch.float32, name="continuous batching call")
    assert nki_lib.coverage()["flash_attention"]["simulator"].calls == 1
    non_causal, _ = sdpa_attention_forward(module, q, k, v, _additive(_documents_mask(CU_Q, CU_K, False)),
                                           scaling=0.25, **kw)
    assert not parity(non_causal, exact, want, kind="output", dtype=torch.float32).ok
