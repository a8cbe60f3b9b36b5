"""The worked example of docs/cost-model.md §7.7: one forward-attention step on trn2.

128 queries x 512 keys, d = 128, bf16, non-causal. The doc derives TensorE 1,536 cycles
(= 640 ns: S = QK^T with N = 512, four 128x128 transposes of P, four PV matmuls), ScalarE
exp with sum-accumulate over 512 fp32 PSUM values (512 + 64 cycles = 480 ns) and VectorE
row max over 512 fp32 in PSUM (533 ns) plus the bf16 PSUM eviction of P^T (267 ns).
"""

import pytest
from profile_tracegen import Trace, new_id, onchip

from nki_lib.simulator.profile import instruction_cost, params

HW = params("trn2")


def _service(entry):
    return instruction_cost(entry, HW).service_ns


def test_attention_step_engine_times_match_the_doc():
    t = Trace()
    q_t, k_t = onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 512))
    s_psum = onchip(new_id(), "psum", (128, 512), "float32")
    pe = [t.matmul(q_t, k_t, s_psum)]
    p_sb = new_id()
    pt_psum = new_id()
    for j in range(4):
        pe.append(t.add("tensor", "nc_transpose", [onchip(p_sb, "sbuf", (128, 128), b0=256 * j)],
                        [onchip(pt_psum, "psum", (128, 128), b0=256 * j)], (128, 128), "bfloat16"))
    o_psum = onchip(new_id(), "psum", (128, 128), "float32")
    for j in range(4):
        pe.append(t.matmul(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 128)), o_psum))
    exp = t.activation(s_psum, onchip(p_sb, "sbuf", (128, 512)), func="exp", reduce=True)
    row_max = t.add("vector", "tensor_reduce", [s_psum], [onchip(new_id(), "sbuf", (128, 1), "float32")],
                    (128, 1), "float32", {"op": "maximum"})
    evict = t.vector("tensor_copy", [onchip(pt_psum, "psum", (128, 512))], onchip(new_id(), "sbuf", (128, 512)))

    assert sum(_service(e) for e in pe) == pytest.approx(1536 / HW.f_pe * 1e9)      # 640 ns
    assert _service(exp) == pytest.approx((512 + 64) / HW.f_act * 1e9)             # 480 ns
    assert _service(row_max) == pytest.approx(512 / HW.f_dve * 1e9)                 # 533 ns
    assert _service(evict) == pytest.approx(512 / 2 / HW.f_dve * 1e9)               # 267 ns
