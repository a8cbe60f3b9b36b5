"""Rooflines, MFU and the constants table."""

import pytest
from profile_tracegen import Trace, new_id, onchip

from nki_lib.simulator.profile import TARGETS, ElementWork, OpCost, estimate, params, roofline
from nki_lib.simulator.profile.roofline import element_time_ns

LANES = params("trn2").lanes


def test_every_constant_has_a_source_and_confidence():
    for target, table in TARGETS.items():
        for name, param in table.items():
            assert param.source and param.unit, (target, name)
            assert param.confidence in ("H", "M", "L"), (target, name)
    assert set(TARGETS["trn2"]) == set(TARGETS["trn3"])


def test_peaks_per_core():
    hw2, hw3 = params("trn2"), params("trn3")
    assert hw2.pe_peak_flops("bfloat16") == 2 * 128 * 128 * hw2.f_pe
    assert hw2.pe_peak_flops("float32") == hw2.pe_peak_flops("bfloat16") / hw2.pe_fp32_factor
    assert hw2.dma_bandwidth() == min(hw2.dma_engines * hw2.dma_bw_per_engine, hw2.hbm_bw_share)
    assert hw3.dma_bandwidth() == hw3.dma_engines * hw3.dma_bw_per_engine  # trn3: DMA-capped (§1.3)
    with pytest.raises(ValueError, match="dtype"):
        hw2.pe_peak_flops("mx")
    with pytest.raises(ValueError, match="target"):
        params("trn1")


def test_classical_roofline_terms():
    cost = OpCost(flops=1e12, hbm_bytes=1e9)
    hw = params("trn2")
    roof = roofline(cost, "trn2")
    assert roof.pe_ns == pytest.approx(1e12 / hw.pe_peak_flops("bfloat16") * 1e9)
    assert roof.hbm_ns == pytest.approx(1e9 / hw.dma_bandwidth())
    assert roof.classical_ns == max(roof.pe_ns, roof.hbm_ns)
    two = roofline(cost, "trn2", cores=2)
    assert two.classical_ns == pytest.approx(roof.classical_ns / 2)


def test_exp_on_trn2_is_scalar_only_and_trn3_shares_it():
    elems = 1e9
    work = (ElementWork(elems, ("scalar", "vector"), "exp"),)
    hw2, hw3 = params("trn2"), params("trn3")
    act2 = elems / (LANES * hw2.act_width * hw2.f_act) * 1e9
    assert element_time_ns(work, hw2) == pytest.approx(act2)
    r_act = LANES * hw3.act_width * hw3.f_act
    r_dve = LANES * hw3.dve_exponential_width * hw3.f_dve
    assert element_time_ns(work, hw3) == pytest.approx(elems / (r_act + r_dve) * 1e9)
    with pytest.raises(ValueError, match="cannot run"):
        element_time_ns((ElementWork(elems, ("vector",), "exp"),), hw2)


def test_balanced_split_between_scalar_and_vector():
    hw = params("trn2")
    fixed_act = ElementWork(1e9, ("scalar",), "exp")
    flexible = ElementWork(1e9, ("scalar", "vector"), "psum_fp32")
    r_act, r_dve = LANES * hw.act_width * hw.f_act, LANES * hw.dve_width_psum_fp32 * hw.f_dve
    # ScalarE has 1e9 fixed elements; the flexible ones split so both engines end together.
    t = element_time_ns((fixed_act, flexible), hw) * 1e-9
    on_act = (t - 1e9 / r_act) * r_act
    assert (1e9 - on_act) / r_dve == pytest.approx(t)
    assert OpCost(0, 0, work=(fixed_act, flexible)).min_scalar_elems == 1e9


def test_estimate_fractions_and_mfu():
    t = Trace()
    for _ in range(32):
        t.matmul(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 512)),
                 onchip(new_id(), "psum", (128, 512), "float32"))
    est = estimate(t.entries, "trn2")
    flops = 32 * 2 * 128 * 128 * 512
    cost = OpCost(flops=flops, hbm_bytes=0)
    assert est.mfu(cost) == pytest.approx(flops / (params("trn2").pe_peak_flops() * est.time_ns * 1e-9))
    assert est.roofline_fraction(cost) == pytest.approx(est.roofline(cost).pe_ns / est.time_ns)
    assert 0 < est.mfu(cost) < 1
    assert est.tflops(cost) == pytest.approx(flops / est.time_ns * 1e-3)
    assert est.engine_roofline_fraction(cost) == pytest.approx(est.roofline_fraction(cost))


def test_element_work_validation():
    with pytest.raises(ValueError, match="kind"):
        ElementWork(1.0, ("scalar",), "tanh")
    with pytest.raises(ValueError, match="engines"):
        ElementWork(1.0, ("tensor",), "exp")
    with pytest.raises(ValueError, match="cores"):
        roofline(OpCost(1, 1), "trn2", cores=0)


def test_calibrated_constants_replace_with_a_source():
    from nki_lib.simulator.profile import Param

    hw = params("trn2")
    faster = hw.replace(dma_latency_ns=Param(650.0, "ns", "hypothetical probe for this test", "L"))
    assert faster.dma_latency_ns == 650.0 and hw.dma_latency_ns == params("trn2").dma_latency_ns
    with pytest.raises(TypeError, match="Param"):
        hw.replace(dma_latency_ns=650.0)
    with pytest.raises(ValueError, match="constant"):
        hw.replace(nope=Param(1, "x", "s", "L"))
    t = Trace()
    from profile_tracegen import hbm

    t.dma(hbm(new_id(), (128, 512)), onchip(new_id(), "sbuf", (128, 512)))
    assert estimate(t.entries, faster).time_ns == pytest.approx(
        estimate(t.entries, "trn2").time_ns - (hw.dma_latency_ns - 650.0))
    assert estimate(t.entries, faster).target == "trn2"
