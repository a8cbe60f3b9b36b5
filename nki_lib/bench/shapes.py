"""Model-shape registry and the benchmark sweeps built from it (never hard-coded sizes).

Numbers are the published configurations (Hugging Face ``config.json`` of each model; checked
against public copies of those configs). DeepSeek-V3 uses MLA: q/k head dim 192 (128 + 64 RoPE)
and v head dim 128; ``flash_attention`` takes one D for q, k and v, so its prefill cases use
D = 192 with v padded (labelled), and it has no decode case (the absorbed MLA decode has
D = 576 > 256, outside the op's contract).

A :class:`Case` is one benchmark call: an op, a mode (``prefill`` forward, ``train`` forward +
backward, ``decode``) and its dimensions; optionally the logical NeuronCore degree it launches with
(``lnc``; None: the environment's) and whether the harness may extrapolate it from a part
(``extrapolate``; the ``targets`` and ``aws`` sweeps simulate their attention and decode cases in
full, see nki_lib/bench/harness.py). The tuning targets are in :mod:`nki_lib.bench.targets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["ModelConfig", "MODELS", "Case", "sweep", "SWEEPS"]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int            # dense MLP (or, for MoE models, each expert's) intermediate size
    experts: int = 0             # routed experts (0: dense model)
    top_k: int = 0
    score_func: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    window: int = -1             # sliding window of the windowed layers (-1: none)
    sinks: bool = False
    v_head_dim: int | None = None
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


MODELS: dict[str, ModelConfig] = {m.name: m for m in (
    ModelConfig("llama3-8b", hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                source="meta-llama/Meta-Llama-3-8B config.json"),
    ModelConfig("llama3-70b", hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                source="meta-llama/Meta-Llama-3-70B config.json"),
    ModelConfig("mixtral-8x7b", hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                experts=8, top_k=2, source="mistralai/Mixtral-8x7B-v0.1 config.json"),
    ModelConfig("qwen3-30b-a3b", hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=768,
                experts=128, top_k=8, source="Qwen/Qwen3-30B-A3B config.json (moe_intermediate_size 768)"),
    ModelConfig("deepseek-v3", hidden=7168, heads=128, kv_heads=128, head_dim=192, intermediate=2048,
                experts=256, top_k=8, score_func="sigmoid", num_groups=8, topk_groups=4, v_head_dim=128,
                source="deepseek-ai/DeepSeek-V3 config.json (MLA qk 128+64, v 128; moe_intermediate_size 2048)"),
    ModelConfig("gpt-oss-120b", hidden=2880, heads=64, kv_heads=8, head_dim=64, intermediate=2880,
                experts=128, top_k=4, window=128, sinks=True,
                source="openai/gpt-oss-120b config.json (alternating full / 128-window layers, sinks)"),
)}


@dataclass(frozen=True)
class Case:
    """One benchmark call. ``dims`` are the real model dimensions of the call."""

    op: str                      # registry op name
    mode: str                    # "prefill" | "train" | "decode"
    model: str
    dims: dict = field(default_factory=dict, hash=False, compare=False)
    dtype: str = "bfloat16"
    lnc: int | None = None       # logical NeuronCore degree of the launches (None: the environment's)
    extrapolate: bool = True     # False: always simulate the real shape (see harness.plan)

    @property
    def label(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items() if k not in ("causal",))
        lnc = "" if self.lnc is None else f" LNC{self.lnc}"
        return f"{self.model} {self.op} {self.mode} {dims}{lnc}"

    @property
    def family(self) -> str:
        return "attention" if "attention" in self.op else "moe"


def _attention_cases(m: ModelConfig, mode: str, seqlens, batch: int) -> list[Case]:
    cases = []
    for s in seqlens:
        dims = dict(B=batch, Hq=m.heads, Hkv=m.kv_heads, Sq=s, Sk=s, D=m.head_dim, causal=True)
        cases.append(Case("flash_attention", mode, m.name, dims))
        if m.window > 0:
            cases.append(Case("flash_attention", mode, m.name, {**dims, "window_left": m.window,
                                                               "sinks": m.sinks}))
    return cases


def _decode_cases(m: ModelConfig, caches, batch: int, sq: int) -> list[Case]:
    if m.head_dim > 256 or m.v_head_dim not in (None, m.head_dim):
        return []
    return [Case("decode_attention", "decode", m.name,
                 dict(B=batch, Hq=m.heads, Hkv=m.kv_heads, Sq=sq, L=cache, D=m.head_dim)) for cache in caches]


def _serving_decode_cases() -> list[Case]:
    """Decode caches as serving stacks size them: a Hugging Face ``StaticCache`` of
    ``max_cache_len`` 3000 holding 2900 tokens (a capacity not a multiple of 128 keys,
    docs/perf-log.md §39.1), and a token-major paged pool behind a block table sized to a 32k
    context holding an 8k sequence (vLLM's and Hugging Face continuous batching's layout: the
    kernel's multi-chunk path, docs/perf-log.md §32.1, §36.1). Both simulated at their real shape
    (they follow the kernel's paths, which one (batch x kv-head) group would change)."""
    llama, gpt_oss = MODELS["llama3-8b"], MODELS["gpt-oss-120b"]
    return [
        Case("decode_attention", "decode", llama.name, dict(B=1, Hq=llama.heads, Hkv=llama.kv_heads, Sq=1, L=2900,
                                                            D=llama.head_dim, C=3000), extrapolate=False),
        Case("decode_attention", "decode", gpt_oss.name, dict(B=1, Hq=gpt_oss.heads, Hkv=gpt_oss.kv_heads, Sq=1,
                                                              L=8192, D=gpt_oss.head_dim, C=32768, block_size=64,
                                                              layout="NHD", sinks=True), extrapolate=False),
    ]


def _moe_cases(m: ModelConfig, mode: str, tokens) -> list[Case]:
    if not m.is_moe:
        return []
    cases = []
    for t in tokens:
        cases.append(Case("moe_router", mode, m.name, dict(T=t, H=m.hidden, E=m.experts, k=m.top_k)))
        cases.append(Case("moe_experts", mode, m.name, dict(T=t, H=m.hidden, I=m.intermediate, E=m.experts,
                                                            k=m.top_k, block_size=128)))
    return cases


def sweep(name: str) -> list[Case]:
    """The cases of sweep ``name`` (see :data:`SWEEPS`)."""
    if name not in SWEEPS:
        raise ValueError(f"sweep must be one of {sorted(SWEEPS)}, got {name!r}")
    return SWEEPS[name]()


def _default() -> list[Case]:
    """Runnable in a few minutes on this CPU: one prefill length, short decode caches and two
    serving-stack caches (``_serving_decode_cases``), a moderate token count, one training case per
    family; large dims are extrapolated (see harness) rather than simulated."""
    cases: list[Case] = []
    for m in MODELS.values():
        cases += _attention_cases(m, "prefill", (1024,), 1)
        cases += _decode_cases(m, (2048,), 1, 1)
        cases += _moe_cases(m, "prefill", (1024,))
    cases += _serving_decode_cases()
    cases += _attention_cases(MODELS["llama3-8b"], "train", (1024,), 1)
    cases += _moe_cases(MODELS["qwen3-30b-a3b"], "train", (1024,))
    return cases


def _full() -> list[Case]:
    """The issue's sweep: prefill S 1k-16k, training S 2k-8k (fwd+bwd), decode caches 1k-32k."""
    cases: list[Case] = []
    for m in MODELS.values():
        cases += _attention_cases(m, "prefill", (1024, 4096, 16384), 1)
        cases += _attention_cases(m, "train", (2048, 8192), 1)
        cases += _decode_cases(m, (1024, 8192, 32768), 8, 1)
        cases += _decode_cases(m, (8192,), 8, 4)  # speculative verification
        cases += _moe_cases(m, "prefill", (512, 4096, 16384))
        cases += _moe_cases(m, "train", (4096,))
    return cases


def _smoke() -> list[Case]:
    """Tiny shapes for tests: every op family, simulated without extrapolation."""
    return [
        Case("flash_attention", "prefill", "tiny", dict(B=1, Hq=2, Hkv=1, Sq=256, Sk=256, D=64, causal=True)),
        Case("flash_attention", "train", "tiny", dict(B=1, Hq=2, Hkv=1, Sq=128, Sk=128, D=64, causal=True)),
        Case("decode_attention", "decode", "tiny", dict(B=2, Hq=4, Hkv=2, Sq=1, L=256, D=64)),
        Case("moe_router", "prefill", "tiny", dict(T=128, H=256, E=8, k=2)),
        Case("moe_experts", "prefill", "tiny", dict(T=128, H=256, I=128, E=8, k=2, block_size=128)),
    ]


def _targets() -> list[Case]:
    """The cases of issue 13's targets (see :data:`nki_lib.bench.targets.TUNING_TARGETS`), each once."""
    from nki_lib.bench.targets import target_cases  # noqa: PLC0415 - targets builds on Case

    return target_cases()


def _aws() -> list[Case]:
    """The problems of issue 13's comparison with AWS's NKI Library kernels (trn2, one launch
    each; the AWS figures are in the issue and docs/perf-log.md), each simulated at its full shape.
    Run with ``--lnc 2`` as well: AWS's experts figure uses two cores."""
    return [replace(c, extrapolate=False) for c in _aws_problems()]


def _aws_problems() -> list[Case]:
    return [
        Case("flash_attention", "prefill", "aws", dict(B=1, Hq=1, Hkv=1, Sq=4096, Sk=4096, D=128, causal=True)),
        Case("flash_attention", "train", "aws", dict(B=1, Hq=1, Hkv=1, Sq=4096, Sk=4096, D=128, causal=True)),
        Case("flash_attention", "train", "aws", dict(B=2, Hq=1, Hkv=1, Sq=2048, Sk=2048, D=128, causal=True)),
        Case("moe_router", "prefill", "aws", dict(T=1024, H=4096, E=128, k=8)),
        Case("moe_experts", "prefill", "aws", dict(T=1024, H=2048, I=768, E=8, k=2, block_size=256)),
        Case("decode_attention", "decode", "aws", dict(B=4, Hq=8, Hkv=1, Sq=1, L=2048, D=128, sinks=True)),
        Case("decode_attention", "decode", "aws", dict(B=8, Hq=4, Hkv=1, Sq=4, L=128, D=64, sinks=True)),
        Case("decode_attention", "decode", "aws", dict(B=8, Hq=8, Hkv=1, Sq=4, L=1024, D=128, sinks=True)),
    ]


SWEEPS = {"default": _default, "full": _full, "smoke": _smoke, "targets": _targets, "aws": _aws}
