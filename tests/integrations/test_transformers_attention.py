"""attn_implementation="nki" on tiny Hugging Face models built from configs (random weights, no
downloads): Llama (GQA), Qwen3 (sliding window), Gemma 2 (softcap + sliding window), gpt-oss
(sinks + sliding window). Logits and gradients are judged by the parity rule of
``nki_lib.numerics`` (the model's own sdpa/eager in float64 is the oracle, the same in the test
dtype the baseline); greedy generate() must give sdpa's tokens; compile and export with padding.
"""

from __future__ import annotations

import pytest
import torch

import nki_lib
from nki_lib.numerics import assert_parity

transformers = pytest.importorskip("transformers")
from nki_lib.integrations import transformers as nki_hf  # noqa: E402

nki_hf.register()

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                   layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=5, attn_logit_softcapping=20.0, final_logit_softcapping=None,
                    query_pre_attn_scalar=8), "eager"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"]), "eager"),
}
SEQ = 12


def _model(name, impl, dtype=torch.float32, seed=0, experts="eager"):
    config_cls, model_cls, extra, _ = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    config._attn_implementation = impl
    config._experts_implementation = experts   # eager: a loop over experts (float64 works too)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():   # sinks start at zero in HF: make them matter
        for mod in model.modules():
            if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
                mod.sinks.normal_()
    return model.to(dtype)


def _pair(name, dtype):
    """The nki model, and the model's own implementation with the same weights."""
    ours = _model(name, nki_hf.NAME, dtype)
    theirs = _model(name, MODELS[name][3], dtype)
    return ours, theirs


def _batch(padding):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (3, SEQ), generator=gen)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    if padding == "left":
        mask[1, :4] = 0
        mask[2, :7] = 0
    elif padding == "right":
        mask[1, 8:] = 0
        mask[2, 3:] = 0
    return ids, mask


def _logits(model, ids, mask):
    return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_and_grads_match_the_models_own_attention(name, dtype, padding):
    _assert_logits_and_grads(name, dtype, padding, "reference")


