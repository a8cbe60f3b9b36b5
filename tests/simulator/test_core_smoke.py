"""Smoke tests of the simulator core (owned by the simulator author; sim-tests own the rest).

Covers the launch paths (LNC1/LNC2, torch in/out, in-place writeback), liveness and capacity
accounting, `.ap()` offset semantics, dtype views, NaN-filled fresh tiles, PSUM auto-accumulation,
trace/recording switches, targets and the nki module aliasing.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib.numerics import assert_parity
from nki_lib.simulator import NKIRuleError, get_target, jit, last_run, recording, set_target, simulate
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

BF16 = np.dtype(ml_dtypes.bfloat16)


@jit
def scaled_matmul(xT, w, scale):
    """docs/nki-semantics.md §16: K-tiled matmul with explicit accumulate flags, scaled bf16 eviction."""
    K, M = xT.shape
    _, N = w.shape
    out_hbm = nl.ndarray((M, N), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    acc_psum = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.psum)
    for k in range(K // nl.tile_size.pmax):
        x_sb = nl.ndarray((nl.tile_size.pmax, M), dtype=xT.dtype, buffer=nl.sbuf)
        w_sb = nl.ndarray((nl.tile_size.pmax, N), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=xT[k * nl.tile_size.pmax:(k + 1) * nl.tile_size.pmax, :])
        nisa.dma_copy(dst=w_sb, src=w[nl.ds(k * nl.tile_size.pmax, nl.tile_size.pmax), :])
        nisa.nc_matmul(dst=acc_psum, stationary=x_sb, moving=w_sb, accumulate=(k > 0))
    res_sb = nl.ndarray((M, N), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.activation(dst=res_sb, op=nl.copy, data=acc_psum, scale=float(scale))
    nisa.dma_copy(dst=out_hbm, src=res_sb)
    return out_hbm


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(BF16)


def test_spec_example_kernel_matches_fp64_reference():
    rng = np.random.default_rng(0)
    xT, w = _bf16(rng, (256, 64)), _bf16(rng, (256, 96))
    out = simulate(scaled_matmul)(xT, w, 0.5)
    x64, w64 = torch.from_numpy(xT.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    oracle = 0.5 * (x64.T @ w64)
    baseline = 0.5 * (x64.to(torch.bfloat16).T @ w64.to(torch.bfloat16))
    actual = torch.from_numpy(out.astype(np.float32))
    assert_parity(actual, oracle, baseline, kind="output", dtype=torch.bfloat16, name="scaled_matmul")
    report = last_run()
    assert report.kernel == "scaled_matmul" and report.grid == 1 and report.target == get_target()
    opcodes = [e.opcode for e in report.trace]
    assert opcodes.count("nc_matmul") == 2 and opcodes.count("dma_copy") == 5
    mm = [e for e in report.trace if e.opcode == "nc_matmul"]
    assert [e.attrs["accumulate"] for e in mm] == [False, True]
    assert mm[0].attrs["K"] == 128 and mm[0].shape == (64, 96) and mm[0].engine == "tensor"
    assert report.instructions == len(report.trace)


def test_recording_off_keeps_counts_and_peaks():
    rng = np.random.default_rng(1)
    xT, w = _bf16(rng, (128, 32)), _bf16(rng, (128, 32))
    with recording(False):
        simulate(scaled_matmul)(xT, w, 1.0)
    report = last_run()
    assert report.trace is None and report.instructions == 5
    assert report.peak_psum_banks == 1 and report.peak_sbuf_bytes >= 2 * 32 * 2


def test_torch_inputs_give_torch_outputs():
    rng = np.random.default_rng(2)
    xT, w = _bf16(rng, (128, 16)), _bf16(rng, (128, 8))
    out = simulate(scaled_matmul)(torch.from_numpy(xT.view(np.int16)).view(torch.bfloat16),
                                  torch.from_numpy(w.view(np.int16)).view(torch.bfloat16), 1.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.view(torch.int16).numpy().view(BF16), simulate(scaled_matmul)(xT, w, 1.0))


def test_lnc2_programs_split_a_shared_output_and_exchange_tiles():
    @jit
    def halves(x_hbm):
        rows = x_hbm.shape[0] // nl.num_programs(axes=0)
        pid = nl.program_id(0)
        out_hbm = nl.ndarray(x_hbm.shape, dtype=x_hbm.dtype, buffer=nl.shared_hbm)
        mine_sb = nl.ndarray((rows, x_hbm.shape[1]), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine_sb, src=x_hbm[nl.ds(pid * rows, rows), :])
        peer_sb = nl.ndarray((rows, x_hbm.shape[1]), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=mine_sb, dst=peer_sb, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        nisa.dma_copy(dst=out_hbm[nl.ds(pid * rows, rows), :], src=peer_sb)   # write the peer's rows
        nisa.core_barrier(out_hbm, (0, 1))
        return out_hbm

    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    out = simulate(halves[2])(x)
    np.testing.assert_array_equal(out, np.concatenate([x[4:], x[:4]]))
    report = last_run()
    assert report.grid == 2 and report.instructions == len(report.trace)
    for pid in (0, 1):
        entries = [e for e in report.trace if e.program_id == pid]
        assert [e.index for e in entries] == list(range(len(entries)))
        assert [e.opcode for e in entries] == ["dma_copy", "sendrecv", "dma_copy", "core_barrier"]
    np.testing.assert_array_equal(simulate(halves)[2](x), out)


def test_program_queries_without_and_with_grid():
    @jit
    def ids(x_hbm):
        out_hbm = nl.ndarray((1, 3), dtype=nl.int32, buffer=nl.shared_hbm)
        vals_sb = nl.ndarray((1, 3), dtype=nl.int32, buffer=nl.sbuf)
        for j, value in enumerate((nl.program_id(0), nl.num_programs(0), nl.program_ndim())):
            nisa.memset(dst=vals_sb[:, j], value=value)
        nisa.dma_copy(dst=out_hbm, src=vals_sb)
        return out_hbm

    x = np.zeros((1, 1), np.float32)
    assert simulate(ids)(x).tolist() == [[0, 1, 0]]
    assert simulate(ids[1])(x).tolist() == [[0, 1, 1]]


def test_in_place_hbm_argument_is_written_back():
    @jit
    def negate_in_place(x_hbm):
        x_sb = nl.ndarray(x_hbm.shape, dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        nisa.tensor_scalar(dst=x_sb, data=x_sb, op0=nl.multiply, operand0=-1.0)
        nisa.dma_copy(dst=x_hbm, src=x_sb)

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    strided = np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::2]
    expect = -strided.copy()
    assert simulate(negate_in_place)(x) is None
    np.testing.assert_array_equal(x, -np.arange(12, dtype=np.float32).reshape(3, 4))
    simulate(negate_in_place)(strided)
    np.testing.assert_array_equal(strided, expect)


def test_loop_local_tiles_are_freed_and_overflow_is_reported():
    usable = nl.tile_size.sbuf_fmax_bytes
    cols = usable // 4 // 3          # fp32 tile of a third of the usable SBUF

    @jit
    def loop(x_hbm):
        for _ in range(10):
            t_sb = nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t_sb, value=0.0)
        return x_hbm

    simulate(loop)(np.zeros((1, 1), np.float32))
    assert last_run().peak_sbuf_bytes == cols * 4     # each tile lives from its memset to its memset

    @jit
    def hoard(x_hbm):
        kept = []
        for _ in range(4):
            kept.append(nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf))
            nisa.memset(dst=kept[-1], value=0.0)
        for t_sb in kept:                             # all four still used here: live together
            nisa.tensor_copy(dst=t_sb, src=kept[0])
        return x_hbm

    with pytest.raises(NKIRuleError, match="SBUF capacity"):
        simulate(hoard)(np.zeros((1, 1), np.float32))


def test_psum_banks_are_counted():
    @jit
    def banks(x_hbm):
        live = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]
        extra = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum)
        for t_psum in live + [extra]:
            nisa.memset(dst=t_psum, value=0.0)
        for t_psum in live + [extra]:                 # all nine used again: live together
            nisa.memset(dst=t_psum, value=1.0)
        return x_hbm

    with pytest.raises(NKIRuleError, match="PSUM capacity"):
        simulate(banks)(np.zeros((1, 1), np.float32))


def test_ap_offset_absolute_or_inherited_and_dtype_views():
    @jit
    def views(x_hbm):
        x_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        out_hbm = nl.ndarray((3, 3, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        base = x_sb[1:3, 2:6]
        # offset=None inherits the view's start (1, 2); an explicit offset counts from the storage start
        nisa.dma_copy(dst=out_hbm[0], src=base.ap([[8, 3], [1, 2]]))
        nisa.dma_copy(dst=out_hbm[1], src=base.ap([[8, 3], [1, 2]], offset=0))
        # dtype view: each fp32 is two bf16 halves (little endian); read the high halves and widen
        hi_bf16 = x_sb.view(nl.bfloat16).ap([[16, 3], [2, 2]], offset=1)
        wide_sb = nl.ndarray((3, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wide_sb, src=hi_bf16)
        nisa.dma_copy(dst=out_hbm[2], src=wide_sb)
        return out_hbm

    x = (np.arange(32, dtype=np.float32) * 1.001).reshape(4, 8)
    out = simulate(views)(x)
    np.testing.assert_array_equal(out[0], x[1:4, 2:4])
    np.testing.assert_array_equal(out[1], x[0:3, 0:2])
    np.testing.assert_array_equal(out[2], (x[0:3, 0:2].view(np.uint32) & 0xFFFF0000).view(np.float32))


def test_fresh_tiles_read_nan_and_ints_read_four():
    @jit
    def fresh(x_hbm):
        f_sb = nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.sbuf)
        i_sb = nl.ndarray((2, 3), dtype=nl.int32, buffer=nl.sbuf)
        out_f = nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray((2, 3), dtype=nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_f, src=f_sb)
        nisa.dma_copy(dst=out_i, src=i_sb)
        return out_f, out_i

    out_f, out_i = simulate(fresh)(np.zeros((1, 1), np.float32))
    assert np.isnan(out_f).all() and (out_i == 4).all()


def test_auto_accumulate_resets_with_fresh_psum_and_non_matmul_writes():
    @jit
    def auto(s_hbm, m_hbm):
        s_sb = nl.ndarray(s_hbm.shape, dtype=s_hbm.dtype, buffer=nl.sbuf)
        m_sb = nl.ndarray(m_hbm.shape, dtype=m_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s_hbm)
        nisa.dma_copy(dst=m_sb, src=m_hbm)
        out_hbm = nl.ndarray((3, 4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        acc_psum = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc_psum, s_sb, m_sb)                       # overwrite
        nisa.nc_matmul(acc_psum, s_sb, m_sb)                       # accumulate
        res_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res_sb, src=acc_psum)
        nisa.dma_copy(dst=out_hbm[0], src=res_sb)
        nisa.memset(dst=acc_psum, value=0.0)                       # non-TensorE write: next matmul overwrites
        nisa.nc_matmul(acc_psum, s_sb, m_sb)
        nisa.tensor_copy(dst=res_sb, src=acc_psum)
        nisa.dma_copy(dst=out_hbm[1], src=res_sb)
        acc2_psum = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum)   # fresh group
        nisa.nc_matmul(acc2_psum, s_sb, m_sb)
        nisa.tensor_copy(dst=res_sb, src=acc2_psum)
        nisa.dma_copy(dst=out_hbm[2], src=res_sb)
        return out_hbm

    s = np.arange(8, dtype=np.float32).reshape(2, 4)
    m = np.ones((2, 8), dtype=np.float32)
    out = simulate(auto)(s, m)
    single = s.T @ m
    np.testing.assert_array_equal(out, np.stack([2 * single, single, single]))


def test_rule_error_names_instruction_operand_rule_and_line():
    @jit
    def bad(x_hbm):
        acc_psum = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=acc_psum, src=x_hbm)  # the offending line
        return x_hbm

    with pytest.raises(NKIRuleError) as info:
        simulate(bad)(np.zeros((4, 4), np.float32))
    err = info.value
    assert (err.instruction, err.operand) == ("dma_copy", "dst") and "PSUM" in err.rule
    assert err.source.startswith("test_core_smoke.py:") and err.source in str(err)


def test_targets_select_limits_and_version(monkeypatch):
    before = get_target()
    try:
        set_target("trn3")
        assert get_target() == "trn3" and nisa.get_nc_version() == nisa.nc_version.gen4
        set_target("gen3")
        assert nisa.get_nc_version() >= nisa.nc_version.gen3
    finally:
        set_target(before)
    with pytest.raises(ValueError):
        set_target("trn9")


def test_install_as_nki_aliases_modules():
    import sys

    from nki_lib import simulator

    simulator.install_as_nki()
    try:
        import nki
        import nki.isa as isa_mod
        import nki.language as nl_mod
        from nki.isa.constants import dge_mode, oob_mode

        assert nki.jit is jit and nl_mod is nl and isa_mod is nisa
        assert dge_mode.hwdge and oob_mode.skip and nl_mod.float32 == np.float32
    finally:
        simulator.uninstall_nki()
    assert "nki.language" not in sys.modules


def test_divergent_lnc_barrier_is_an_error_not_a_hang():
    @jit
    def divergent(x_hbm):
        if nl.program_id(0) == 0:
            nisa.core_barrier(x_hbm, (0, 1))  # only program 0 gets here
        return x_hbm

    with pytest.raises(NKIRuleError, match="same control flow"):
        simulate(divergent[2])(np.zeros((2, 2), np.float32))


def test_five_free_dims_are_rejected_on_compute_operands():
    @jit
    def deep(x_hbm):
        t_sb = nl.ndarray((2, 1, 1, 1, 1, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t_sb, value=0.0)
        return x_hbm

    with pytest.raises(NKIRuleError, match="at most 4"):
        simulate(deep)(np.zeros((2, 2), np.float32))


def test_rearrange_splits_permutes_and_merges():
    @jit
    def rearranged(x_hbm):
        x_sb = nl.ndarray((2, 12), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        out_hbm = nl.ndarray((2, 4, 3), dtype=nl.float32, buffer=nl.shared_hbm)
        view = x_sb.rearrange(("p", ("h", "w")), ("p", "w", "h"), {"h": 3})
        nisa.dma_copy(dst=out_hbm, src=view)
        return out_hbm

    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    np.testing.assert_array_equal(simulate(rearranged)(x), x.reshape(2, 3, 4).transpose(0, 2, 1))


def test_manual_placements_alias_physical_memory():
    @jit
    def aliased(x_hbm):
        a_sb = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 64))
        nisa.dma_copy(dst=a_sb, src=x_hbm)
        # same partitions, 16 bytes further: b's element (p, j) is a's element (p, j + 4)
        b_sb = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf, address=(0, 80))
        # one partition further down, as bf16: high halves of a's row p + 1
        c_sb = nl.ndarray((2, 16), dtype=nl.bfloat16, buffer=nl.sbuf, address=(1, 64))
        out_b = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        out_c = nl.ndarray((2, 16), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_b, src=b_sb)
        nisa.dma_copy(dst=out_c, src=c_sb)
        return out_b, out_c

    x = (np.arange(32, dtype=np.float32) * 1.25).reshape(4, 8)
    out_b, out_c = simulate(aliased)(x)
    np.testing.assert_array_equal(out_b, x[:, 4:])
    np.testing.assert_array_equal(out_c.view(np.uint16), x[1:3].view(np.uint16))
    assert last_run().peak_sbuf_bytes == 64 + 32


def test_var_and_rms_norm_wrappers_match_fp64():
    @jit
    def stats(x_hbm, w_hbm):
        x_sb = nl.load(x_hbm)
        w_sb = nl.load(w_hbm)
        out_var = nl.ndarray((x_hbm.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        out_rms = nl.ndarray(x_hbm.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out_var, nl.var(x_sb, axis=1))
        nl.store(out_rms, nl.rms_norm(x_sb, w_sb, axis=1, n=x_hbm.shape[1]))
        return out_var, out_rms

    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    w = rng.standard_normal((8, 32)).astype(np.float32)
    got_var, got_rms = simulate(stats)(x, w)
    x64, w64 = torch.from_numpy(x).double(), torch.from_numpy(w).double()
    x32, w32 = torch.from_numpy(x), torch.from_numpy(w)
    assert_parity(torch.from_numpy(got_var), x64.var(1, unbiased=False, keepdim=True),
                  x32.var(1, unbiased=False, keepdim=True), kind="output", dtype=torch.float32, name="var")
    rms = lambda a, b: a * torch.rsqrt(a.pow(2).mean(1, keepdim=True) + 1e-6) * b  # noqa: E731
    assert_parity(torch.from_numpy(got_rms), rms(x64, w64), rms(x32, w32), kind="output", dtype=torch.float32,
                  name="rms_norm")


def test_trn3_bf16_matmul_result_may_exceed_the_vector_psum_free_limit():
    @jit
    def wide(s_hbm, m_hbm):
        s_sb = nl.load(s_hbm)
        m_sb = nl.load(m_hbm)
        acc_psum = nl.ndarray((s_hbm.shape[1], m_hbm.shape[1]), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        return s_hbm

    before = get_target()
    try:
        set_target("trn3")
        simulate(wide)(np.ones((4, 2), BF16), np.ones((4, 8192), BF16))
        assert last_run().trace[-1].attrs["N"] == 8192
    finally:
        set_target(before)


def test_matmul_elements_do_not_depend_on_the_tile_width():
    """Like the systolic array, an output element is the same whatever N (fp32 BLAS blocking is not)."""
    @jit
    def widths(s_hbm, m_hbm):
        s_sb, m_sb = nl.load(s_hbm), nl.load(m_hbm)
        out_hbm = nl.ndarray((3, s_hbm.shape[1], 7), dtype=nl.float32, buffer=nl.shared_hbm)
        for i, n in enumerate((7, 100, m_hbm.shape[1])):
            acc_psum = nl.ndarray((s_hbm.shape[1], n), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb[:, 0:n])
            res_sb = nl.ndarray((s_hbm.shape[1], 7), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res_sb, src=acc_psum[:, 0:7])
            nisa.dma_copy(dst=out_hbm[i], src=res_sb)
        return out_hbm

    rng = np.random.default_rng(4)
    out = simulate(widths)(_bf16(rng, (128, 128)), _bf16(rng, (128, 512)))
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])


def test_int32_tensor_tensor_is_exact_on_gpsimd_and_fp32_on_vector():
    @jit
    def add_ints(x_hbm):
        x_sb = nl.load(x_hbm)
        out_hbm = nl.ndarray((3,) + x_hbm.shape, dtype=nl.int32, buffer=nl.shared_hbm)
        for i, eng in enumerate((None, nisa.gpsimd_engine, nisa.vector_engine)):
            r_sb = nl.ndarray(x_hbm.shape, dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=r_sb, data1=x_sb, data2=x_sb, op=nl.add, engine=eng)
            nisa.dma_copy(dst=out_hbm[i], src=r_sb)
        return out_hbm

    x = np.array([[2**24 + 1, 3]], dtype=np.int32)
    out = simulate(add_ints)(x)
    np.testing.assert_array_equal(out[0], 2 * x)
    np.testing.assert_array_equal(out[1], 2 * x)
    np.testing.assert_array_equal(out[2], (2 * x).astype(np.float32).astype(np.int32))   # fp32 rounding
    assert [e.engine for e in last_run().trace if e.opcode == "tensor_tensor"] == ["gpsimd", "gpsimd", "vector"]


def test_sin_outside_its_valid_range_is_rejected():
    @jit
    def sine(x_hbm):
        x_sb = nl.load(x_hbm)
        y_sb = nl.ndarray(x_hbm.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y_sb, op=nl.sin, data=x_sb)
        out_hbm = nl.ndarray(x_hbm.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_hbm, src=y_sb)
        return out_hbm

    inside = np.linspace(-np.pi, np.pi, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(simulate(sine)(inside), np.sin(inside))
    with pytest.raises(NKIRuleError, match="valid range"):
        simulate(sine)(np.full((2, 4), 9.0, np.float32))


def test_nl_sin_and_cos_tile_functions_reduce_the_argument():
    @jit
    def trig(x_hbm):
        x_sb = nl.load(x_hbm)
        out_hbm = nl.ndarray((2,) + x_hbm.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out_hbm[0], nl.sin(x_sb))
        nl.store(out_hbm[1], nl.cos(x_sb))
        return out_hbm

    x = np.linspace(-40.0, 40.0, 64, dtype=np.float32).reshape(4, 16)
    out = simulate(trig)(x)
    x64 = torch.from_numpy(x).double()
    x32 = torch.from_numpy(x)
    assert_parity(torch.from_numpy(out[0]), x64.sin(), x32.sin(), kind="output", dtype=torch.float32, name="sin")
    assert_parity(torch.from_numpy(out[1]), x64.cos(), x32.cos(), kind="output", dtype=torch.float32, name="cos")


def test_keyword_only_kernel_parameters_are_rejected():
    def kw_only(x_hbm, *, scale):
        return x_hbm

    with pytest.raises(NKIRuleError, match="keyword-only"):
        simulate(kw_only)(np.zeros((2, 2), np.float32), scale=1.0)
