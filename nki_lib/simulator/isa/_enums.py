"""Enum parameters given by value: ``dma_copy(..., dge_mode=3)`` means ``dge_mode.none``.

NKI's enums carry the values of the ``nki`` 0.3+ API (``constants.py``) and the API accepts either
the member or its value. ``accept_enum_values`` wraps a public instruction so that every parameter
of an enum type (known by name, or by an enum member as its default) converts a value to the
member before the instruction runs; a value that is no member is passed on unchanged, so the
instruction's own check rejects it with the usual rule error naming the operand.
"""

from __future__ import annotations

import functools
import inspect
from enum import Enum

import numpy as np

from .constants import dge_mode, dma_engine, engine, matmul_perf_mode, oob_mode, reduce_cmd

__all__ = ["accept_enum_values", "enum_member"]

_BY_NAME = {"engine": engine, "dge_mode": dge_mode, "oob_mode": oob_mode, "reduce_cmd": reduce_cmd,
            "perf_mode": matmul_perf_mode, "dma_engine": dma_engine}


def enum_member(cls, value):
    """``value`` as a member of ``cls`` when it is one of the members' values, else ``value``."""
    if isinstance(value, (Enum, bool, np.bool_)):
        return value
    if isinstance(value, (int, np.integer, str)):
        try:
            return cls(int(value) if isinstance(value, np.integer) else value)
        except ValueError:
            return value
    return value


def _enum_params(fn) -> dict:
    params = {}
    for name, param in inspect.signature(fn).parameters.items():
        cls = _BY_NAME.get(name)
        if cls is None and isinstance(param.default, Enum):
            cls = type(param.default)
        if cls is not None:
            params[name] = cls
    return params


def accept_enum_values(fn):
    """``fn`` with its enum parameters accepting values (see the module docstring)."""
    params = _enum_params(fn)
    if not params:
        return fn
    names = list(inspect.signature(fn).parameters)
    positions = [(names.index(n), cls) for n, cls in params.items()]
    first = min(i for i, _ in positions)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if len(args) > first:
            args = list(args)
            for i, cls in positions:
                if i < len(args):
                    args[i] = enum_member(cls, args[i])
        for name in params.keys() & kwargs.keys():
            kwargs[name] = enum_member(params[name], kwargs[name])
        return fn(*args, **kwargs)

    return call
