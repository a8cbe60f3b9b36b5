"""Hand-computed estimates for small instruction sequences (cost model, docs/cost-model.md §7.2-§7.4).

Every expected value is written out from the formulas and the named constants of
``nki_lib.simulator.profile.constants`` (no figure is copied from the model's output).
"""

import pytest
from profile_tracegen import Trace, hbm, new_id, onchip

from nki_lib.simulator.profile import estimate, params

HW = params("trn2")
NS = 1e9


def _dma_service_ns(rows, row_bytes, hw=HW):
    """docs/cost-model.md §7.3: 16 engines of 8 rows each, one contiguous chunk per row, BW capped by the HBM share."""
    engines = min(hw.dma_engines, -(-rows // hw.dma_partitions_per_engine))
    bw = min(hw.dma_bw_per_engine, hw.hbm_bw_share / hw.dma_engines)
    return -(-rows // engines) * max(row_bytes / bw, hw.dma_chunk_floor_ns)


def test_one_matmul():
    t = Trace()
    t.matmul(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 512)),
             onchip(new_id(), "psum", (128, 512), "float32"))
    est = estimate(t.entries, "trn2")
    # max(min(64, M=128), N=512) = 512 PE cycles at 2.4 GHz, at the throttle's 50 % start rate,
    # then the PE result latency; plus the kernel launch.
    service = 512 / HW.f_pe * NS / HW.pe_throttle_start_frac
    assert est.time_ns == pytest.approx(HW.kernel_launch_ns + service + HW.pe_result_latency_ns)
    assert est.busy_ns["tensor"] == pytest.approx(service)
    assert est.throttle_ns == pytest.approx(service - 512 / HW.f_pe * NS)
    assert est.critical_engine == "tensor"
    assert est.instructions["tensor"] == 1


def test_fp32_matmul_costs_four_times_bf16():
    times = {}
    for dtype in ("bfloat16", "float32"):
        t = Trace()
        t.matmul(onchip(new_id(), "sbuf", (128, 128), dtype), onchip(new_id(), "sbuf", (128, 256), dtype),
                 onchip(new_id(), "psum", (128, 256), "float32"))
        times[dtype] = estimate(t.entries, "trn2").busy_ns["tensor"]
    assert times["float32"] == pytest.approx(HW.pe_fp32_factor * times["bfloat16"])


def test_dependent_chain_load_copy_store():
    t = Trace()
    x_hbm, x_sb, y_sb, y_hbm = new_id(), new_id(), new_id(), new_id()
    t.dma(hbm(x_hbm, (128, 512)), onchip(x_sb, "sbuf", (128, 512)))
    t.vector("tensor_copy", [onchip(x_sb, "sbuf", (128, 512))], onchip(y_sb, "sbuf", (128, 512)))
    t.dma(onchip(y_sb, "sbuf", (128, 512)), hbm(y_hbm, (128, 512)))
    est = estimate(t.entries, "trn2")
    dma = _dma_service_ns(128, 512 * 2)
    # bf16 SBUF->SBUF contiguous copy: perf mode, 4 elements per lane per cycle -> 128 cycles.
    copy = max(HW.min_ii_cycles, 512 / HW.dve_width_16bit_sbuf) / HW.f_dve * NS
    load_done = HW.dma_issue_static_ns + dma + HW.dma_latency_ns
    copy_done = load_done + copy + HW.dve_completion_ns
    store_done = copy_done + HW.dma_issue_static_ns + dma + HW.dma_latency_ns
    assert est.time_ns == pytest.approx(HW.kernel_launch_ns + store_done)
    # fully dependent: the schedule is the serial sum
    assert est.upper_bound_ns == pytest.approx(est.time_ns)
    assert est.lower_bound_ns < est.time_ns


def test_two_independent_engines_overlap():
    t = Trace()
    t.matmul(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 512)),
             onchip(new_id(), "psum", (128, 512), "float32"))
    t.activation(onchip(new_id(), "sbuf", (128, 2048), "float32"), onchip(new_id(), "sbuf", (128, 2048), "float32"),
                 func="exp")
    est = estimate(t.entries, "trn2")
    pe_done = 512 / HW.f_pe * NS / HW.pe_throttle_start_frac + HW.pe_result_latency_ns
    act_service = HW.act_table_load_ns + 2048 / HW.f_act * NS  # first exp loads its table
    act_done = act_service + HW.act_completion_ns
    assert est.time_ns == pytest.approx(HW.kernel_launch_ns + max(pe_done, act_done))
    assert est.upper_bound_ns == pytest.approx(HW.kernel_launch_ns + pe_done + act_done)
    assert est.busy_ns["scalar"] == pytest.approx(act_service)
    assert est.critical_engine == "scalar"
    assert est.act_table_loads == 1


