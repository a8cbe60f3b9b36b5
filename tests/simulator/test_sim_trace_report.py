"""RunReport and trace records (the simulator interface of issue 2): instruction counts,
engines, opcodes, access records (buffer ids, memories, partitions, byte ranges, shapes, dtypes),
element/byte counts, source lines, peak SBUF/PSUM use computed by hand, ``recording(False)``.
"""

import numpy as np
from sim_helpers import BF16, line_of

from nki_lib.simulator import isa as nisa
from nki_lib.simulator import jit, last_run, recording, simulate
from nki_lib.simulator import language as nl
from nki_lib.simulator.trace import Access, TraceEntry

HBM_ARG = {"hbm", "private_hbm"}


def scale_and_cast(x):
    out = nl.ndarray((64, 32), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)  # LINE dma_in
    y_sb = nl.ndarray((64, 32), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y_sb, data=x_sb, op0=nl.multiply, operand0=2.0)  # LINE scale
    part_sb = nl.ndarray((32, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=part_sb, op=nl.exp, data=x_sb[16:48, 8:16])  # LINE act
    nisa.dma_copy(dst=out, src=y_sb)  # LINE dma_out
    return out


SCALE_AND_CAST = jit(scale_and_cast)


def _source(marker):
    basename, line = line_of(scale_and_cast, f"# LINE {marker}")
    return f"{basename}:{line}"


def _run_small():
    x = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    out = simulate(SCALE_AND_CAST)(x)
    np.testing.assert_array_equal(out, (2 * x).astype(BF16))
    return last_run()


def test_report_counts_and_engines():
    report = _run_small()
    assert report.kernel == "scale_and_cast"
    assert report.target in ("trn2", "trn3")
    assert report.grid == 1
    assert report.instructions == 4
    assert [e.opcode for e in report.trace] == ["dma_copy", "tensor_scalar", "activation", "dma_copy"]
    assert [e.engine for e in report.trace] == ["dma", "vector", "scalar", "dma"]
    assert [e.index for e in report.trace] == [0, 1, 2, 3]
    assert all(isinstance(e, TraceEntry) and e.program_id == 0 for e in report.trace)
    assert report.trace[2].attrs["func"] == "exp"


def test_trace_access_records():
    dma_in, scale, act, dma_out = _run_small().trace
    (src,), (dst,) = dma_in.reads, dma_in.writes
    assert isinstance(src, Access) and isinstance(dst, Access)
    assert src.memory in HBM_ARG and src.partitions == (0, 1) and src.byte_range == (0, 64 * 32 * 4)
    assert src.shape == (64, 32) and src.dtype == "float32"
    assert dst.memory == "sbuf" and dst.partitions == (0, 64) and dst.byte_range == (0, 32 * 4)
    assert dma_in.bytes == 64 * 32 * 4 and dma_in.elements == 64 * 32
    assert dma_in.attrs["src_memory"] in HBM_ARG and dma_in.attrs["dst_memory"] == "sbuf"

    assert scale.reads[0].buffer_id == dst.buffer_id  # x_sb written by the DMA, read by the scale
    (y_w,) = scale.writes
    assert y_w.buffer_id != dst.buffer_id
    assert y_w.dtype == "bfloat16" and y_w.byte_range == (0, 32 * 2) and y_w.shape == (64, 32)
    assert scale.shape == (64, 32) and scale.dtype == "bfloat16"
    assert scale.elements == 64 * 32 and scale.bytes == 64 * 32 * 2

    part_read = act.reads[0]
    assert part_read.buffer_id == dst.buffer_id
    assert part_read.partitions == (16, 48) and part_read.byte_range == (8 * 4, 16 * 4)
    assert part_read.shape == (32, 8)

    assert dma_out.reads[0].buffer_id == y_w.buffer_id
    assert dma_out.writes[0].memory == "shared_hbm" and dma_out.bytes == 64 * 32 * 2


def test_trace_source_lines():
    trace = _run_small().trace
    for entry, marker in zip(trace, ["dma_in", "scale", "act", "dma_out"]):
        file_part, _, line_part = entry.source.rpartition(":")
        expected_file, _, expected_line = _source(marker).rpartition(":")
        assert file_part.endswith(expected_file) and line_part == expected_line, (entry.source, marker)


def test_matmul_attrs():
    @jit
    def one_matmul(s, m):
        s_sb = nl.ndarray((96, 40), dtype=nl.bfloat16, buffer=nl.sbuf)
        m_sb = nl.ndarray((96, 300), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=s_sb, src=s)
        nisa.dma_copy(dst=m_sb, src=m)
        acc_psum = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        nisa.nc_matmul(dst=acc_psum, stationary=s_sb, moving=m_sb)
        out = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.shared_hbm)
        out_sb = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out_sb, src=acc_psum)
        nisa.dma_copy(dst=out, src=out_sb)
        return out

    simulate(one_matmul)(np.ones((96, 40), BF16), np.ones((96, 300), BF16))
    first, second = [e for e in last_run().trace if e.opcode == "nc_matmul"]
    for entry in (first, second):
        assert entry.engine == "tensor" and entry.shape == (40, 300)
        assert (entry.attrs["K"], entry.attrs["M"], entry.attrs["N"]) == (96, 40, 300)
        assert entry.attrs["is_transpose"] is False
        assert entry.writes[0].memory == "psum" and entry.writes[0].dtype == "float32"
    assert not first.attrs["accumulate"] and second.attrs["accumulate"]


