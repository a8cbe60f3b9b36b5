"""Shared pytest setup: hypothesis profiles, a deterministic seed per test, backend isolation."""

import os

# Before NumPy loads: the simulator's tile-sized products gain nothing from BLAS threads, and on a
# 2-core machine the threads thrash (x70 slower nc_matmul measured under load).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_and_isolate():
    """Every test starts from the same RNG state, the auto backend and non-strict mode."""
    import nki_lib

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    previous_backend, previous_strict = nki_lib.get_backend(), nki_lib.is_strict()
    yield
    nki_lib.set_backend(previous_backend)
    nki_lib.set_strict(previous_strict)


def _trainium_present() -> bool:
    """The real stack: torch_neuronx (PrivateUse1 named neuron) and a real, working nki."""
    import importlib.util

    from nki_lib._nki import real_nki_usable

    return importlib.util.find_spec("torch_neuronx") is not None and real_nki_usable()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``device`` need a Trainium host with the Neuron stack; skip them elsewhere."""
    device_items = [item for item in items if item.get_closest_marker("device") is not None]
    if device_items and not _trainium_present():
        skip = pytest.mark.skip(reason="needs a Trainium host (torch_neuronx and the real nki package)")
        for item in device_items:
            item.add_marker(skip)