def test_dma_bound_loop():
    t, iters = Trace(), 6
    for _ in range(iters):
        tile = new_id()
        t.dma(hbm(new_id(), (128, 2048)), onchip(tile, "sbuf", (128, 2048)))
        t.vector("tensor_scalar", [onchip(tile, "sbuf", (128, 2048))], onchip(tile, "sbuf", (128, 2048)))
    est = estimate(t.entries, "trn2")
    dma = _dma_service_ns(128, 2048 * 2)
    op = max(HW.min_ii_cycles, 2048 / HW.dve_width_16bit_sbuf) / HW.f_dve * NS
    assert op < dma  # VectorE keeps up: the loop is DMA-bound
    # loads stream back to back on all 16 DMA engines; the last one's tensor_scalar ends the kernel
    last_load_done = HW.dma_issue_static_ns + iters * dma + HW.dma_latency_ns
    assert est.time_ns == pytest.approx(HW.kernel_launch_ns + last_load_done + op + HW.dve_completion_ns)
    assert est.critical_engine == "dma"
    assert est.busy_ns["dma"] == pytest.approx(iters * dma)
    assert est.utilisation["dma"] > est.utilisation["vector"]


def test_write_after_read_waits_for_the_reader():
    t = Trace()
    buf = new_id()
    t.activation(onchip(buf, "sbuf", (128, 512), "float32"), onchip(new_id(), "sbuf", (128, 512), "float32"),
                 func="copy")
    t.vector("memset", [], onchip(buf, "sbuf", (128, 512), "float32"))
    est = estimate(t.entries, "trn2", keep_timeline=True)
    act_done = est.timeline[0][5]
    assert est.timeline[1][3] == pytest.approx(act_done)


def test_disjoint_regions_do_not_depend():
    t = Trace()
    buf = new_id()
    t.activation(onchip(buf, "sbuf", (64, 512), "float32"), onchip(new_id(), "sbuf", (64, 512), "float32"),
                 func="copy")
    t.vector("memset", [], onchip(buf, "sbuf", (64, 512), "float32", p0=64))
    est = estimate(t.entries, "trn2", keep_timeline=True)
    assert est.timeline[1][3] == 0.0


def test_activation_table_switches():
    def loads(funcs):
        t = Trace()
        for func in funcs:
            t.activation(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 128)), func=func)
        return estimate(t.entries, "trn2").act_table_loads

    assert loads(["exp", "exp", "exp"]) == 1
    assert loads(["exp", "copy", "exp"]) == 1  # pass-through functions need no table
    assert loads(["exp", "silu", "exp"]) == 3


def test_psum_banks_are_a_resource():
    """Nine 1-bank PSUM tiles: the ninth matmul waits for the first tile's eviction."""
    t = Trace()
    stat = onchip(new_id(), "sbuf", (128, 128))
    tiles = [new_id() for _ in range(HW.psum_banks + 1)]
    for tile in tiles:  # short matmuls: TensorE is free long before the eviction ends
        t.matmul(stat, onchip(new_id(), "sbuf", (128, 64)), onchip(tile, "psum", (128, 64), "float32"))
    for tile in tiles[1:]:  # tiles 1..8 are evicted at the end: they stay live
        t.vector("tensor_copy", [onchip(tile, "psum", (128, 64), "float32")],
                 onchip(new_id(), "sbuf", (128, 64), "float32"))
    evict = t.vector("tensor_copy", [onchip(tiles[0], "psum", (128, 64), "float32")],
                     onchip(new_id(), "sbuf", (128, 64), "float32"))
    # move the eviction of tile 0 before the ninth matmul in program order
    t.entries.remove(evict)
    t.entries.insert(HW.psum_banks, evict)
    for i, e in enumerate(t.entries):
        e.index = i
    est = estimate(t.entries, "trn2", keep_timeline=True)
    by_index = {row[0]: row for row in est.timeline}
    evict_done = by_index[HW.psum_banks][5]
    ninth_matmul_start = by_index[HW.psum_banks + 1][3]
    assert ninth_matmul_start == pytest.approx(evict_done)