def _assert_logits_and_grads(name, dtype, padding, path):
    """Logits of the valid positions and dW_q of layer 0: the nki model on ``path`` (strict on
    the simulator) against the model's own attention (baseline) and its float64 (oracle)."""
    ids, mask = _batch(padding)
    ours, theirs = _pair(name, dtype)
    oracle = _model(name, MODELS[name][3], torch.float64)
    valid = mask.bool()
    outs = {}
    for key, model in (("ours", ours), ("baseline", theirs), ("oracle", oracle)):
        ours_path = path if key == "ours" else "reference"
        with nki_lib.use_backend(ours_path), nki_lib.strict(ours_path == "simulator"):
            logits = _logits(model, ids, mask)
            weights = torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)
            (logits[valid] * weights).sum().backward()
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        outs[key] = (logits[valid].detach(), q_proj.grad.detach())
    assert_parity(outs["ours"][0], outs["oracle"][0], outs["baseline"][0], kind="output",
                  dtype=dtype, name=f"{name} logits ({path})")
    assert_parity(outs["ours"][1], outs["oracle"][1], outs["baseline"][1], kind="grad",
                  dtype=dtype, name=f"{name} dW_q ({path})")


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generate_equals_sdpa_with_left_padding(name):
    ids, mask = _batch("left")
    ours, theirs = _pair(name, torch.float32)
    nki_lib.reset_coverage()
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    calls = nki_lib.coverage()["flash_attention"]
    assert calls["reference"].calls == COMMON["num_hidden_layers"] * 6   # prefill + 5 decode steps


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_packed_sequences_via_cu_seq_lens(name):
    """HF's flattened batch (DataCollatorWithFlattening kwargs) equals the documents run alone."""
    ours, _ = _pair(name, torch.float32)
    lengths = [5, 4, 3]
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, COMMON["vocab_size"], (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(torch.cat(docs, dim=1), position_ids=position_ids, cu_seq_lens_q=cu,
                      cu_seq_lens_k=cu, max_length_q=5, max_length_k=5).logits
        alone = torch.cat([ours(d).logits for d in docs], dim=1)
    assert_parity(packed, alone.double(), alone, kind="output", dtype=torch.float32,
                  name="packed vs alone")


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt_oss"])
def test_compile_fullgraph_and_export_with_padding(name):
    ids, mask = _batch("left")
    ours = _model(name, nki_hf.NAME, experts="batched_mm")   # (HF's eager experts loop is data-dependent)
    kw = dict(attention_mask=mask, use_cache=False)
    with torch.no_grad():
        eager = ours(ids, **kw).logits
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        got = compiled(ids, **kw).logits
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
        exported = torch.export.export(ours, (ids,), kw)
        again = exported.module()(ids, **kw).logits
    torch.testing.assert_close(again, eager, rtol=0, atol=0)


def _simulator_calls():
    """{op: (calls, fallback reasons)} of the simulator path in the coverage ledger."""
    stats = nki_lib.coverage()
    return {op: (stats[op]["simulator"].calls, dict(stats[op]["simulator"].fallbacks))
            for op in ("flash_attention", "flash_attention_backward") if op in stats}


def test_packed_position_ids_dense_mask_runs_on_the_kernel():
    """Packed position_ids without cu_seq_lens: transformers' dense (block-diagonal causal) mask
    goes to the op as attn_mask; each row's keys are one interval, so the kernel serves it."""
    ours, theirs = _pair("llama", torch.float32)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    nki_lib.reset_coverage()
    kw = dict(position_ids=position_ids, use_cache=False)   # (with a cache HF does not pack)
    with torch.no_grad(), nki_lib.use_backend("simulator"), nki_lib.strict():
        got = ours(ids, **kw).logits
    with torch.no_grad():
        want = theirs(ids, **kw).logits
        exact = _model("llama", "sdpa", torch.float64)(ids, **kw).logits
    assert_parity(got, exact, want, kind="output", dtype=torch.float32, name="dense mask")
    assert _simulator_calls()["flash_attention"] == (COMMON["num_hidden_layers"], {})


def test_padding_with_holes_is_a_recorded_fallback():
    """A 2-D attention_mask with a hole inside a row is no key interval: the op serves it on the
    reference and the simulator path records why its kernels could not."""
    ids, mask = _batch("none")
    mask[1, 4:6] = 0
    ours, theirs = _pair("llama", torch.float32)
    nki_lib.reset_coverage()
    with torch.no_grad(), nki_lib.use_backend("simulator"):
        got = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask).logits
        exact = _model("llama", "sdpa", torch.float64)(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert_parity(got[valid], exact[valid], want[valid], kind="output", dtype=torch.float32,
                  name="holes")
    fallbacks = nki_lib.coverage()["flash_attention"]["simulator"].fallbacks
    assert any("holes" in reason for reason in fallbacks), fallbacks


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_simulator_path_runs_padded_batches_on_the_kernels(name, padding):
    """Left/right-padded batches (B = 3) on the simulator path, strict: logits and dW_q within the
    parity rule, and every attention call (forward and backward) served by the kernels."""
    nki_lib.reset_coverage()
    _assert_logits_and_grads(name, torch.bfloat16, padding, "simulator")
    layers = COMMON["num_hidden_layers"]
    assert _simulator_calls() == {"flash_attention": (layers, {}), "flash_attention_backward": (layers, {})}


def test_static_cache_generate_with_left_padding_runs_on_the_kernels():
    """A static cache gives transformers' dense mask (unused cache slots masked): with left padding
    every row's keys are still one interval, so prefill and decode steps run on the kernels and
    the greedy tokens equal sdpa's."""
    ids, mask = _batch("left")
    ours, theirs = _pair("llama", torch.float32)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    nki_lib.reset_coverage()
    with torch.no_grad():
        want = theirs.generate(ids, **kw)
        with nki_lib.use_backend("simulator"), nki_lib.strict():
            got = ours.generate(ids, **kw)
    assert torch.equal(got, want)
    assert _simulator_calls()["flash_attention"] == (COMMON["num_hidden_layers"] * 4, {})
