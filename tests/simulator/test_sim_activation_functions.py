"""Scalar-engine activation functions (docs/nki-semantics.md §7.3) against fp64 references of the formulas
in the spec, judged with ``nki_lib.numerics`` parity (baseline: the same formula in fp32 torch).
Each function runs as ``activation(op, data=PSUM tile, scale, bias)`` (the PSUM-eviction idiom),
inputs kept inside the function's valid hardware range.
"""

import math

import numpy as np
import pytest
import torch
from sim_helpers import run_tiles

from nki_lib.numerics import assert_parity
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

P, F = 64, 48
SCALE, BIAS = 0.75, 0.125
GELU_SIGMOID_K = 1.702
GELU_TANH_K = 0.044715


def _sig(x):
    return torch.sigmoid(x)


# name -> (reference formula on a torch tensor of any float dtype, (low, high) of the input x)
FUNCS = {
    "copy": (lambda x: x, (-4, 4)),
    "exp": (torch.exp, (-8, 8)),
    "sigmoid": (_sig, (-8, 8)),
    "tanh": (torch.tanh, (-4, 4)),
    "silu": (lambda x: x * _sig(x), (-6, 6)),
    "silu_dx": (lambda x: _sig(x) * (1 + x * (1 - _sig(x))), (-6, 6)),
    "gelu": (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), (-5, 5)),
    "gelu_dx": (lambda x: 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi),
                (-5, 5)),
    "gelu_apprx_tanh": (lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + GELU_TANH_K * x ** 3))),
                        (-5, 5)),
    "gelu_apprx_sigmoid": (lambda x: x * _sig(GELU_SIGMOID_K * x), (-5, 5)),
    "gelu_apprx_sigmoid_dx": (lambda x: _sig(GELU_SIGMOID_K * x)
                              + GELU_SIGMOID_K * x * _sig(GELU_SIGMOID_K * x) * (1 - _sig(GELU_SIGMOID_K * x)), (-5, 5)),
    "softplus": (torch.nn.functional.softplus, (-8, 8)),
    "mish": (lambda x: x * torch.tanh(torch.nn.functional.softplus(x)), (-5, 5)),
    "erf": (torch.erf, (-3, 3)),
    "erf_dx": (lambda x: 2 / math.sqrt(math.pi) * torch.exp(-x * x), (-3, 3)),
    "log": (torch.log, (0.01, 100)),
    "sqrt": (torch.sqrt, (0.01, 100)),
    "rsqrt": (torch.rsqrt, (0.01, 100)),
    "reciprocal": (torch.reciprocal, (0.1, 10)),
    "arctan": (torch.atan, (-1.5, 1.5)),
    "sin": (torch.sin, (-3.0, 3.0)),
    "square": (torch.square, (-4, 4)),
    "abs": (torch.abs, (-4, 4)),
    "relu": (torch.relu, (-4, 4)),
    "sign": (torch.sign, (-4, 4)),
}


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_activation_function(rng, name):
    formula, (lo, hi) = FUNCS[name]
    # choose data so that the function's argument x = data * SCALE + BIAS covers [lo, hi]
    arg = rng.uniform(lo, hi, size=(P, F))
    data = ((arg - BIAS) / SCALE).astype(np.float32)

    def act(data_sb):
        data_psum = nl.ndarray(data_sb.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=data_psum, src=data_sb)
        y_sb = nl.ndarray(data_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=getattr(nl, name), data=data_psum, scale=SCALE, bias=BIAS)
        return y_sb

    out = torch.from_numpy(run_tiles(act, data))
    x64 = torch.from_numpy(data).double() * SCALE + BIAS
    x32 = torch.from_numpy(data) * np.float32(SCALE) + np.float32(BIAS)
    assert_parity(out, formula(x64), formula(x32), kind="output", dtype=torch.float32, name=name)
