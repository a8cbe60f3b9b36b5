"""``torch.ops.nki.moe_experts`` and its backward op: validation, fake, autograd, paths.

Forward:  moe_experts(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *,
                      activation="silu") -> y
Backward: moe_experts_backward(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up,
                               w_down, *, activation="silu") -> (dx, dtopk_weights, dw_gate_up, dw_down)
Semantics: docs/contract.md §4.3. Shapes: x (T, H), topk_weights float32 (T, k), block_expert int32 (NB,),
slot_assignment int32 (NB * B,), w_gate_up (E, 2I, H), w_down (E, H, I); y (T, H) in x's dtype.

The plan (block_expert, slot_assignment) is the output of ``torch.ops.nki.moe_plan``; any plan in
which every assignment 0 .. T*k-1 sits in exactly one slot of a block with an expert in [0, E) and
each expert's blocks are consecutive is accepted (checked on real tensors, like ``cu_seqlens`` in
attention).
"""

from __future__ import annotations

import torch

from nki_lib import registry
from nki_lib.autograd import forbid_double_backward, masked_grads, zeros_if_none
from nki_lib.dispatch import dispatch
from nki_lib.moe import moe_experts_reference
from nki_lib.registry import OpSpec, Sample
from nki_lib.validation import FLOAT_DTYPES, check_same_device, check_same_dtype, has_values
from nki_lib.validation import check_tensor as _check_tensor

INDEX_DTYPE = torch.int32


# --------------------------------------------------------------------------- validation

def validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *, activation):
    """Shape/dtype/argument checks (no data access: safe under fake tensors)."""
    _check_tensor("x", x, rank=2, dtypes=FLOAT_DTYPES)
    weight_dtypes = (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,)
    _check_tensor("topk_weights", topk_weights, rank=2, dtypes=weight_dtypes)
    _check_tensor("block_expert", block_expert, rank=1, dtypes=(INDEX_DTYPE,))
    _check_tensor("slot_assignment", slot_assignment, rank=1, dtypes=(INDEX_DTYPE,))
    _check_tensor("w_gate_up", w_gate_up, rank=3, dtypes=FLOAT_DTYPES)
    _check_tensor("w_down", w_down, rank=3, dtypes=FLOAT_DTYPES)
    check_same_dtype("w_gate_up", w_gate_up, "x", x)
    check_same_dtype("w_down", w_down, "x", x)
    check_same_device("x", x, topk_weights=topk_weights, block_expert=block_expert,
                      slot_assignment=slot_assignment, w_gate_up=w_gate_up, w_down=w_down)
    t_len, hidden = x.shape
    if topk_weights.shape[0] != t_len:
        raise ValueError(f"topk_weights must have shape (T={t_len}, k), got {tuple(topk_weights.shape)}")
    experts, two_inter, w_hidden = w_gate_up.shape
    if w_hidden != hidden:
        raise ValueError(f"w_gate_up must have shape (E, 2I, H={hidden}), got {tuple(w_gate_up.shape)}")
    if two_inter % 2:
        raise ValueError(f"w_gate_up must have an even number of rows 2I, got shape {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"w_down must have shape (E={experts}, H={hidden}, I={two_inter // 2}), "
                         f"got {tuple(w_down.shape)}")
    if experts < 1:
        raise ValueError("w_gate_up must hold at least one expert (E >= 1)")
    nb, slots = block_expert.shape[0], slot_assignment.shape[0]
    if (nb == 0) != (slots == 0) or (nb and slots % nb):
        raise ValueError(f"slot_assignment must have NB * block_size entries (NB={nb} blocks), got {slots}")
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in moe_experts_reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {moe_experts_reference.ACTIVATIONS}, got {activation!r}")


def validate_plan_values(block_expert, slot_assignment, *, num_assignments, num_experts):
    """Data checks of the plan (real tensors only)."""
    experts = block_expert.to("cpu", torch.int64)
    slots = slot_assignment.to("cpu", torch.int64)
    if experts.numel() and (int(experts.min()) < -1 or int(experts.max()) >= num_experts):
        raise ValueError(f"block_expert must lie in [-1, E={num_experts}), got values in "
                         f"[{int(experts.min())}, {int(experts.max())}]")
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= num_assignments):
        raise ValueError(f"slot_assignment must lie in [-1, T*k={num_assignments}), got values in "
                         f"[{int(slots.min())}, {int(slots.max())}]")
    used = slots[slots >= 0]
    if used.numel() != num_assignments or torch.bincount(used, minlength=num_assignments).ne(1).any():
        raise ValueError(f"slot_assignment must hold every assignment 0..T*k-1 (T*k={num_assignments}) "
                         f"exactly once")
    if experts.numel():
        run_start = torch.ones_like(experts, dtype=torch.bool)
        run_start[1:] = experts[1:] != experts[:-1]
        runs = experts[run_start & (experts >= 0)]
        if runs.unique().numel() != runs.numel():
            raise ValueError(f"block_expert: the blocks of each expert must be consecutive (as moe_plan makes "
                             f"them; the backward accumulates an expert's weight gradients across its run), "
                             f"got {experts.tolist()}")
        block_size = slots.numel() // experts.numel()
        idle = experts.repeat_interleave(block_size) < 0
        if bool((slots[idle] >= 0).any()):
            raise ValueError("slot_assignment must be -1 in every block whose block_expert is -1")


def _empty(x, topk_weights, w_down):
    """True when y is identically zero without running anything (T, H, k or I is 0)."""
    return x.numel() == 0 or topk_weights.numel() == 0 or w_down.shape[2] == 0


# --------------------------------------------------------------------------- forward op

@torch.library.custom_op("nki::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, block_expert: torch.Tensor,
                   slot_assignment: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                   activation: str = "silu") -> torch.Tensor:
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation=activation)
    if has_values(block_expert, slot_assignment):
        validate_plan_values(block_expert, slot_assignment, num_assignments=topk_weights.numel(),
                             num_experts=w_gate_up.shape[0])
    if _empty(x, topk_weights, w_down):
        return torch.zeros_like(x)
    # contiguous inputs: the same bits reach every path whatever the caller's strides
    args = tuple(t.contiguous() for t in (x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down))

    def launch():
        from nki_lib.moe.kernels import moe_experts_fwd
        return moe_experts_fwd.launch_moe_experts_fwd(*args, activation=activation)

    y = dispatch("moe_experts", args[:2] + args[4:], launch=launch,
                 reference=lambda: moe_experts_reference.moe_experts(*args, activation=activation))
    return y.contiguous()


