"""Simulator fidelity, round 2 (issue 10, "Simulator behaviours" 1-7); each behaviour is decided in
``nki_lib/simulator/README.md`` ("Decided behaviours"):

1. dataclass-style ``nl.NKIObject`` subclasses (plain class attributes as fields, constructed by
   keyword, a declared field left out is None);
2. auto-accumulate state (``nc_matmul(accumulate=None)``) belongs to the allocation, data bytes at
   one address stay shared; a read (PSUM eviction) between two matmul groups does not end a group;
3. a tile used as a Python truth value at trace time is truthy;
4. enum parameters accept the enum's value (``dge_mode=3``);
5. a stride-0 destination is accepted, last write wins;
6. access-pattern bounds are checked when an instruction touches the view, not when ``.ap()`` builds it;
7. SBUF/PSUM capacity follows liveness in program order (first to last use), not Python references.
"""

from dataclasses import dataclass

import numpy as np
import pytest
from sim_helpers import BF16, check_rule_error, run_tiles

from nki_lib.simulator import NKIRuleError, jit, last_run, simulate, tile_size
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

MARK = "# VIOLATION"
P, F = 32, 16


def _ints(rng, shape, lo=-4, hi=4):
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(np.float32)


# ---------------------------------------------------------------- 1. NKIObject dataclasses
@dataclass
class _Plain(nl.NKIObject):
    scale = None
    bias = None
    rows = 4


@dataclass
class _Annotated(nl.NKIObject):
    scale: float
    shift: float = 0.0


class _Undecorated(nl.NKIObject):
    scale = 1.0
    label = None


def test_dataclass_nkiobject_plain_attribute_fields_by_keyword():
    cfg = _Plain(scale=2.0)
    assert (cfg.scale, cfg.bias, cfg.rows) == (2.0, None, 4)
    assert _Plain(bias=1.0, rows=8).rows == 8
    assert _Plain(scale=2.0) == _Plain(scale=2.0) and _Plain(scale=2.0) != _Plain(scale=3.0)


def test_dataclass_nkiobject_left_out_field_is_none():
    cfg = _Annotated(shift=1.0)
    assert cfg.scale is None and cfg.shift == 1.0
    assert _Annotated(3.0).scale == 3.0                     # positional, in declared order
    assert _Undecorated(label="x").label == "x" and _Undecorated().scale == 1.0


def test_dataclass_nkiobject_unknown_keyword_is_rejected():
    with pytest.raises(TypeError, match="unknown"):
        _Plain(scael=2.0)


def test_dataclass_nkiobject_used_in_a_kernel(rng):
    x = _ints(rng, (P, F))

    def body(x_sb, cfg=_Plain(scale=3.0, bias=-1.0)):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=cfg.scale, op1=nl.add,
                           operand1=cfg.bias)
        return y_sb

    np.testing.assert_array_equal(run_tiles(body, x), 3 * x - 1)


# ---------------------------------------------------------------- 2. accumulation groups
def _load(x_hbm):
    x_sb = nl.ndarray(x_hbm.shape, dtype=x_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x_hbm)
    return x_sb


def _evict(acc_psum, out_hbm, row):
    """PSUM -> SBUF (a read of the PSUM tile by VectorE) -> rows [row, row + M) of out_hbm."""
    m, n = acc_psum.shape
    res_sb = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res_sb, src=acc_psum)
    nisa.dma_copy(dst=out_hbm[row:row + m, :], src=res_sb)