def test_lnc2_barrier_joins_programs():
    """Each core stores its half of a shared tensor, then both pass a core_barrier."""
    traces = [Trace(0), Trace(1)]
    shared = new_id()
    widths = (512, 4096)
    for pid, width in enumerate(widths):
        t = traces[pid]
        t.dma(onchip(new_id(), "sbuf", (128, width), "float32"),
              hbm(shared, (128, width), "float32", offset=pid * 128 * widths[0] * 4))
        t.add("sync", "core_barrier", [hbm(shared, (128, sum(widths)), "float32")], [], (1,), "float32")
        t.vector("memset", [], onchip(new_id(), "sbuf", (128, 64), "float32"))
    est = estimate(traces[0].entries + traces[1].entries, "trn2", keep_timeline=True)
    slow_store_done = HW.dma_issue_static_ns + _dma_service_ns(128, widths[1] * 4) + HW.dma_latency_ns
    release = slow_store_done + HW.sync_op_cycles / HW.f_act * NS + HW.barrier_ns
    # program 0 (the fast core) resumes only at the joint release
    memset_row = [r for r in est.timeline if r[2] == "memset"][0]
    assert memset_row[3] == pytest.approx(release)
    assert est.grid == 2


def test_unmodelled_opcodes_are_reported():
    t = Trace()
    t.vector("some_future_op", [onchip(new_id(), "sbuf", (128, 256))], onchip(new_id(), "sbuf", (128, 256)))
    est = estimate(t.entries, "trn2")
    assert est.unmodelled == {"some_future_op": 1}
    assert "some_future_op" in est.summary()


def test_bad_arguments():
    with pytest.raises(ValueError, match="target"):
        estimate([], "trn9")
    with pytest.raises(ValueError, match="target"):
        estimate([])

    class NoTrace:
        trace = None
        target = "trn2"

    with pytest.raises(ValueError, match="report_or_trace"):
        estimate(NoTrace())
    with pytest.raises(TypeError, match="report_or_trace"):
        estimate(42, "trn2")


def test_psum_accumulation_group_runs_back_to_back():
    """K-tiled matmuls accumulating into one PSUM tile wait only for TensorE's in-order pipeline."""
    t = Trace()
    acc = new_id()
    for _ in range(4):
        t.matmul(onchip(new_id(), "sbuf", (128, 128)), onchip(new_id(), "sbuf", (128, 512)),
                 onchip(acc, "psum", (128, 512), "float32"))
    evict = t.vector("tensor_copy", [onchip(acc, "psum", (128, 512), "float32")],
                     onchip(new_id(), "sbuf", (128, 512), "float32"))
    est = estimate(t.entries, "trn2", keep_timeline=True)
    rows = est.timeline
    for prev, nxt in zip(rows[:3], rows[1:4]):
        assert nxt[3] == pytest.approx(prev[4])  # starts when the previous matmul's service ends
    # the eviction (another engine) waits for the PE result latency of the last matmul
    assert rows[4][3] == pytest.approx(rows[3][4] + HW.pe_result_latency_ns)
    assert evict.opcode == "tensor_copy"


def test_critical_path_adds_up_and_names_the_chain():
    t = Trace()
    x_hbm, x_sb, y_sb, y_hbm = new_id(), new_id(), new_id(), new_id()
    t.dma(hbm(x_hbm, (128, 512)), onchip(x_sb, "sbuf", (128, 512)))
    t.vector("tensor_copy", [onchip(x_sb, "sbuf", (128, 512))], onchip(y_sb, "sbuf", (128, 512)))
    t.activation(onchip(new_id(), "sbuf", (128, 64)), onchip(new_id(), "sbuf", (128, 64)), func="copy")  # off path
    t.dma(onchip(y_sb, "sbuf", (128, 512)), hbm(y_hbm, (128, 512)))
    est = estimate(t.entries, "trn2")
    path = est.critical_path
    assert sum(step[2] for step in path) == pytest.approx(est.makespan_ns)
    assert [step[0].opcode for step in path if step[0] is not None] == ["dma_copy", "tensor_copy", "dma_copy"]
    assert [step[3] for step in path if step[0] is not None][1:] == ["data", "data"]
    top = est.hotspots(2)
    assert top[0][3] >= top[1][3] and 0 < top[0][4] <= 1
