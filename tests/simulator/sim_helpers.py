"""Helpers for the simulator tests: run a tile body as an NKI kernel, check rule errors.

``run_tiles(body, *arrays)`` wraps ``body`` in an NKI kernel written the usual way: every HBM
input is DMA'd into an SBUF tile of the same shape and dtype, ``body(*tiles)`` issues the
instructions under test and returns one SBUF tile or a tuple of them, and each returned tile is
DMA'd into a fresh ``shared_hbm`` output. The kernel is run with ``simulate``.
"""

import inspect
import os

import ml_dtypes
import numpy as np

from nki_lib.simulator import NKIRuleError, jit, simulate
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3)
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
FP32 = np.dtype(np.float32)
FP16 = np.dtype(np.float16)

# every float dtype NKI stores, as NumPy dtypes (ml_dtypes for the narrow ones)
FLOAT_DTYPES = (FP32, BF16, FP16, FP8_E4M3, FP8_E5M2)
INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32))


def make_tile_kernel(body):
    """An NKI kernel: inputs HBM -> SBUF tiles, ``body(*tiles)``, returned tiles -> shared_hbm."""

    def kernel(*inputs):
        tiles = []
        for x in inputs:
            x_sb = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb, src=x)
            tiles.append(x_sb)
        results = body(*tiles)
        single = not isinstance(results, tuple)
        outs = []
        for res_sb in (results,) if single else results:
            res_hbm = nl.ndarray(res_sb.shape, dtype=res_sb.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=res_hbm, src=res_sb)
            outs.append(res_hbm)
        return outs[0] if single else tuple(outs)

    kernel.__name__ = kernel.__qualname__ = body.__name__
    return jit(kernel)


def run_tiles(body, *arrays):
    """Simulate ``make_tile_kernel(body)`` on NumPy ``arrays``; returns NumPy result(s)."""
    return simulate(make_tile_kernel(body))(*arrays)


def line_of(func, marker):
    """``(basename, line)`` of the first source line of ``func`` containing ``marker``."""
    lines, start = inspect.getsourcelines(func)
    for offset, text in enumerate(lines):
        if marker in text:
            return os.path.basename(inspect.getsourcefile(func)), start + offset
    raise AssertionError(f"marker {marker!r} not in {func.__name__}")


def check_rule_error(err, func, marker, instruction=None, operand=None, rule_words=()):
    """Assert that ``err`` is an NKIRuleError raised for the line of ``func`` marked ``marker``.

    The error must name the instruction, the operand, the rule and the source line, both as
    attributes and in its message.
    """
    assert isinstance(err, NKIRuleError), f"expected NKIRuleError, got {type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    basename, line = line_of(func, marker)
    file_part, _, line_part = err.source.rpartition(":")
    assert os.path.basename(file_part) == basename and int(line_part) == line, (
        f"source {err.source!r} != {basename}:{line}"
    )
    if instruction is not None:
        assert err.instruction == instruction, err.instruction
    if operand is not None:
        assert err.operand == operand, err.operand
    assert err.instruction and err.operand and err.rule
    message = str(err)
    for part in (err.instruction, err.operand, err.rule, f"{basename}:{line}"):
        assert part in message, f"{part!r} missing from message {message!r}"
    text = (err.rule + " " + message).lower()
    for word in rule_words:
        assert word.lower() in text, f"rule text lacks {word!r}: {message!r}"


def bits(x):
    """Raw bit pattern of an array (to compare floats bit-exactly, NaNs included)."""
    x = np.ascontiguousarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))
