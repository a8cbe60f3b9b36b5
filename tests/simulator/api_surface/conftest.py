"""Fixtures for tests/simulator/api_surface/**.

The ``kernels_*.py`` modules of this folder are NKI kernels written for this project in the
public ``nki`` style (``import nki``, ``import nki.language as nl``, ``import nki.isa as nisa``).
They import ``nki`` at module level, so a test loads one through ``kernel_module`` only after the
``nki_modules`` fixture (tests/simulator/conftest.py) has aliased ``nki`` to the simulator; the
alias is removed again when the test ends.
"""

import importlib.util
import pathlib

import pytest

FOLDER = pathlib.Path(__file__).parent


@pytest.fixture
def kernel_module(nki_modules):
    """``kernel_module("gemm")`` imports ``kernels_gemm.py`` with ``nki`` resolving to the simulator."""

    def load(topic):
        path = FOLDER / f"kernels_{topic}.py"
        spec = importlib.util.spec_from_file_location(f"api_surface_kernels_{topic}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
