"""Hugging Face transformers (extra ``hf``): ``attn_implementation="nki"``.

``register()`` adds ``"nki"`` to transformers' ``AttentionInterface`` (the attention function)
and ``AttentionMaskInterface`` (the mask builder), then the MoE experts integration of
``nki_lib.integrations.transformers_moe`` when that module is present. After it, any model on
transformers' attention interface runs its attention through ``torch.ops.nki.flash_attention``::

    from nki_lib.integrations import transformers as nki_hf
    nki_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="nki")

How HF's masks map onto the op (static shapes throughout: compile and export work with padding):

* **Causal / sliding window.** The mask builder recognises transformers' own causal and
  sliding-window-causal mask functions; for those it returns only the 2-D key padding mask
  (B, Sk) of the layer's keys (or None without padding), and the attention function passes
  ``causal=True`` and, for ``sliding_window=W``, ``window_left = W - 1`` (HF's rule: query q sees
  keys ``q - W < k <= q``), bottom-right aligned, which is HF's absolute alignment whenever
  ``q_offset - kv_offset == Sk - Sq`` (no cache, dynamic caches, sliding-window caches).
* **Padding** (left or right): the key mask becomes ``attn_mask`` (B, 1, 1, Sk) of the op; the
  flash kernels take it as per-row key bounds (one O(B * Sk) host pass), so padded batches run
  on the kernels; a mask with holes inside a row is a recorded fallback.
* **Packed sequences**: HF's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs (e.g. from
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) become ``cu_seqlens`` /
  ``cu_seqlens_k`` (B == 1); the mask transformers built for the same packing is not used.
* **Everything else** (other mask functions: packed ``position_ids`` without ``cu_seq_lens_*``,
  bidirectional, chunked or custom overlays; static caches whose offsets are not bottom-right)
  gets transformers' dense boolean mask (its ``sdpa_mask``), passed as ``attn_mask`` with no
  causal/window flags: correct, served by the kernels when every row's keys are one interval
  (e.g. packed ``position_ids``: block-diagonal causal), else counted as a fallback in
  ``nki_lib.coverage()``.
* **Continuous batching** (``generate_batch``) runs only on ``"sdpa"``, ``"paged|eager"`` or a flash
  implementation, so ``serve_continuous_batching()`` puts nki's attention function behind the first
  two. Each call packs the batch's requests on one row with ``cu_seq_lens_q`` / ``cu_seq_lens_k``
  and passes their block mask (``finfo.min`` where blocked) with ``is_causal=False``: when that
  mask is exactly the documents' bottom-right causal (or windowed, or full) mask, the documents'
  flags are used (kernels); any other mask is passed as it is.
* ``softcap`` (Gemma 2), ``s_aux`` sinks (gpt-oss, any float dtype), GQA and ``scaling`` map
  directly. Attention dropout (``dropout > 0`` in training) is not in the op: the call runs
  PyTorch's SDPA and is recorded as a fallback (softcap or sinks with dropout raise).
"""

from __future__ import annotations

import torch

from nki_lib.attention import flash_attention
from nki_lib.coverage import LEDGER

__all__ = ["register", "serve_continuous_batching", "attention_forward", "mask_forward", "NAME",
           "CONTINUOUS_BATCHING_NAMES"]

NAME = "nki"
CONTINUOUS_BATCHING_NAMES = ("sdpa", "paged|eager")   # what transformers 5.25 continuous batching runs on


# --------------------------------------------------------------------------- mask builder

def _closure_values(fn):
    return [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]


def _structure(mask_function, local_size, attention_mask, kwargs):
    """``"causal"`` / ``"sliding"`` for transformers' own causal and sliding-window-causal mask
    functions (sliding: with the window the builder was given), else None (dense mask).

    Eager code inspects the sliding closure exactly. Under torch.compile / export closures cannot
    be read, so an ``and_masks`` function with a window counts as sliding only where transformers
    cannot have composed anything else into it: a padding mask is given (it packs sequences only
    without one), no overlay (``use_vmap``) and no chunked attention in the config."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return "causal" if local_size is None else None
    and_code = mu.and_masks(mu.causal_mask_function).__code__
    config = kwargs.get("config")
    if (getattr(mask_function, "__code__", None) is not and_code or local_size is None
            or kwargs.get("use_vmap") or getattr(config, "attention_chunk_size", None)):
        return None
    if torch.compiler.is_compiling():
        return "sliding" if attention_mask is not None else None
    parts = next((v for v in _closure_values(mask_function) if isinstance(v, tuple)), ())
    if len(parts) != 2 or mu.causal_mask_function not in parts:
        return None
    overlay = parts[0] if parts[1] is mu.causal_mask_function else parts[1]
    overlay_code = mu.sliding_window_overlay(1).__code__
    if getattr(overlay, "__code__", None) is overlay_code and _closure_values(overlay) == [local_size]:
        return "sliding"
    return None


def mask_forward(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, local_size=None, **kwargs):
    """transformers' mask builder for ``"nki"``: the key padding mask (B, Sk) bool of the layer's
    keys, None (no padding), or -- for masks the op's flags cannot state -- transformers' dense
    (B, 1, Sq, Sk) boolean mask."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset - kv_offset == kv_length - q_length)
    if aligned and _structure(mask_function, local_size, attention_mask, kwargs) is not None:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        return None if padding is None else padding[:, kv_offset:kv_offset + kv_length]
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, local_size=local_size,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


