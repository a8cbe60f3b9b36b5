"""``torch.ops.nki.moe_experts`` and its backward op: validation, fake, autograd, paths.

Forward:  moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down,
                      b_gate_up=None, b_down=None, *, activation="silu", swiglu_alpha=1.702,
                      swiglu_limit=7.0, weight_layout="out_in") -> y
Training forward (what a call that needs gradients runs, from the forward op's autograd kernel):
          moe_experts_train(<the forward's arguments>) -> (y, saved)   (saved: the forward kernel's
          pre-activation g/u, or an empty (0,) tensor: docs/contract.md §4.3 "Saved activations")
Backward: moe_experts_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up,
                               w_down, b_gate_up, b_down, saved=None, *, <flags>)
              -> (dx, dtopk_weights, dw_gate_up, dw_down, db_gate_up, db_down)
Semantics: docs/contract.md §4.3; the gates and biases: ``moe_experts_reference``. Shapes: x (T, H),
topk_weights (T, k) any float dtype (math in float32, or float64 for float64 x; its gradient in its
own dtype), block_expert (NB,) and slot_assignment (NB * B,) int32 or int64, w_gate_up (E, 2I, H),
w_down (E, H, I), b_gate_up (E, 2I), b_down (E, H) (x's dtype); y (T, H) in x's dtype. The
bias gradients are empty (0,) tensors when the bias is absent. ``swiglu_alpha`` and
``swiglu_limit`` apply to ``activation="clamped_swiglu"`` (gpt-oss) only. ``weight_layout``:
``"out_in"`` (default, nn.Linear: the shapes above) or ``"in_out"`` (the contraction dim first:
w_gate_up (E, H, 2I), w_down (E, I, H), gpt-oss's Hugging Face layout, which the forward kernel
multiplies with no weight transposes; the backward kernel takes either layout as given, with no
host copies); the weight gradients come back in the weights' layout.

Autocast (SDPA's policy, :mod:`nki_lib.autograd.autocast`): under an enabled autocast region x, the
weights and the biases are cast to the autocast dtype (y comes out in it); the routing weights
keep their dtype (any float dtype is served, the math is float32 either way).

The plan (block_expert, slot_assignment) is the output of ``torch.ops.nki.moe_plan``; any plan in
which every assignment 0 .. T*k-1 sits in exactly one slot of a block with an expert in [0, E) and
each expert's blocks are consecutive is accepted (checked on real tensors, like ``cu_seqlens`` in
attention).
"""

from __future__ import annotations

import warnings

import torch

from nki_lib import registry
from nki_lib.autograd import forbid_double_backward, masked_grads, zeros_if_none
from nki_lib.autograd.autocast import follow_sdpa_autocast
from nki_lib.dispatch import Unsupported, dispatch, kernel_path
from nki_lib.moe import moe_experts_reference as reference
from nki_lib.registry import OpSpec, Sample
from nki_lib.validation import FLOAT_DTYPES, check_same_device, check_same_dtype, has_values, on_host
from nki_lib.validation import check_tensor as _check_tensor

INDEX_DTYPE = torch.int32          # what the kernels take (the plan's own dtype)
INDEX_DTYPES = (torch.int32, torch.int64)
ALPHA, LIMIT = reference.SWIGLU_ALPHA, reference.SWIGLU_LIMIT
LAYOUT = reference.WEIGHT_LAYOUTS[0]   # "out_in", nn.Linear's


# --------------------------------------------------------------------------- validation

def validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None,
             *, activation, swiglu_alpha=ALPHA, swiglu_limit=LIMIT, weight_layout=LAYOUT):
    """Shape/dtype/argument checks (no data access: safe under fake tensors)."""
    _check_tensor("x", x, rank=2, dtypes=FLOAT_DTYPES)
    _check_tensor("topk_weights", topk_weights, rank=2, dtypes=FLOAT_DTYPES)
    _check_tensor("block_expert", block_expert, rank=1, dtypes=INDEX_DTYPES)
    _check_tensor("slot_assignment", slot_assignment, rank=1, dtypes=INDEX_DTYPES)
    _check_tensor("w_gate_up", w_gate_up, rank=3, dtypes=FLOAT_DTYPES)
    _check_tensor("w_down", w_down, rank=3, dtypes=FLOAT_DTYPES)
    check_same_dtype("w_gate_up", w_gate_up, "x", x)
    check_same_dtype("w_down", w_down, "x", x)
    check_same_device("x", x, topk_weights=topk_weights, block_expert=block_expert,
                      slot_assignment=slot_assignment, w_gate_up=w_gate_up, w_down=w_down,
                      b_gate_up=b_gate_up, b_down=b_down)
    _validate_flags(activation, swiglu_alpha, swiglu_limit, weight_layout)
    _validate_weights(w_gate_up, w_down, x.shape[1], weight_layout)
    _validate_biases(b_gate_up, b_down, w_gate_up, w_down, x, weight_layout)
    t_len = x.shape[0]
    if topk_weights.shape[0] != t_len:
        raise ValueError(f"topk_weights must have shape (T={t_len}, k), got {tuple(topk_weights.shape)}")
    experts = w_gate_up.shape[0]
    if experts < 1:
        raise ValueError("w_gate_up must hold at least one expert (E >= 1)")
    nb, slots = block_expert.shape[0], slot_assignment.shape[0]
    if (nb == 0) != (slots == 0) or (nb and slots % nb):
        raise ValueError(f"slot_assignment must have NB * block_size entries (NB={nb} blocks), got {slots}")


def _validate_weights(w_gate_up, w_down, hidden, weight_layout):
    """The weights' shapes in ``weight_layout`` (out_in: (E, 2I, H), (E, H, I); in_out: (E, H, 2I),
    (E, I, H))."""
    in_out = weight_layout == "in_out"
    gu_name = "(E, H, 2I)" if in_out else "(E, 2I, H)"
    experts, two_inter, w_hidden = reference.as_out_in(w_gate_up, weight_layout).shape
    if w_hidden != hidden:
        raise ValueError(f"w_gate_up must have shape {gu_name.replace('H', f'H={hidden}')} "
                         f"(weight_layout={weight_layout!r}), got {tuple(w_gate_up.shape)}")
    if two_inter % 2:
        raise ValueError(f"w_gate_up must have an even 2I in {gu_name} (weight_layout={weight_layout!r}), "
                         f"got shape {tuple(w_gate_up.shape)}")
    inter = two_inter // 2
    down = (experts, inter, hidden) if in_out else (experts, hidden, inter)
    if tuple(w_down.shape) != down:
        names = "(E={}, I={}, H={})" if in_out else "(E={}, H={}, I={})"
        values = (experts, inter, hidden) if in_out else (experts, hidden, inter)
        raise ValueError(f"w_down must have shape {names.format(*values)} (weight_layout={weight_layout!r}), "
                         f"got {tuple(w_down.shape)}")


def _validate_biases(b_gate_up, b_down, w_gate_up, w_down, x, weight_layout):
    for name, bias, weight in (("b_gate_up", b_gate_up, w_gate_up), ("b_down", b_down, w_down)):
        if bias is None:
            continue
        _check_tensor(name, bias, rank=2, dtypes=FLOAT_DTYPES)
        check_same_dtype(name, bias, "x", x)
        shape = tuple(reference.as_out_in(weight, weight_layout).shape[:2])
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(bias.shape)}")


def _validate_flags(activation, swiglu_alpha, swiglu_limit, weight_layout=LAYOUT):
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if not isinstance(weight_layout, str):
        raise TypeError(f"weight_layout must be a str, got {type(weight_layout).__name__}")
    reference.check_weight_layout(weight_layout)


def _kernel_args(tensors):
    """Contiguous inputs (the same bits reach every path whatever the caller's strides), the
    plan in the kernels' int32 (lossless: the op validated its values)."""
    out = [None if t is None else t.contiguous() for t in tensors]
    for i in (2, 3):
        out[i] = out[i].to(INDEX_DTYPE)
    return tuple(out)


