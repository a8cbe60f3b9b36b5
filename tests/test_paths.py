"""Paths, fallback, strict mode, the coverage ledger and the float64 rule (docs/contract.md §2)."""

import os
import subprocess
import sys

import pytest
import torch

import nki_lib
from nki_lib.dispatch import NKIFallbackError, Unsupported, dispatch


@pytest.fixture(autouse=True)
def _clean_ledger():
    nki_lib.reset_coverage()
    yield
    nki_lib.reset_coverage()


def _qkv(dtype=torch.float32):
    return [torch.randn(1, 2, 5, 4, dtype=dtype) for _ in range(3)]


def test_auto_on_cpu_is_reference():
    assert nki_lib.get_backend() == "auto"
    torch.ops.nki.flash_attention(*_qkv())
    cov = nki_lib.coverage()
    assert cov["flash_attention"]["reference"].calls == 1
    assert set(cov["flash_attention"]) == {"reference"}


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend"):
        nki_lib.set_backend("gpu")
    with pytest.raises(TypeError, match="backend"):
        nki_lib.set_backend(3)


def test_use_backend_restores():
    with nki_lib.use_backend("reference"):
        assert nki_lib.get_backend() == "reference"
        with nki_lib.use_backend("simulator"):
            assert nki_lib.get_backend() == "simulator"
        assert nki_lib.get_backend() == "reference"
    assert nki_lib.get_backend() == "auto"


def test_float64_falls_back_and_is_recorded():
    q, k, v = _qkv(torch.float64)
    with nki_lib.use_backend("simulator"):
        out, lse = torch.ops.nki.flash_attention(q, k, v)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    stats = nki_lib.coverage()["flash_attention"]
    assert stats["simulator"].fallbacks == {"float64": 1}
    assert stats["simulator"].calls == 0
    assert stats["reference"].calls == 1
    assert "float64" in str(nki_lib.coverage())


def test_float64_is_an_error_in_strict_mode():
    with nki_lib.use_backend("simulator"), nki_lib.strict(), pytest.raises(NKIFallbackError, match="float64"):
        torch.ops.nki.flash_attention(*_qkv(torch.float64))


def test_unsupported_reason_is_recorded_and_strict_raises():
    x = torch.ones(3)

    def launch():
        raise Unsupported("D > 999 is not tiled")

    with nki_lib.use_backend("simulator"):
        out = dispatch("toy", [x], launch=launch, reference=lambda: x + 1)
    assert torch.equal(out, x + 1)
    assert nki_lib.coverage()["toy"]["simulator"].fallbacks == {"D > 999 is not tiled": 1}
    nki_lib.set_strict(True)
    try:
        with nki_lib.use_backend("simulator"), pytest.raises(NKIFallbackError, match="D > 999"):
            dispatch("toy", [x], launch=launch, reference=lambda: x + 1)
    finally:
        nki_lib.set_strict(False)


def test_device_path_without_device_falls_back_visibly():
    with nki_lib.use_backend("device"):
        torch.ops.nki.flash_attention(*_qkv())
    reasons = nki_lib.coverage()["flash_attention"]["device"].fallbacks
    assert list(reasons) == ["device: the real nki package is not available"]


def test_coverage_table_and_reset():
    torch.ops.nki.flash_attention(*_qkv())
    text = str(nki_lib.coverage())
    assert "flash_attention" in text and "reference" in text
    nki_lib.reset_coverage()
    assert nki_lib.coverage() == {}
    assert "no nki op" in str(nki_lib.coverage())


@pytest.mark.parametrize("env,expected", [({"NKI_LIB_BACKEND": "reference"}, "reference"),
                                          ({"NKI_LIB_STRICT": "1"}, "auto strict")])
def test_environment_variables(env, expected):
    code = ("import nki_lib; print(nki_lib.get_backend() + (' strict' if nki_lib.is_strict() else ''))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == expected


def test_bad_environment_backend_is_rejected():
    proc = subprocess.run([sys.executable, "-c", "import nki_lib"], capture_output=True, text=True,
                          env={**os.environ, "NKI_LIB_BACKEND": "tpu"})
    assert proc.returncode != 0 and "backend must be one of" in proc.stderr


def test_kernel_import_module_selects_simulator_without_real_nki():
    from nki_lib import _nki, simulator

    assert not _nki.USING_REAL_NKI
    assert _nki.nki is simulator and _nki.nl is simulator.language and _nki.nisa is simulator.isa


def test_autocast_region_computes_like_the_cast_inputs():
    """SDPA's autocast policy (docs/contract.md): inside a bf16 region the op sees bf16 inputs and
    runs with autocast off, so its math is exactly that of the op on the cast inputs."""
    q, k, v = _qkv()
    out_bf16, lse_bf16 = torch.ops.nki.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ac, lse_ac = torch.ops.nki.flash_attention(q, k, v)
    assert out_ac.dtype == torch.bfloat16 and lse_ac.dtype == torch.float32
    assert torch.equal(out_ac, out_bf16) and torch.equal(lse_ac, lse_bf16)
