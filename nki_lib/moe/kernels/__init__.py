"""NKI kernels of the MoE ops: ``moe_router_fwd`` / ``moe_router_bwd`` (+ ``moe_router_steps``),
``moe_plan_fwd``, ``moe_experts_fwd`` / ``moe_experts_bwd`` (+ ``moe_experts_steps``,
``moe_experts_host``, ``moe_experts_groups``, ``moe_experts_gate``, the forward's
``moe_experts_fwd_{dmas,proj,launch,combine}`` and the backward's
``moe_experts_bwd_{blocks,rows,grads,wgrads,accum,dx}``).

Kernels import NKI only through ``nki_lib._nki``; a launcher raises ``nki_lib.dispatch.Unsupported``
for what its kernel cannot serve and otherwise returns a ``nki_lib.dispatch.KernelLaunch``.
"""