def validate_plan_values(block_expert, slot_assignment, *, num_assignments, num_experts):
    """Data checks of the plan (real tensors only), on host copies (``nki_lib.validation.on_host``: the
    whole-op estimate charges one transfer per tensor copied, and nothing for the checks)."""
    with on_host(block_expert, slot_assignment) as (experts, slots):   # int32 or int64 as given
        _check_plan(experts, slots, num_assignments, num_experts)


def _check_plan(experts, slots, num_assignments, num_experts):
    """:func:`validate_plan_values` on the host copies of block_expert and slot_assignment."""
    idle_blocks = padded = False
    if experts.numel():
        low, high = (int(v) for v in torch.aminmax(experts))
        if low < -1 or high >= num_experts:
            raise ValueError(f"block_expert must lie in [-1, E={num_experts}), got values in [{low}, {high}]")
        idle_blocks = low == -1
    if slots.numel():
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < -1 or high >= num_assignments:
            raise ValueError(f"slot_assignment must lie in [-1, T*k={num_assignments}), got values in "
                             f"[{low}, {high}]")
        padded = low == -1
    # values in [-1, N): each of 0..N-1 exactly once <=> N distinct values >= 0 in N slots >= 0
    values, counts = torch.unique(slots, return_counts=True)
    padding = int(counts[0]) if padded else 0
    if values.numel() - int(padded) != num_assignments or slots.numel() - padding != num_assignments:
        raise ValueError(f"slot_assignment must hold every assignment 0..T*k-1 (T*k={num_assignments}) "
                         f"exactly once")
    if experts.numel():
        valid = experts >= 0
        run_starts = int(valid[0]) + int(((experts[1:] != experts[:-1]) & valid[1:]).sum())
        if run_starts != torch.unique(experts).numel() - int(idle_blocks):
            raise ValueError(f"block_expert: the blocks of each expert must be consecutive (as moe_plan makes "
                             f"them; the backward accumulates an expert's weight gradients across its run), "
                             f"got {experts.tolist()}")
        block_max = slots.reshape(experts.numel(), -1).amax(1)
        if idle_blocks and int(torch.where(valid, -1, block_max).max()) >= 0:
            raise ValueError("slot_assignment must be -1 in every block whose block_expert is -1")


def _empty(x, topk_weights, w_gate_up):
    """True when y is identically zero without running anything (T, H, k or I is 0)."""
    return x.numel() == 0 or topk_weights.numel() == 0 or w_gate_up.numel() == 0


def _check_forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, flags):
    """The forward ops' checks: shapes and flags, then the plan's values on real tensors."""
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, **flags)
    _check_plan_values(block_expert, slot_assignment, topk_weights, w_gate_up)


def _check_plan_values(block_expert, slot_assignment, topk_weights, w_gate_up):
    """:func:`validate_plan_values` against the call's assignment and expert counts, on eager calls
    (real tensors) only."""
    if has_values(block_expert, slot_assignment):
        validate_plan_values(block_expert, slot_assignment, num_assignments=topk_weights.numel(),
                             num_experts=w_gate_up.shape[0])


# --------------------------------------------------------------------------- forward op

@torch.library.custom_op("nki::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, block_expert: torch.Tensor,
                   slot_assignment: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, *,
                   activation: str = "silu", swiglu_alpha: float = ALPHA, swiglu_limit: float = LIMIT,
                   weight_layout: str = LAYOUT) -> torch.Tensor:
    flags = dict(activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                 weight_layout=weight_layout)
    _check_forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, flags)
    if _empty(x, topk_weights, w_gate_up):
        return torch.zeros_like(x)
    args = _kernel_args((x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down))

    def launch():
        from nki_lib.moe.kernels import moe_experts_fwd_launch
        return moe_experts_fwd_launch.launch_moe_experts_fwd(*args, **flags)

    y = dispatch("moe_experts", args[:2] + args[4:], launch=launch,
                 reference=lambda: reference.moe_experts(*args, **flags))
    return y.contiguous()


