"""Tensor-add kernels from the AWS NKI docs, re-typed.

Sources (Copyright Amazon.com, Apache-2.0; re-typed by hand with the same structure and calls,
not copied verbatim; comments are ours):
* ``add_kernel``: aws-neuron/aws-neuron-sdk, nki/examples/simulate/nki_simulate_example.py
  (the ``nki.simulate`` quick start: 0.3+ ``nl.load``/``nl.add``/``nl.store`` wrappers).
* ``nki_tensor_add_kernel``: the example in the docstring of ``nki.jit`` in
  aws-neuron/aws-neuron-sdk, nki/api/nki/__init__.py (``@nki.jit()``, ``nisa.tensor_tensor``).
  It returns an ``nl.hbm`` tensor, which NKI 0.3+ rejects (nki-api.md §2.2: returned tensors
  must be ``nl.shared_hbm``); the simulator must reject it too.

Shapes: a, b, out [P, F] with P <= nl.tile_size.pmax (no tiling).
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def add_kernel(a_ptr, b_ptr):
    """``out = a + b`` with the convenience wrappers."""
    a = nl.load(a_ptr)
    b = nl.load(b_ptr)
    result = nl.add(a, b)
    out = nl.ndarray(a_ptr.shape, dtype=a_ptr.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


@nki.jit()
def nki_tensor_add_kernel(a_input, b_input):
    """``c = a + b`` with ISA calls; returns an ``nl.hbm`` tensor (rejected since NKI 0.3)."""
    assert a_input.shape == b_input.shape
    assert a_input.shape[0] <= nl.tile_size.pmax

    a_tile = nl.ndarray(dtype=a_input.dtype, shape=a_input.shape, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_tile, src=a_input)
    b_tile = nl.ndarray(dtype=b_input.dtype, shape=b_input.shape, buffer=nl.sbuf)
    nisa.dma_copy(dst=b_tile, src=b_input)

    c_tile = nl.ndarray(dtype=a_input.dtype, shape=a_input.shape, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=c_tile, data1=a_tile, data2=b_tile, op=nl.add)

    c_output = nl.ndarray(dtype=a_input.dtype, shape=a_input.shape, buffer=nl.hbm)
    nisa.dma_copy(dst=c_output, src=c_tile)
    return c_output