@jit
def _rotating_banks(s_hbm, m_hbm):
    """Eight times the same product into a fresh allocation placed on bank i % 2 (auto accumulate)."""
    k, m = s_hbm.shape
    n = m_hbm.shape[1]
    s_sb, m_sb = _load(s_hbm), _load(m_hbm)
    out_hbm = nl.ndarray((8 * m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    bank = tile_size.psum_bank_fmax_bytes
    for i in range(8):
        acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum, address=(0, (i % 2) * bank))
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        _evict(acc_psum, out_hbm, i * m)
    return out_hbm


def test_new_allocation_at_a_used_address_starts_a_new_accumulation_group(rng):
    s, mv = _ints(rng, (16, 8)).astype(BF16), _ints(rng, (16, 12)).astype(BF16)
    want = s.astype(np.float32).T @ mv.astype(np.float32)
    out = simulate(_rotating_banks)(s, mv)
    np.testing.assert_array_equal(out, np.tile(want, (8, 1)))


@jit
def _alias_reads_shared_bytes(s_hbm, m_hbm):
    """A second allocation on the same bank reads the bytes the first one's matmul left there."""
    k, m = s_hbm.shape
    n = m_hbm.shape[1]
    s_sb, m_sb = _load(s_hbm), _load(m_hbm)
    out_hbm = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    first_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum, address=(0, 0))
    nisa.nc_matmul(dst=first_psum, stationary=s_sb, moving=m_sb)
    alias_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum, address=(0, 0))
    _evict(alias_psum, out_hbm, 0)
    return out_hbm


def test_aliased_allocations_share_data_bytes(rng):
    s, mv = _ints(rng, (16, 8)).astype(BF16), _ints(rng, (16, 12)).astype(BF16)
    out = simulate(_alias_reads_shared_bytes)(s, mv)
    np.testing.assert_array_equal(out, s.astype(np.float32).T @ mv.astype(np.float32))


@jit
def _eviction_between_groups(s_hbm, m_hbm):
    """One allocation: matmul, evict (read by VectorE), matmul again with accumulate=None."""
    k, m = s_hbm.shape
    n = m_hbm.shape[1]
    s_sb, m_sb = _load(s_hbm), _load(m_hbm)
    out_hbm = nl.ndarray((2 * m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
    _evict(acc_psum, out_hbm, 0)
    nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
    _evict(acc_psum, out_hbm, m)
    return out_hbm


def test_eviction_does_not_end_an_accumulation_group(rng):
    s, mv = _ints(rng, (16, 8)).astype(BF16), _ints(rng, (16, 12)).astype(BF16)
    want = s.astype(np.float32).T @ mv.astype(np.float32)
    out = simulate(_eviction_between_groups)(s, mv)
    np.testing.assert_array_equal(out, np.concatenate([want, 2 * want]))


# ---------------------------------------------------------------- 3. truth value of a tile
def test_tile_truth_value_at_trace_time_is_truthy(rng):
    x = _ints(rng, (P, F))

    def body(x_sb, bias_sb=None):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        taken = bool(x_sb) and (x_sb is not None and x_sb)
        nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.add, operand0=1.0 if taken else 0.0)
        return y_sb

    np.testing.assert_array_equal(run_tiles(body, x), x + 1)


def test_tile_contents_stay_unavailable_to_python(rng):
    def body(x_sb):
        return x_sb if float(x_sb[0, 0]) > 0 else x_sb

    with pytest.raises(TypeError, match="not available"):
        run_tiles(body, _ints(rng, (P, F)))


# ---------------------------------------------------------------- 4. enum values
def test_enum_parameters_accept_their_values(rng):
    x = _ints(rng, (P, F))

    def body(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=y_sb, src=x_sb, dge_mode=nisa.dge_mode.none.value, oob_mode=0)
        z_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=z_sb, data=y_sb, op0=nl.multiply, operand0=2.0, engine=nisa.engine.gpsimd.value)
        row_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        w_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=w_sb, op=nl.copy, data=z_sb, reduce_op=nl.add, reduce_res=row_sb,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce.value)
        return w_sb, row_sb

    w, row = run_tiles(body, x)
    np.testing.assert_array_equal(w, 2 * x)
    np.testing.assert_array_equal(row, (2 * x).sum(axis=1, keepdims=True))
    assert {e.attrs.get("dge_mode") for e in last_run().trace if e.opcode == "dma_copy"} >= {"none"}


def test_enum_parameter_value_out_of_range_is_rejected(rng):
    def body(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=y_sb, src=x_sb, dge_mode=17)  # VIOLATION
        return y_sb

    with pytest.raises(NKIRuleError) as info:
        run_tiles(body, _ints(rng, (P, F)))
    assert info.value.operand == "dge_mode"