@jit
def fixed_allocations(x):
    a_sb = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)    # 256 B / partition
    b_sb = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)   # 128 B
    c_sb = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.sbuf)     # 128 B
    p0 = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)     # one full bank
    p1 = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)     # one full bank
    p2 = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)     # 512 B in a third bank
    for t in (a_sb, b_sb, c_sb, p0, p1, p2):
        nisa.memset(dst=t, value=0.0)
    for t in (a_sb, b_sb, p0, p1, p2):              # used again: all six live together
        nisa.memset(dst=t, value=1.0)
    out = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=c_sb)
    return out


def test_peak_sbuf_and_psum_by_hand():
    simulate(fixed_allocations)(np.zeros((1, 1), np.float32))
    report = last_run()
    assert report.peak_sbuf_bytes == 256 + 128 + 128
    assert report.peak_psum_bytes == 2048 + 2048 + 512
    assert report.peak_psum_banks == 3
    assert report.instructions == 12


def test_recording_off_keeps_counts_and_peaks():
    simulate(fixed_allocations)(np.zeros((1, 1), np.float32))
    on = last_run()
    with recording(False):
        simulate(fixed_allocations)(np.zeros((1, 1), np.float32))
    off = last_run()
    assert on.trace is not None and len(on.trace) == on.instructions
    assert off.trace is None
    assert (off.instructions, off.peak_sbuf_bytes, off.peak_psum_bytes, off.peak_psum_banks) == (
        on.instructions, on.peak_sbuf_bytes, on.peak_psum_bytes, on.peak_psum_banks)
    simulate(fixed_allocations)(np.zeros((1, 1), np.float32))
    assert last_run().trace is not None  # recording is back on after the block


def _half_copy(x):
    pid = nl.program_id(axis=0)
    rows = x.shape[0] // nl.num_programs(axes=0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t_sb = nl.ndarray((rows, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_sb, src=x[nl.ds(pid * rows, rows), :])
    nisa.dma_copy(dst=out[nl.ds(pid * rows, rows), :], src=t_sb)
    return out


