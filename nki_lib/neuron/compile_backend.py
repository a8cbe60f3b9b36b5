"""``torch.compile(backend="neuron")`` under emulation: a stand-in for TorchNeuron's dynamo backend.

It requires what the real backend requires of a graph before it lowers it to StableHLO
(docs/neuron.md §1): static shapes (the real backend forces ``dynamic=False``),
and no opaque ``nki::`` op node with a neuron input (a node the lowering cannot express: the op
bodies must have been traced into kernel calls). It checks the forward and backward graphs
AOTAutograd produces and then runs them as they are (aten ops on the emulated device, kernel-call
nodes on the simulator). Registered only by ``emulate_neuron()``; it is no model of the real
compiler's fusion or NEFF compilation.
"""

from __future__ import annotations

import torch

BACKEND = "neuron"


class NeuronCompileError(RuntimeError):
    """A graph the neuron compile backend would reject."""


def _vals(node):
    return [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def _input_vals(node):
    return [v for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, torch.fx.Node) for v in _vals(a)]


def check_graph(gm: torch.fx.GraphModule, which: str) -> None:
    """Raise :class:`NeuronCompileError` unless the graph is one the neuron backend accepts."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for v in _vals(node):
                if any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
                    raise NeuronCompileError(f"neuron backend ({which} graph): input {node.name} has a symbolic "
                                             f"shape {tuple(v.shape)}; Neuron compiles static shapes only")
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target.namespace == "nki" and any(v.device.type == "neuron" for v in _input_vals(node)):
            raise NeuronCompileError(f"neuron backend ({which} graph): opaque op node {target} with neuron "
                                     "inputs; its body must be traced into kernel calls")


def _compiler(which):
    def compile_graph(gm, example_inputs):
        from torch._functorch.aot_autograd import make_boxed_func

        check_graph(gm, which)
        return make_boxed_func(gm.forward)

    return compile_graph


def neuron_backend(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd

    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt):
            raise NeuronCompileError(f"neuron backend: graph input {i} is a symbolic size; Neuron compiles "
                                     "static shapes only (compile with dynamic=False)")
    return aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                        keep_inference_input_mutations=True)(gm, example_inputs)


def register() -> None:
    """Register the stand-in as dynamo backend ``neuron`` (once; only under emulation)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND not in _COMPILER_FNS:
        register_backend(neuron_backend, name=BACKEND)