# --------------------------------------------------------------------------- attention

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers' attention function for ``"nki"``: q/k/v (B, H, S, D) in, ``(out (B, S, H, D),
    None)`` out (no attention weights)."""
    if kwargs.get("output_attentions", False):
        raise ValueError('attn_implementation="nki" does not return attention weights '
                         '(output_attentions=True needs "eager")')
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    flags = dict(scale=scaling, softcap=0.0 if softcap is None else float(softcap))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    dense = attention_mask is not None and attention_mask.dim() == 4
    window_left = -1 if sliding_window is None else int(sliding_window) - 1
    mask = None
    if cu_q is not None and dense:              # continuous batching: the mask is the truth (is_causal False)
        causal = _documents_form(attention_mask, cu_q, cu_k, window_left)
        dense = causal is None
    if cu_q is not None and not dense:
        flags.update(causal=causal, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    elif dense:
        flags.update(causal=False)              # dense mask: it already holds causal/window
        mask = attention_mask
    else:
        flags.update(causal=causal)
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].to(torch.bool)
    if window_left >= 0 and flags["causal"]:    # HF: q - W < k <= q
        flags["window"] = (window_left, -1)
    if dropout and dropout > 0:
        return _dropout_fallback(query, key, value, mask, dropout, flags, s_aux), None
    out = flash_attention(query, key, value, sinks=s_aux, attn_mask=mask, **flags)
    return out.transpose(1, 2).contiguous(), None


def _documents_form(mask, cu_q, cu_k, window_left):
    """The flags of a dense (1, 1, Sq, Sk) mask given together with ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, as continuous batching passes them (with ``is_causal=False``: the mask holds
    causality, blocked keys at ``finfo.min``): True when it is exactly the packed documents'
    bottom-right causal mask (with ``window_left`` if >= 0), False when it is exactly their
    full (non-causal) mask, else None (the mask is passed as it is). One pass over the mask on the
    host; None under torch.compile (a data-dependent check), and when the documents do not cover
    the whole query and key lengths (padding) or a row allows no key."""
    sq, sk = mask.shape[-2:]
    if torch.compiler.is_compiling() or mask.shape[:2] != (1, 1) or cu_k is None:
        return None
    cu_q, cu_k = (c.to(device=mask.device, dtype=torch.long) for c in (cu_q, cu_k))
    if int(cu_q[-1]) != sq or int(cu_k[-1]) != sk or cu_q.numel() != cu_k.numel():
        return None
    if mask.dtype == torch.bool:
        allowed = mask[0, 0]
    else:
        allowed = mask[0, 0] == 0
        if not (allowed | (mask[0, 0] <= torch.finfo(mask.dtype).min)).all():
            return None                         # other additive values: the mask is needed
    rows, cols = torch.arange(sq, device=mask.device), torch.arange(sk, device=mask.device)
    doc_q = torch.searchsorted(cu_q[1:], rows, right=True)
    doc_k = torch.searchsorted(cu_k[1:], cols, right=True)
    diag = (rows - cu_q[doc_q] + (cu_k[doc_q + 1] - cu_k[doc_q]) - (cu_q[doc_q + 1] - cu_q[doc_q]))[:, None]
    key = (cols - cu_k[doc_k])[None, :]
    same = doc_q[:, None] == doc_k[None, :]
    seen = same & (key <= diag)
    if window_left >= 0:
        seen &= key >= diag - window_left
    if seen.any(dim=1).all() and torch.equal(allowed, seen):
        return True
    if window_left < 0 and torch.equal(allowed, same):
        return False
    return None


def _dropout_fallback(query, key, value, mask, dropout, flags, sinks):
    """Training with attention dropout: PyTorch's SDPA on the same mask (recorded)."""
    if sinks is not None or flags["softcap"] > 0 or flags.get("cu_seqlens") is not None:
        raise NotImplementedError('attn_implementation="nki": attention dropout with sinks, softcap '
                                  'or cu_seq_lens is not supported; set attention_dropout=0')
    LEDGER.record_fallback("flash_attention", "hf", "attention dropout (served by torch SDPA)")
    sq, sk = query.shape[2], key.shape[2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
    if flags["causal"]:
        keep = keep.tril(sk - sq)
    window = flags.get("window")
    if window is not None:
        keep = keep & ~torch.ones_like(keep).tril(sk - sq - window[0] - 1)
    full = keep[None, None] if mask is None else keep[None, None] & mask
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=full, dropout_p=dropout, scale=flags["scale"],
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- registration

def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default ``"nki"``) available to transformers models,
    and (when ``nki_lib.integrations.transformers_moe`` is present) ``experts_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    _register_experts(name)


def serve_continuous_batching():
    """Serve the attention implementations transformers' continuous batching runs on
    (``CONTINUOUS_BATCHING_NAMES``) with nki's attention function; returns a function that puts
    transformers' own back. Continuous batching (``generate_batch``, ``init_continuous_batching``)
    runs only on ``"sdpa"``, ``"paged|eager"`` or a flash implementation (transformers 5.25
    ``switch_to_cb_friendly_attn``; a name containing "flash" must import a flash-attn kernel), so it
    refuses ``attn_implementation="nki"``. Its calls pass the packed requests' ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` with their block mask and ``is_causal=False``; the attention function takes the
    documents' flags when the mask is exactly theirs (``_documents_form``), so prefill and decode
    steps run on the kernels. The replacement is process-wide: a model loaded with ``"sdpa"`` outside
    continuous batching runs nki's attention too (on transformers' own masks)."""
    from transformers import AttentionInterface

    saved = {name: AttentionInterface._global_mapping.get(name) for name in CONTINUOUS_BATCHING_NAMES}
    for name in CONTINUOUS_BATCHING_NAMES:
        AttentionInterface.register(name, attention_forward)

    def restore():
        for name, fn in saved.items():
            AttentionInterface.register(name, fn)

    return restore


def _register_experts(name: str) -> None:
    import importlib.util

    module = "nki_lib.integrations.transformers_moe"
    if importlib.util.find_spec(module) is not None:
        importlib.import_module(module).register(name)