def test_lnc2_report_sums_instructions_and_takes_the_peak_per_program():
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    kernel = jit(_half_copy)
    np.testing.assert_array_equal(simulate(kernel)(x), x)
    one = last_run()
    np.testing.assert_array_equal(simulate(kernel[2])(x), x)
    two = last_run()
    assert (one.grid, two.grid) == (1, 2)
    assert one.instructions == 2 and two.instructions == 4
    assert one.peak_sbuf_bytes == two.peak_sbuf_bytes == 8 * 4       # per partition, max over programs
    per_program = {pid: [e.index for e in two.trace if e.program_id == pid] for pid in (0, 1)}
    assert per_program == {0: [0, 1], 1: [0, 1]}
    written = {e.writes[0].byte_range for e in two.trace if e.writes[0].memory == "shared_hbm"}
    assert written == {(0, 32 * 8 * 4), (32 * 8 * 4, 64 * 8 * 4)}


def _strided_reads(x):
    out = nl.ndarray((32, 8), dtype=x.dtype, buffer=nl.shared_hbm)
    t_sb = nl.ndarray((32, 8), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t_sb, src=x[16:48, 8:16])
    wide_sb = nl.ndarray((32, 40), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=wide_sb, value=0.0)
    nisa.tensor_copy(dst=wide_sb[:, 4:36:4], src=t_sb)
    nisa.dma_copy(dst=out, src=wide_sb[:, 4:36:4])
    return out


def test_access_byte_ranges_and_dma_chunks_of_strided_views():
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    np.testing.assert_array_equal(simulate(jit(_strided_reads))(x), x[16:48, 8:16])
    dma_in, _, copy, dma_out = last_run().trace
    src = dma_in.reads[0]
    assert src.byte_range == ((16 * 32 + 8) * 4, (47 * 32 + 16) * 4) and src.shape == (32, 8)
    assert dma_in.attrs["contiguous_bytes"] == 8 * 4
    strided = copy.writes[0]
    assert strided.partitions == (0, 32) and strided.byte_range == (4 * 4, (32 + 1) * 4)
    assert dma_out.attrs["contiguous_bytes"] == 4  # every 4th fp32 element: 4-byte chunks


def _scalar_tile_operands(x, lo, hi):
    """range_select with (P, 1) bound tiles and tensor_scalar_reduce with a (P, 1) operand tile."""
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    x_sb = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    lo_sb = nl.ndarray(lo.shape, dtype=nl.float32, buffer=nl.sbuf)
    hi_sb = nl.ndarray(hi.shape, dtype=nl.float32, buffer=nl.sbuf)
    for dst, src in ((x_sb, x), (lo_sb, lo), (hi_sb, hi)):
        nisa.dma_copy(dst=dst, src=src)
    sel_sb = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    row_max = nl.ndarray(lo.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(dst=sel_sb, on_true_tile=x_sb, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=lo_sb, bound1=hi_sb, reduce_res=row_max, reduce_op=nl.maximum)
    scaled_sb = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=scaled_sb, data=sel_sb, op0=nl.multiply, operand0=row_max,
                              reduce_op=nl.add, reduce_res=lo_sb)
    nisa.dma_copy(dst=out, src=scaled_sb)
    return out


def test_per_partition_scalar_tiles_are_recorded_as_reads():
    """A (P, 1) tile given where an immediate could go (range_select's bounds, tensor_scalar_reduce's
    operand0) is a read of that tile: the trace names it, so the schedule waits for its writer."""
    p, n = 16, 8
    x = np.arange(p * n, dtype=np.float32).reshape(p, n)
    lo = np.full((p, 1), 2.0, np.float32)
    hi = np.full((p, 1), 6.0, np.float32)
    simulate(jit(_scalar_tile_operands))(x, lo, hi)
    trace = last_run().trace
    by_op = {e.opcode: e for e in trace}
    lo_w, hi_w = (trace[i].writes[0].buffer_id for i in (1, 2))
    select = by_op["range_select"]
    assert {lo_w, hi_w} <= {a.buffer_id for a in select.reads}
    max_w = select.writes[1].buffer_id
    assert max_w in {a.buffer_id for a in by_op["tensor_scalar_reduce"].reads}