def saved_grouping(args, flags):
    """(blocks per group, shape) of the g/u the forward kernel saves for the backward
    (``moe_experts_fwd_launch.saved_grouping``) when a training forward will run it and can save them, else None (the reference path, float64,
    or a call the forward kernel cannot serve, or cannot serve while saving: the backward then
    recomputes g and u). Reads no data (the fake uses it)."""
    if kernel_path(args[:2] + args[4:]) is None:
        return None
    from nki_lib.moe.kernels import moe_experts_fwd_launch
    try:
        return moe_experts_fwd_launch.saved_grouping(*args, activation=flags["activation"],
                                                     weight_layout=flags["weight_layout"])
    except Unsupported:
        return None


# --------------------------------------------------------------------------- training forward op

@torch.library.custom_op("nki::moe_experts_train", mutates_args=())
def moe_experts_train_op(x: torch.Tensor, topk_weights: torch.Tensor, block_expert: torch.Tensor,
                         slot_assignment: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None, *,
                         activation: str = "silu", swiglu_alpha: float = ALPHA, swiglu_limit: float = LIMIT,
                         weight_layout: str = LAYOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_experts`` when its inputs require grad (the public op's autograd calls it): y and the
    saved pre-activation g/u for the backward (:func:`saved_grouping`; an empty (0,) tensor when the
    forward kernel does not save them, and the backward recomputes)."""
    flags = dict(activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                 weight_layout=weight_layout)
    _check_forward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, flags)
    if _empty(x, topk_weights, w_gate_up):
        return torch.zeros_like(x), x.new_empty(0)
    args = _kernel_args((x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down))
    save = saved_grouping(args, flags) is not None

    def launch():
        from nki_lib.moe.kernels import moe_experts_fwd_launch
        return moe_experts_fwd_launch.launch_moe_experts_fwd(*args, **flags, save_activations=save)

    out = dispatch("moe_experts", args[:2] + args[4:], launch=launch,
                   reference=lambda: (reference.moe_experts(*args, **flags), x.new_empty(0)))
    y, saved = out if isinstance(out, tuple) else (out, x.new_empty(0))
    return y.contiguous(), saved.contiguous()


@moe_experts_train_op.register_fake
def _(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
      activation="silu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT, weight_layout=LAYOUT):
    flags = dict(activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                 weight_layout=weight_layout)
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, **flags)
    grouping = None if _empty(x, topk_weights, w_gate_up) else saved_grouping(
        (x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down), flags)
    return x.new_empty(x.shape), x.new_empty((0,) if grouping is None else grouping[1])


@moe_experts_op.register_fake
def _(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
      activation="silu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT, weight_layout=LAYOUT):
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down,
             activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
             weight_layout=weight_layout)
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- backward op

@torch.library.custom_op("nki::moe_experts_backward", mutates_args=())
def moe_experts_backward_op(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                            block_expert: torch.Tensor, slot_assignment: torch.Tensor,
                            w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                            b_down: torch.Tensor | None = None, saved: torch.Tensor | None = None, *,
                            activation: str = "silu",
                            swiglu_alpha: float = ALPHA, swiglu_limit: float = LIMIT, weight_layout: str = LAYOUT,
                            plan_checked: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    """The gradients of ``moe_experts``. ``plan_checked=True`` says the plan's values already
    passed :func:`validate_plan_values` (the autograd formula passes it: its forward checked the
    same saved tensors); a direct call checks them here, since the kernel accumulates an expert's
    weight gradients across one run of consecutive blocks (docs/contract.md §7 item 2)."""
    flags = dict(activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down,
             weight_layout=weight_layout, **flags)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy must match y: shape {tuple(x.shape)} {x.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    if not plan_checked:
        _check_plan_values(block_expert, slot_assignment, topk_weights, w_gate_up)
    if _empty(x, topk_weights, w_gate_up):
        return _zero_grads(x, topk_weights, w_gate_up, w_down, b_gate_up, b_down)
    args = (dy.contiguous(),) + _kernel_args((x, topk_weights, block_expert, slot_assignment, w_gate_up,
                                              w_down, b_gate_up, b_down))

    def launch():   # the kernel takes either weight layout as given (no host copies)
        from nki_lib.moe.kernels import moe_experts_bwd
        return moe_experts_bwd.launch_moe_experts_bwd(*args, saved=_usable_saved(saved, args[1:], flags, weight_layout),
                                                      weight_layout=weight_layout, **flags)

    grads = dispatch("moe_experts_backward", args[:3] + args[5:], launch=launch,
                     reference=lambda: reference.moe_experts_backward(*args, weight_layout=weight_layout, **flags))
    return tuple(g.contiguous() for g in grads)


def _usable_saved(saved, args, flags, weight_layout):
    """(the forward kernel's saved g/u, its blocks per group) when the saved tensor has this
    call's layout (its shape), else None (the backward kernel recomputes g and u)."""
    if saved is None or saved.numel() == 0:
        return None
    grouping = saved_grouping(args, dict(flags, weight_layout=weight_layout))
    if grouping is None or tuple(saved.shape) != tuple(grouping[1]):
        return None
    return saved.contiguous(), grouping[0]


def _zero_grads(x, topk_weights, w_gate_up, w_down, b_gate_up, b_down):
    return (torch.zeros_like(x), torch.zeros_like(topk_weights), torch.zeros_like(w_gate_up),
            torch.zeros_like(w_down), x.new_zeros(0) if b_gate_up is None else torch.zeros_like(b_gate_up),
            x.new_zeros(0) if b_down is None else torch.zeros_like(b_down))


@moe_experts_backward_op.register_fake
def _(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up=None, b_down=None,
      saved=None, *, activation="silu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT, weight_layout=LAYOUT,
      plan_checked=False):
    return tuple(torch.empty_like(g) for g in _zero_grads(x, topk_weights, w_gate_up, w_down, b_gate_up, b_down))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *biases = inputs
    biases = (biases + [None, None])[:2]
    saved = output[1] if isinstance(output, tuple) else None     # the training forward's g/u
    if saved is not None:
        ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)    # no zero gradient built for the saved g/u (or an unused y)
    ctx.save_for_backward(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *biases, saved)
    ctx.flags = dict(keyword_only_inputs)


def _backward(ctx, dy, *_):
    x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up, b_down, saved = ctx.saved_tensors
    dx, dtopk, dw_gate_up, dw_down, db_gate_up, db_down = torch.ops.nki.moe_experts_backward(
        zeros_if_none(dy, x), x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, b_gate_up,
        b_down, saved, **ctx.flags, plan_checked=True)     # the forward validated these saved values
    grads = (dx, dtopk, None, None, dw_gate_up, dw_down, None if b_gate_up is None else db_gate_up,
             None if b_down is None else db_down)
    return masked_grads(ctx.needs_input_grad, grads)


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)
moe_experts_train_op.register_autograd(_backward, setup_context=_setup_context)
forbid_double_backward(moe_experts_backward_op, "moe_experts")


def _autograd_kernel(keyset, *args, **kwargs):
    """The Autograd kernel of ``nki::moe_experts``: a call that needs gradients runs the training
    forward (``nki::moe_experts_train``, whose saved g/u spare the backward two of its eight
    products); any other call (inference, no_grad) runs the op itself and saves nothing."""
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return torch.ops.nki.moe_experts_train(*args, **kwargs)[0]
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.nki.moe_experts.default.redispatch(keyset & torch._C._after_autograd_keyset, *args,
                                                            **kwargs)


_LIB = torch.library.Library("nki", "IMPL")
with warnings.catch_warnings():     # replacing register_autograd's kernel above is intended
    warnings.simplefilter("ignore")
    _LIB.impl("moe_experts", _autograd_kernel, "Autograd", with_keyset=True)
follow_sdpa_autocast("moe_experts", cast_args=("x", "w_gate_up", "w_down", "b_gate_up", "b_down"))


# --------------------------------------------------------------------------- registry entry

def make_sample(t, h, inter, e, k, block_size, dtype, requires_grad, *, activation="silu", seed=0,
                topk_ids=None, biases=False, weight_layout=LAYOUT, **gate_flags) -> Sample:
    """Random x, weights (and expert biases) and normalised routing weights; the plan from
    ``nki::moe_plan``. Distinct random experts per token unless ``topk_ids`` (T, k) is given;
    ``gate_flags``: swiglu_alpha / swiglu_limit. ``weight_layout`` "in_out": the same random
    weights, transposed (contiguous)."""
    from nki_lib.moe import moe_plan_op  # noqa: F401  (registers torch.ops.nki.moe_plan)

    gen = torch.Generator().manual_seed(seed)
    if topk_ids is None:
        topk_ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k]
    topk_ids = topk_ids.to(INDEX_DTYPE)
    block_expert, slot_assignment, _ = torch.ops.nki.moe_plan(topk_ids, num_experts=e,
                                                               block_size=block_size)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    topk_weights = torch.softmax(torch.randn(t, k, generator=gen, dtype=torch.float64), -1)
    mk = lambda shape, scale: (torch.randn(shape, generator=gen) * scale).to(dtype)  # noqa: E731
    tensors = [mk((t, h), 1.0), topk_weights.to(weight_dtype), block_expert, slot_assignment,
               mk((e, 2 * inter, h), h ** -0.5), mk((e, h, inter), inter ** -0.5)]
    if biases:
        tensors += [mk((e, 2 * inter), 1.0), mk((e, h), 1.0)]
    tensors[4:6] = [reference.as_out_in(w, weight_layout).contiguous() for w in tensors[4:6]]
    for i in [0, 1, 4, 5] + ([6, 7] if biases else []):
        tensors[i].requires_grad_(requires_grad)
    label = (f"T={t} H={h} I={inter} E={e} k={k} B={block_size} {str(dtype).replace('torch.', '')} "
             f"{activation}" + (" biases" if biases else "")
             + "".join(f" {n}={v}" for n, v in sorted(gate_flags.items()))
             + ("" if weight_layout == LAYOUT else f" weight_layout={weight_layout}"))
    layout = {} if weight_layout == LAYOUT else dict(weight_layout=weight_layout)
    return Sample(tuple(tensors), dict(activation=activation, **gate_flags, **layout), label)