# ---------------------------------------------------------------- 5. stride-0 destination
def test_stride0_destination_as_a_dummy_sink_last_write_wins(rng):
    x = _ints(rng, (P, F))

    def body(x_sb):
        junk_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        sum_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=junk_sb.ap([[1, P], [0, F]], offset=0), op=nl.copy, data=x_sb,
                               reduce_op=nl.add, reduce_res=sum_sb, scale=2.0)
        return junk_sb, sum_sb

    junk, total = run_tiles(body, x)
    np.testing.assert_array_equal(junk[:, 0], 2 * x[:, -1])          # the last element written wins
    np.testing.assert_array_equal(total[:, 0], (2 * x).sum(axis=1))


# ---------------------------------------------------------------- 6. bounds at use
def test_out_of_bounds_view_is_fine_until_an_instruction_touches_it(rng):
    x = _ints(rng, (P, F))

    def body(x_sb):
        y_sb = nl.ndarray(x_sb.shape, dtype=nl.float32, buffer=nl.sbuf)
        views = [x_sb.ap([[F, P], [1, F]], offset=t * F) for t in range(3)]   # views 1, 2 leave the tile
        nisa.tensor_copy(dst=y_sb, src=views[0])
        return y_sb

    np.testing.assert_array_equal(run_tiles(body, x), x)


def test_out_of_bounds_view_fails_at_the_instruction_that_touches_it(rng):
    def touch(x_hbm):
        x_sb = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sb, src=x_hbm)
        beyond = x_sb.ap([[F, P], [1, F]], offset=F)
        y_sb = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y_sb, src=beyond)  # VIOLATION
        return x_hbm

    with pytest.raises(NKIRuleError) as info:
        simulate(jit(touch))(_ints(rng, (P, F)))
    check_rule_error(info.value, touch, MARK, instruction="tensor_copy", operand="src")


# ---------------------------------------------------------------- 7. liveness in program order
def _transposes(x_hbm):
    """Eight PSUM transposes, all still referenced at the end (each bank used once)."""
    x_sb = _load(x_hbm)
    p, f = x_hbm.shape
    out_hbm = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.shared_hbm)
    kept = []
    for _ in range(tile_size.psum_num_banks):
        t_psum = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum, data=x_sb)
        kept.append(t_psum)
    extra_psum = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=extra_psum, data=x_sb)
    last_sb = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=last_sb, src=kept[-1])
    nisa.dma_copy(dst=out_hbm, src=last_sb)
    return out_hbm


def test_referenced_but_dead_psum_tiles_do_not_count(rng):
    x = _ints(rng, (P, F))
    np.testing.assert_array_equal(simulate(jit(_transposes))(x), x.T)
    assert last_run().peak_psum_banks == 2      # the last transpose's tile and the extra one


def _nine_live_banks(x_hbm):
    x_sb = _load(x_hbm)
    p, f = x_hbm.shape
    live = []
    for _ in range(tile_size.psum_num_banks):
        live.append(nl.ndarray((f, p), dtype=nl.float32, buffer=nl.psum))
        nisa.nc_transpose(dst=live[-1], data=x_sb)
    ninth = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.psum)  # VIOLATION
    nisa.nc_transpose(dst=ninth, data=x_sb)
    sink_sb = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.sbuf)
    for t_psum in live + [ninth]:
        nisa.tensor_copy(dst=sink_sb, src=t_psum)
    return x_hbm


def test_nine_banks_live_in_program_order_overflow_naming_the_allocation(rng):
    with pytest.raises(NKIRuleError) as info:
        simulate(jit(_nine_live_banks))(_ints(rng, (P, F)))
    check_rule_error(info.value, _nine_live_banks, MARK, instruction="ndarray", rule_words=("PSUM", "9"))


def test_sbuf_liveness_is_first_to_last_use(rng):
    cols = tile_size.sbuf_fmax_bytes // 4 // 3      # fp32 tile of a third of the usable SBUF

    @jit
    def staged(x_hbm):
        tiles = [nl.ndarray((128, cols), dtype=nl.float32, buffer=nl.sbuf) for _ in range(6)]
        for t_sb in tiles:                              # each tile used once, in turn
            nisa.memset(dst=t_sb, value=0.0)
        return x_hbm

    simulate(staged)(np.zeros((1, 1), np.float32))
    assert last_run().peak_sbuf_bytes == cols * 4
