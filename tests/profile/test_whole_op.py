"""Whole-op estimates (issue 13): host-side torch ops around the kernels are counted and charged.

Checked: the accounting of single aten ops (views and allocations move nothing; a copy reads and
writes its bytes; a factory reads nothing; a gather reads its indices and the rows it selects; an
in-place op writes its destination), that only ops
inside ``nki::`` ops or their autograd formulas are recorded, that an op call's launches and
bytes add up, and that data checks on host copies (``on_host``) are charged one transfer per tensor
copied and nothing for their ops. No time is asserted.
"""

import torch

from nki_lib.bench.whole_op import (
    TO_HOST,
    account,
    autograd_glue_op,
    estimate_call,
    host_cost,
    owner_op,
    record_host_ops,
)
from nki_lib.simulator.profile import params
from nki_lib.validation import on_host

HW = params("trn2")


def _account(func, *args, **kwargs):
    return account(func, args, kwargs, func(*args, **kwargs), "op")


def test_views_and_allocations_move_nothing():
    x = torch.ones(4, 8)
    assert _account(torch.ops.aten.transpose.int, x, 0, 1) is None
    assert _account(torch.ops.aten.view.default, x, [8, 4]) is None
    assert _account(torch.ops.aten.contiguous.default, x) is None  # already contiguous: the same tensor
    assert _account(torch.ops.aten.empty.memory_format, [4, 8]) is None


def test_copies_read_and_write_their_bytes():
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    host = _account(torch.ops.aten.contiguous.default, x.t())
    assert (host.bytes_read, host.bytes_written) == (64, 64)
    cat = _account(torch.ops.aten.cat.default, [x, x])
    assert (cat.bytes_read, cat.bytes_written) == (128, 128)


def test_factory_reads_nothing_and_in_place_writes_its_destination():
    x = torch.ones(4, 8)
    zeros = _account(torch.ops.aten.new_zeros.default, x, [2, 8])
    assert (zeros.bytes_read, zeros.bytes_written) == (0, 64)
    dst, src = torch.zeros(4, 8), torch.ones(4, 8)
    copy = _account(torch.ops.aten.copy_.default, dst, src)
    assert (copy.bytes_read, copy.bytes_written) == (128, 128)


def test_a_gather_reads_its_indices_and_the_rows_it_selects():
    pool = torch.ones(400, 8, dtype=torch.bfloat16)
    ids = torch.tensor([3, 7, 7], dtype=torch.int32)
    host = _account(torch.ops.aten.index_select.default, pool, 0, ids)
    assert (host.bytes_read, host.bytes_written) == (3 * 16 + 12, 3 * 16)
    picked = _account(torch.ops.aten.gather.default, pool, 0, torch.zeros(2, 8, dtype=torch.int64))
    assert (picked.bytes_read, picked.bytes_written) == (2 * 16 + 128, 2 * 16)


def test_host_cost_is_one_launch_per_op_plus_bytes():
    x = torch.ones(4, 8)
    ops = [_account(torch.ops.aten.clone.default, x)] * 3
    cost = host_cost(ops, HW)
    assert cost["launches"] == 3 and cost["hbm_bytes"] == 3 * 256
    assert cost["ops"] == {"aten.clone.default": 3}
    assert cost["time_us"] * 1e3 == 3 * HW.kernel_launch_ns + 3 * 256 / HW.dma_bandwidth()
    assert host_cost(ops, HW, scale=2.0)["hbm_bytes"] == 2 * 3 * 256  # bytes scale, launches do not


def _attention_inputs():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def test_only_ops_inside_nki_ops_are_recorded():
    import nki_lib

    q, k, v = _attention_inputs()
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), record_host_ops() as ops:
        torch.cat([q, q])                                   # outside any nki op: not recorded
        out, _ = torch.ops.nki.flash_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert {o.op for o in ops} <= {"flash_attention", "flash_attention_backward"}
    assert all(o.bytes_written > 0 for o in ops)


def test_autograd_glue_is_charged_to_the_backward_op():
    """The autograd formula's own ops around the backward op (here the cast of d sinks to the
    sinks' dtype) are host ops of the backward; the unused lse output's gradient stays None (no
    zeros: the kernel takes delta without dlse)."""
    import nki_lib

    assert autograd_glue_op("GeneratedBackwardFor_nki_flash_attention_defaultBackward") == "flash_attention_backward"
    assert autograd_glue_op("GeneratedBackwardFor_nki_moe_experts_defaultBackward") == "moe_experts_backward"
    assert autograd_glue_op("GeneratedBackwardFor_nki_moe_experts_train_defaultBackward") == "moe_experts_backward"
    assert autograd_glue_op("MulBackward0") is None
    # an op's internal variant is charged to the op its kernels run under
    assert owner_op("moe_experts_train") == "moe_experts" and owner_op("moe_experts_backward") == "moe_experts_backward"
    q, k, v = _attention_inputs()
    sinks = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), record_host_ops() as ops:
        out, _ = torch.ops.nki.flash_attention(q, k, v, sinks, causal=True)
        torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out))
    glue = {o.name for o in ops if o.op == "flash_attention_backward"}
    assert "aten._to_copy.default" in glue and "aten.zeros.default" not in glue


