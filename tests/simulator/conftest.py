"""Fixtures shared by the simulator tests (tests/simulator/**).

* ``nki_modules``: installs the simulator as ``sys.modules["nki"]`` (and ``nki.language``,
  ``nki.isa``, ``nki.isa.constants``) for one test and removes the aliases afterwards, so that
  kernels written with ``import nki; import nki.language as nl; import nki.isa as nisa`` run.
* ``target``: runs a test under an explicit hardware target and restores the previous one.
* ``rng``: a seeded NumPy generator (the autouse seed fixture of tests/conftest.py seeds the
  global state; this one is local and explicit).
"""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from nki_lib import simulator as sim


@pytest.fixture
def nki_modules():
    """Alias ``nki``/``nki.language``/``nki.isa`` to the simulator; yield ``(nki, nl, nisa)``."""
    saved = {name: sys.modules.get(name) for name in ("nki", "nki.language", "nki.isa", "nki.isa.constants")}
    sim.install_as_nki()
    try:
        import nki  # noqa: PLC0415 - must follow install_as_nki()
        import nki.isa as nisa  # noqa: PLC0415
        import nki.language as nl  # noqa: PLC0415

        yield nki, nl, nisa
    finally:
        sim.uninstall_nki()
        for name, module in saved.items():
            if module is not None:
                sys.modules[name] = module


@pytest.fixture
def nki_style_kernels(nki_modules):
    """The module ``tests/simulator/nki_style_kernels.py`` imported with ``nki`` aliased."""
    path = pathlib.Path(__file__).with_name("nki_style_kernels.py")
    spec = importlib.util.spec_from_file_location("sim_nki_style_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs the module's own `import nki` lines
    yield module


@pytest.fixture
def rng():
    return np.random.default_rng(20261130)


@pytest.fixture(params=["trn2", "trn3"])
def any_target(request):
    previous = sim.get_target()
    sim.set_target(request.param)
    yield request.param
    sim.set_target(previous)


@pytest.fixture
def trn2():
    previous = sim.get_target()
    sim.set_target("trn2")
    yield "trn2"
    sim.set_target(previous)


@pytest.fixture
def trn3():
    previous = sim.get_target()
    sim.set_target("trn3")
    yield "trn3"
    sim.set_target(previous)