def _samples(dtype, requires_grad):
    return [
        make_sample(13, 32, 16, 4, 2, 8, dtype, requires_grad),
        make_sample(20, 64, 48, 3, 3, 16, dtype, requires_grad, activation="gelu", seed=1),
        make_sample(9, 40, 24, 5, 1, 4, dtype, requires_grad, activation="gelu_tanh", seed=2),
        # gpt-oss: clamped swiglu (a limit low enough that both clamps engage) with expert biases
        make_sample(11, 48, 24, 4, 2, 8, dtype, requires_grad, activation="clamped_swiglu", seed=3,
                    biases=True, swiglu_limit=0.5),
        # the contraction dim first (gpt-oss's HF layout): the forward multiplies W^T tiles as loaded
        make_sample(14, 40, 24, 3, 2, 8, dtype, requires_grad, seed=4, weight_layout="in_out"),
        make_sample(11, 48, 24, 4, 2, 8, dtype, requires_grad, activation="clamped_swiglu", seed=5,
                    biases=True, swiglu_limit=0.5, weight_layout="in_out"),
    ]


def _report_samples():
    bf16 = torch.bfloat16
    return [
        make_sample(256, 512, 256, 8, 2, 128, bf16, True),
        make_sample(128, 1024, 512, 16, 4, 128, bf16, True, activation="gelu"),
    ]


SPEC = registry.register(OpSpec(
    name="moe_experts",
    naive=reference.naive,
    samples=_samples,
    report_samples=_report_samples,
    backward_name="moe_experts_backward",
    variants=("moe_experts_train",),
    family="moe",
    launchers=(
        "nki_lib.moe.kernels.moe_experts_fwd_launch.launch_moe_experts_fwd",
        "nki_lib.moe.kernels.moe_experts_bwd.launch_moe_experts_bwd",
    ),
    kernels=(
        "nki_lib.moe.kernels.moe_experts_fwd.moe_experts_fwd_kernel",
        "nki_lib.moe.kernels.moe_experts_bwd.moe_experts_bwd_kernel",
    ),
))
