"""NKI kernels of the MoE ops: ``moe_router_fwd`` / ``moe_router_bwd`` (+ ``moe_router_steps``),
``moe_plan_fwd``, ``moe_experts_fwd`` / ``moe_experts_bwd`` (+ ``moe_experts_steps``,
``moe_experts_budget``, ``moe_experts_groups``).

Kernels import NKI only through ``nki_lib._nki``; a launcher raises ``nki_lib.dispatch.Unsupported``
for what its kernel cannot serve and otherwise returns a ``nki_lib.dispatch.KernelLaunch``.
"""
