"""Fixtures for the external-kernel audit (tests/simulator/external/**).

Each ``kernels_*.py`` module in this folder holds NKI kernels published by others (AWS NKI
tutorials, the AWS NKI Library), re-typed with the same structure and the same ``nki`` calls.
The modules do ``import nki`` at import time, so they are loaded only after the simulator has
been installed as ``nki`` (the ``nki_modules`` fixture of ``tests/simulator/conftest.py``
installs it and removes the aliases after the test).
"""

import importlib.util
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.fixture
def load_kernels(nki_modules):
    """``load_kernels("kernels_x")`` imports ``kernels_x.py`` with ``nki`` aliased to the simulator."""

    def load(stem):
        spec = importlib.util.spec_from_file_location(f"sim_external_{stem}", HERE / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # runs the module's own `import nki` lines
        return module

    return load
