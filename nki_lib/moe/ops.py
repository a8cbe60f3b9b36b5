"""Registers every MoE op: ``import nki_lib.moe`` (or this module) makes ``torch.ops.nki.moe_*`` exist.

* ``moe_router`` / ``moe_router_backward`` (``router_ops``),
* ``moe_plan`` (``plan``),
* ``moe_experts`` and its backward (``experts_ops``).
"""

from nki_lib.moe import experts_ops, plan, router_ops  # noqa: F401  (registration side effects)