@moe_experts_op.register_fake
def _(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *, activation="silu"):
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation=activation)
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- backward op

@torch.library.custom_op("nki::moe_experts_backward", mutates_args=())
def moe_experts_backward_op(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                            block_expert: torch.Tensor, slot_assignment: torch.Tensor,
                            w_gate_up: torch.Tensor, w_down: torch.Tensor, *, activation: str = "silu"
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    validate(x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, activation=activation)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy must match y: shape {tuple(x.shape)} {x.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    if _empty(x, topk_weights, w_down):
        return (torch.zeros_like(x), torch.zeros_like(topk_weights), torch.zeros_like(w_gate_up),
                torch.zeros_like(w_down))
    args = tuple(t.contiguous() for t in (dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down))

    def launch():
        from nki_lib.moe.kernels import moe_experts_bwd
        return moe_experts_bwd.launch_moe_experts_bwd(*args, activation=activation)

    grads = dispatch("moe_experts_backward", args[:3] + args[5:], launch=launch,
                     reference=lambda: moe_experts_reference.moe_experts_backward(*args, activation=activation))
    return tuple(g.contiguous() for g in grads)


@moe_experts_backward_op.register_fake
def _(dy, x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down, *, activation="silu"):
    return (x.new_empty(x.shape), topk_weights.new_empty(topk_weights.shape),
            w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.flags = dict(keyword_only_inputs)


def _backward(ctx, dy):
    x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down = ctx.saved_tensors
    dx, dtopk, dw_gate_up, dw_down = torch.ops.nki.moe_experts_backward(
        zeros_if_none(dy, x), x, topk_weights, block_expert, slot_assignment, w_gate_up, w_down,
        **ctx.flags)
    return masked_grads(ctx.needs_input_grad, (dx, dtopk, None, None, dw_gate_up, dw_down))


moe_experts_op.register_autograd(_backward, setup_context=_setup_context)
forbid_double_backward(moe_experts_backward_op, "moe_experts")


# --------------------------------------------------------------------------- registry entry

def make_sample(t, h, inter, e, k, block_size, dtype, requires_grad, *, activation="silu", seed=0,
                topk_ids=None) -> Sample:
    """Random x, weights and normalised routing weights; the plan from ``nki::moe_plan``.

    Distinct random experts per token unless ``topk_ids`` (T, k) is given.
    """
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
    for i in (0, 1, 4, 5):
        tensors[i].requires_grad_(requires_grad)
    label = (f"T={t} H={h} I={inter} E={e} k={k} B={block_size} {str(dtype).replace('torch.', '')} "
             f"{activation}")
    return Sample(tuple(tensors), dict(activation=activation), label)


def _samples(dtype, requires_grad):
    return [
        make_sample(13, 32, 16, 4, 2, 8, dtype, requires_grad),
        make_sample(20, 64, 48, 3, 3, 16, dtype, requires_grad, activation="gelu", seed=1),
        make_sample(9, 40, 24, 5, 1, 4, dtype, requires_grad, activation="gelu_tanh", seed=2),
    ]


def _report_samples():
    bf16 = torch.bfloat16
    return [
        make_sample(256, 512, 256, 8, 2, 128, bf16, True),
        make_sample(128, 1024, 512, 16, 4, 128, bf16, True, activation="gelu"),
    ]


SPEC = registry.register(OpSpec(
    name="moe_experts",
    naive=moe_experts_reference.naive,
    samples=_samples,
    report_samples=_report_samples,
    backward_name="moe_experts_backward",
    family="moe",
    launchers=(
        "nki_lib.moe.kernels.moe_experts_fwd.launch_moe_experts_fwd",
        "nki_lib.moe.kernels.moe_experts_bwd.launch_moe_experts_bwd",
    ),
    kernels=(
        "nki_lib.moe.kernels.moe_experts_fwd.moe_experts_fwd_kernel",
        "nki_lib.moe.kernels.moe_experts_bwd.moe_experts_bwd_kernel",
    ),
))