def test_estimate_call_adds_the_host_ops_beside_the_kernels():
    q, k, v = _attention_inputs()

    def call():
        out, _ = torch.ops.nki.flash_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    whole = estimate_call(call, "trn2")
    assert {op for op, _ in whole.kernels} == {"flash_attention", "flash_attention_backward"}
    assert whole.host["launches"] == len(whole.host_ops)
    assert whole.host["hbm_bytes"] == sum(o.hbm_bytes for o in whole.host_ops)
    assert whole.total_us == whole.kernel_us + whole.host["time_us"]
    assert whole.total_dependency_bound_us <= whole.total_us


def test_a_training_forward_is_charged_to_the_op_its_kernels_run_under():
    """moe_experts with inputs that require grad runs nki::moe_experts_train, whose kernel launch is
    recorded as moe_experts: its host ops (the launcher's index metadata) are charged there too, so
    the forward part of a train call has its whole-op figure."""
    import nki_lib
    from nki_lib.bench.harness import _call
    from nki_lib.bench.inputs import make_call
    from nki_lib.dispatch import collect_runs

    args, kwargs = make_call("moe_experts", dict(T=64, H=128, I=128, E=4, k=2, block_size=128), torch.bfloat16,
                             requires_grad=True)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), collect_runs() as runs, record_host_ops() as ops:
        _call("moe_experts", args, kwargs, "train")
    assert {op for op, _ in runs} == {"moe_experts", "moe_experts_backward"}
    assert {o.op for o in ops} == {"moe_experts", "moe_experts_backward"}


def test_the_saved_activations_get_no_zero_gradient():
    """The training forward's saved g/u output never reaches the loss: its backward gets no
    materialised zero gradient (no host memset of the saved tensor's size)."""
    import nki_lib
    from nki_lib.bench.harness import _call
    from nki_lib.bench.inputs import make_call

    args, kwargs = make_call("moe_experts", dict(T=64, H=128, I=128, E=4, k=2, block_size=128), torch.bfloat16,
                             requires_grad=True)
    with nki_lib.use_backend("simulator"), nki_lib.strict(True):
        saved = torch.ops.nki.moe_experts_train(*[a.detach() if torch.is_tensor(a) else a for a in args],
                                                **kwargs)[1]
        assert saved.numel() > 0        # the kernel path saves g/u at this shape
        with record_host_ops() as ops:
            _call("moe_experts", args, kwargs, "train")
    zeros = [o for o in ops if o.op == "moe_experts_backward" and o.name.startswith("aten.zeros")]
    assert all(o.bytes_written < saved.numel() * saved.element_size() for o in zeros)


def _moe_call():
    from nki_lib.bench.inputs import make_call

    return make_call("moe_experts", dict(T=64, H=128, I=128, E=4, k=2, block_size=128), torch.bfloat16)


def test_a_host_check_is_one_transfer_per_copied_tensor():
    """Inside an nki op, each tensor ``on_host`` copies is one transfer (a launch, its bytes read
    from HBM) and the ops run on the copies are not charged (here the plan's checks of
    moe_experts and its launcher's check for a token named twice in a group); outside every nki
    op nothing is recorded."""
    import nki_lib

    ids = torch.tensor([0, 0, 1, -1], dtype=torch.int32)
    with record_host_ops() as ops:
        with on_host(ids, None) as (copy, absent):
            torch.unique(copy)
    assert ops == [] and absent is None
    args, kwargs = _moe_call()
    with nki_lib.use_backend("simulator"), nki_lib.strict(True), record_host_ops() as ops:
        torch.ops.nki.moe_experts(*args, **kwargs)
    transfers = [(o.op, o.bytes_read, o.bytes_written) for o in ops if o.name == TO_HOST]
    # the plan's two tensors, then the launcher's slot tokens (its combine choice, on the host)
    assert transfers[:2] == [("moe_experts", t.numel() * t.element_size(), 0) for t in args[2:4]]
    assert len(transfers) == 3
    checks = {"aten.aminmax.default", "aten._unique2.default", "aten.amax.default", "aten.sort.default"}
    assert not checks & {o.name for o in ops}
    assert host_cost(ops, HW)["launches"] == len(ops)      # a transfer is one launch like any host op
