"""``torch.ops.nki.moe_plan``: integer routing metadata with static shapes (docs/contract.md §4.2).

moe_plan(topk_ids, *, num_experts, block_size)
    -> (block_expert (NB,) int32, slot_assignment (NB * block_size,) int32, tokens_per_expert (E,) int32)

N = T * k assignments (assignment ``a = t * k + j`` for ``topk_ids[t, j]``),
NB = ceil(N / block_size) + E - 1. Each expert owns consecutive blocks, experts ascending, its
assignments ascending within; unused blocks (expert -1) sit at the end, padding slots are -1.

Paths: the NKI kernel ``kernels/moe_plan_fwd.py`` on simulator/device (int32 ids, int64 ids
narrowed to int32 after the range check, E <= 512,
power-of-two block_size; otherwise a visible fallback), the PyTorch reference
(``moe_plan_reference.moe_plan``: stable sort, one-hot counts, cumsums; no ``.item()``, no data-dependent
shapes) on the reference path. The op is opaque to torch.compile, so it compiles without graph
breaks either way. The only data check (ids in [0, E)) runs in the real implementation, never in
the fake.
"""

from __future__ import annotations

import torch

from nki_lib import registry
from nki_lib.dispatch import dispatch
from nki_lib.moe import moe_plan_reference
from nki_lib.registry import OpSpec, Sample
from nki_lib.validation import has_values

ID_DTYPES = (torch.int32, torch.int64)


def validate(topk_ids, *, num_experts, block_size):
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must have rank 2 (T, k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids must have dtype in {[str(d) for d in ID_DTYPES]}, got {topk_ids.dtype}")
    for name, value in (("num_experts", num_experts), ("block_size", block_size)):
        if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def validate_ids_values(topk_ids, num_experts):
    """Data check (real tensors only): every id in [0, num_experts)."""
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, num_experts={num_experts}), got values in [{low}, {high}]")


def _shapes(topk_ids, num_experts, block_size):
    nb = moe_plan_reference.num_blocks(topk_ids.shape[0] * topk_ids.shape[1], num_experts, block_size)
    return (nb,), (nb * block_size,), (num_experts,)


@torch.library.custom_op("nki::moe_plan", mutates_args=())
def moe_plan_op(topk_ids: torch.Tensor, *, num_experts: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    validate(topk_ids, num_experts=num_experts, block_size=block_size)
    if has_values(topk_ids):
        validate_ids_values(topk_ids, num_experts)
    flags = dict(num_experts=num_experts, block_size=block_size)
    if topk_ids.numel() == 0:           # nothing routed: all blocks unused, all slots padding
        return moe_plan_reference.moe_plan(topk_ids, **flags)

    def launch():
        from nki_lib.moe.kernels import moe_plan_fwd
        # int64 ids narrow losslessly: validate_ids_values bounded them by num_experts
        return moe_plan_fwd.launch_moe_plan_fwd(topk_ids.to(torch.int32), **flags)

    outs = dispatch("moe_plan", (topk_ids,), launch=launch,
                    reference=lambda: moe_plan_reference.moe_plan(topk_ids, **flags))
    return tuple(o.contiguous() for o in outs)


@moe_plan_op.register_fake
def _(topk_ids, *, num_experts, block_size):
    validate(topk_ids, num_experts=num_experts, block_size=block_size)
    return tuple(topk_ids.new_empty(s, dtype=torch.int32) for s in _shapes(topk_ids, num_experts, block_size))


# --------------------------------------------------------------------------- registry entry

def make_sample(t, k, e, block_size, *, seed=0, one_expert=None) -> Sample:
    """Distinct random experts per token (as a router gives), or all on ``one_expert``."""
    gen = torch.Generator().manual_seed(seed)
    if one_expert is not None:
        ids = torch.full((t, k), one_expert, dtype=torch.int32)
    else:
        ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k].to(torch.int32)
    label = f"ids({t},{k}) E={e} block={block_size}" + (f" all->{one_expert}" if one_expert is not None else "")
    return Sample((ids,), dict(num_experts=e, block_size=block_size), label)


def _samples(dtype, requires_grad):
    """Integer op: ``dtype`` and ``requires_grad`` do not apply."""
    return [make_sample(13, 2, 4, 8), make_sample(5, 1, 8, 16), make_sample(40, 3, 6, 4, seed=1),
            make_sample(7, 2, 5, 4, one_expert=3)]


def _report_samples():
    return [make_sample(4096, 8, 256, 128), make_sample(4096, 2, 8, 512)]


SPEC = registry.register(OpSpec(
    name="moe_plan",
    naive=moe_plan_reference.moe_plan,
    samples=_samples,
    report_samples=_report_samples,
    differentiable=False,
    dtypes=(torch.int32,),
    family="moe",
    launchers=(
        "nki_lib.moe.kernels.moe_plan_fwd.launch_moe_plan_fwd",
    ),
    kernels=(
        "nki_lib.moe.kernels.moe_plan_fwd.moe_plan_fwd_kernel",
    ),
))
