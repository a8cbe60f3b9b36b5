"""AWS NKI Library kernels (re-typed, see each kernels_nkilib_*.py) on the simulator."""

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_lib import simulator as sim
from nki_lib.numerics import assert_parity

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---- cumsum (tensor_tensor_scan, sequential_range, HBM reshape, NKIObject tiles) -------------

@pytest.mark.parametrize("shape", [(8, 300), (130, 40), (2, 3, 2100)], ids=["2d", "two-p-tiles", "3d-two-f-tiles"])
def test_cumsum(load_kernels, rng, shape):
    k = load_kernels("kernels_nkilib_cumsum")
    x = rng.standard_normal(shape).astype(np.float32)
    y = sim.simulate(k.cumsum)(x)
    oracle = torch.from_numpy(np.cumsum(x.astype(np.float64), axis=-1))
    # baseline: a sequential fp32 running sum (NumPy's float32 cumsum); torch's CPU cumsum
    # accumulates float32 in double and is not "the same thing in the same precision"
    baseline = torch.from_numpy(np.cumsum(x, axis=-1, dtype=np.float32))
    assert_parity(torch.from_numpy(y), oracle, baseline, kind="output", dtype=torch.float32, name="cumsum")


# ---- cascaded_max (NKIObject dataclass config, .ap(), nc_find_index8, affine_select, iota,
#      nc_matmul is_transpose, dge_mode, LNC2 program_id + shared_hbm) ------------------------

def _distinct_rows(rng, rows, cols):
    """Rows with a unique maximum each (argmax well defined)."""
    return np.stack([rng.permutation(cols) for _ in range(rows)]).astype(np.float32) / cols


@pytest.mark.parametrize("grid", [1, 2])
@pytest.mark.parametrize("vocab", [1024, 1000], ids=["fold-fast-path", "fold-padded-path"])
def test_cascaded_max_axis2(load_kernels, rng, grid, vocab):
    k = load_kernels("kernels_nkilib_cascaded_max")
    x = _distinct_rows(rng, 4, vocab)
    kernel = k.cascaded_max_axis2 if grid == 1 else k.cascaded_max_axis2[grid]
    values, indices = sim.simulate(kernel)(x)
    assert values.shape == (4, 1) and indices.shape == (4, 1)
    np.testing.assert_array_equal(values[:, 0], x.max(axis=1))
    np.testing.assert_array_equal(indices[:, 0], x.argmax(axis=1))
    assert sim.last_run().grid == grid


def test_cascaded_max_library_axis_is_rejected(load_kernels, rng):
    """The library's ``tensor_reduce(..., axis=1)`` on a 3-D [b, fold, elts] tile is the NKI 0.2
    reading; since 0.3 the reduced axes must be the trailing free dims (nki-api.md §8.11)."""
    k = load_kernels("kernels_nkilib_cascaded_max")
    x = _distinct_rows(rng, 4, 1024)
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.cascaded_max)(x)
    err = info.value
    assert (err.instruction, err.operand) == ("tensor_reduce", "axis")
    assert err.source.startswith("kernels_nkilib_cascaded_max.py:")


# ---- cross_entropy_forward (activation exp/log, tensor_reduce, -inf memset, dynamic DMA with
#      scalar_offset/indirect_dim, nki.dtype argument, name= kwargs, LNC2 remainder split) -----

@pytest.mark.parametrize("grid", [1, 2])
def test_cross_entropy_forward(load_kernels, rng, trn2, grid):
    k = load_kernels("kernels_nkilib_cross_entropy")
    nl = sim.language
    num_positions, vocab = 7, 300
    logits = (3 * rng.standard_normal((num_positions, vocab))).astype(np.float32)
    targets = rng.integers(0, vocab, size=num_positions).astype(np.int32)
    kernel = k.cross_entropy_forward if grid == 1 else k.cross_entropy_forward[grid]
    loss, lse = sim.simulate(kernel)(logits, targets, positions_per_batch=2, chunk_size=128, dtype=nl.float32)

    x64 = logits.astype(np.float64)
    lse_oracle = np.log(np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1)) + x64.max(axis=1)
    loss_oracle = lse_oracle - x64[np.arange(num_positions), targets]
    lse_base = torch.logsumexp(torch.from_numpy(logits), dim=1)
    loss_base = lse_base - torch.from_numpy(logits)[torch.arange(num_positions), torch.from_numpy(targets).long()]
    assert_parity(torch.from_numpy(lse), torch.from_numpy(lse_oracle), lse_base, kind="output",
                  dtype=torch.float32, name="lse")
    assert_parity(torch.from_numpy(loss), torch.from_numpy(loss_oracle), loss_base, kind="output",
                  dtype=torch.float32, name="loss")
    report = sim.last_run()
    gathers = [e for e in report.trace if e.opcode == "dma_copy" and e.reads[0].shape == (1, 1)
               and e.reads[0].memory != "sbuf"]
    assert report.grid == grid and len(gathers) == num_positions  # one target-logit gather per row


def test_cross_entropy_platform_target_jit_option_is_refused(nki_modules):
    """The library's ``@nki.jit(platform_target="trn2")`` spelling: removed in NKI 0.3 (§2.1)."""
    nki, _, _ = nki_modules
    with pytest.raises(TypeError, match="platform_target"):
        nki.jit(platform_target="trn2")


# ---- gen_mask_tkg (iota with channel_multiplier, stride-0 .ap() replication on the Scalar
#      engine, tensor_scalar nl.less with a (P,1) operand, 5-D memset, .ap() batch select,
#      stride-0 HBM partition broadcast DMA, LNC2 s_prior sharding) -----------------------------

def _expected_mask(pos_ids, n_tile, q_head, s_active, block_len, strided, program_id):
    p = np.arange(sim.tile_size.pmax)[:, None]
    f = np.arange(n_tile)[None, :]
    base = program_id * sim.tile_size.pmax * n_tile
    if block_len:
        key = base + (f // block_len) * sim.tile_size.pmax * block_len + p * block_len + f % block_len
    elif strided:
        key = base + p * n_tile + f
    else:
        key = base + p + f * sim.tile_size.pmax
    first_pos = pos_ids[0, ::s_active]                                   # [bs]
    mask = key[:, :, None] < first_pos[None, None, :]                    # [P, n_tile, bs]
    return np.broadcast_to(mask[..., None, None], mask.shape + (q_head, s_active))


@pytest.mark.parametrize("layout", [dict(block_len=0, strided_mm1=True), dict(block_len=0, strided_mm1=False),
                                    dict(block_len=2, strided_mm1=True)], ids=["flat-strided", "flat", "block2"])
@pytest.mark.parametrize("grid", [1, 2])
def test_gen_mask_tkg(load_kernels, rng, layout, grid):
    k = load_kernels("kernels_nkilib_gen_mask")
    n_tile, q_head, s_active, bs = 4, 2, 2, 3
    pos_ids = rng.integers(0, 2 * sim.tile_size.pmax * n_tile, size=(1, bs * s_active)).astype(np.float32)
    kernel = k.gen_mask_kernel if grid == 1 else k.gen_mask_kernel[grid]
    mask = sim.simulate(kernel)(pos_ids, n_tile, q_head, s_active, **layout)
    assert mask.shape == (grid, sim.tile_size.pmax, n_tile, bs, q_head, s_active)
    for program_id in range(grid):
        expected = _expected_mask(pos_ids, n_tile, q_head, s_active, layout["block_len"],
                                  layout["strided_mm1"], program_id)
        np.testing.assert_array_equal(mask[program_id], expected.astype(np.float32))


# ---- cross_partition_copy (nc_stream_shuffle with the 255 keep-mask, partition-offset copies) --

@pytest.mark.parametrize("src_start, dst_start, count", [
    (0, 32, 40),    # dst quadrant-aligned: one tensor_copy
    (5, 37, 10),    # inside one dst quadrant: one shuffle
    (10, 10, 50),   # spans quadrants, remaining src aligned
    (3, 50, 60),    # spans quadrants, remaining src unaligned across two src quadrants
    (20, 33, 20),   # spans quadrants, remaining src unaligned within one src quadrant
])
def test_cross_partition_copy(load_kernels, rng, src_start, dst_start, count):
    k = load_kernels("kernels_nkilib_cross_partition_copy")
    src = rng.standard_normal((sim.tile_size.pmax, 24)).astype(np.float32)
    dst = rng.standard_normal((sim.tile_size.pmax, 24)).astype(np.float32)
    out = sim.simulate(k.cross_partition_copy_kernel)(src, dst, src_start, dst_start, count)
    expected = dst.copy()
    expected[dst_start:dst_start + count] = src[src_start:src_start + count]
    np.testing.assert_array_equal(out, expected)


# ---- RoPE (nki.tensor.identity + nl.shared_constant, stride-2 and stride-0 .ap() views,
#      permutation matmuls, activation copy out of PSUM, LNC2 sequence sharding) ---------------

def _rope_oracle(x, cos, sin, contiguous):
    x64, c64, s64 = (t.astype(np.float64) for t in (x, cos, sin))
    half = x.shape[0] // 2
    even, odd = (x64[:half], x64[half:]) if contiguous else (x64[0::2], x64[1::2])
    c, s = c64[:, :, None, :], s64[:, :, None, :]
    out_even, out_odd = even * c - odd * s, odd * c + even * s
    if contiguous:
        return np.concatenate([out_even, out_odd])
    out = np.empty_like(x64)
    out[0::2], out[1::2] = out_even, out_odd
    return out


def _rope_baseline(x, cos, sin, contiguous, dtype):
    tx, tc, ts = (torch.from_numpy(t.astype(np.float32)).to(dtype) for t in (x, cos, sin))
    half = x.shape[0] // 2
    even, odd = (tx[:half], tx[half:]) if contiguous else (tx[0::2], tx[1::2])
    c, s = tc[:, :, None, :], ts[:, :, None, :]
    out_even, out_odd = even * c - odd * s, odd * c + even * s
    if contiguous:
        return torch.cat([out_even, out_odd])
    out = torch.empty_like(tx)
    out[0::2], out[1::2] = out_even, out_odd
    return out


@pytest.mark.parametrize("mode", [dict(contiguous_layout=True), dict(contiguous_layout=False),
                                  dict(contiguous_layout=False, relayout_in_sbuf=True)],
                         ids=["contiguous", "interleaved-dma", "interleaved-matmul"])
@pytest.mark.parametrize("grid", [1, 2])
def test_rope(load_kernels, rng, mode, grid):
    k = load_kernels("kernels_nkilib_rope")
    d_head, b, heads, s = 64, 2, 3, 8
    x = rng.standard_normal((d_head, b, heads, s)).astype(np.float32)
    angle = rng.uniform(-np.pi, np.pi, size=(d_head // 2, b, s))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    kernel = k.RoPE if grid == 1 else k.RoPE[grid]
    out = sim.simulate(kernel)(x, cos, sin, lnc_shard=grid > 1, **mode)
    contiguous = mode["contiguous_layout"]
    assert_parity(torch.from_numpy(out), torch.from_numpy(_rope_oracle(x, cos, sin, contiguous)),
                  _rope_baseline(x, cos, sin, contiguous, torch.float32), kind="output",
                  dtype=torch.float32, name="rope")
    if mode.get("relayout_in_sbuf"):
        assert sum(e.opcode == "nc_matmul" for e in sim.last_run().trace) == 2 * grid


def test_nki_tensor_trace_time_constants(nki_modules):
    """``nki.tensor.identity`` / ``zeros`` (the trace-time data ``nl.shared_constant`` takes)."""
    import nki.tensor as ntensor
    from nki.tensor import identity, zeros

    _, nl, _ = nki_modules
    eye = ntensor.identity(4, dtype=nl.int8)
    assert identity is ntensor.identity and eye.dtype == np.int8
    np.testing.assert_array_equal(eye, np.eye(4))
    assert zeros((2, 3), nl.bfloat16).dtype == BF16 and not zeros(5, nl.float32).any()
    with pytest.raises(ValueError, match="n must be"):
        ntensor.identity(0, nl.float32)


# ---- MLP normalisations (activation_reduce, activation with (P,1) bias and tile scale,
#      bn_stats / bn_aggr, two-operand tensor_scalar) -----------------------------------------

EPS = 1e-5


@pytest.mark.parametrize("shape", [(100, 1000), (128, 64)])
def test_mlp_rms_norm(load_kernels, rng, shape):
    k = load_kernels("kernels_nkilib_norm")
    x = rng.standard_normal(shape).astype(np.float32)
    out = sim.simulate(k.rms_norm_kernel)(x, EPS)
    x64 = x.astype(np.float64)
    oracle = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + EPS)
    tx = torch.from_numpy(x)
    baseline = tx * torch.rsqrt(tx.square().mean(dim=1, keepdim=True) + EPS)
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), baseline, kind="output",
                  dtype=torch.float32, name="rms_norm")


@pytest.mark.parametrize("shape", [(100, 1000), (128, 64)])
def test_mlp_layer_norm(load_kernels, rng, shape):
    k = load_kernels("kernels_nkilib_norm")
    x = (rng.standard_normal(shape) + 3.0).astype(np.float32)
    out = sim.simulate(k.layer_norm_kernel)(x, EPS)
    x64 = x.astype(np.float64)
    oracle = (x64 - x64.mean(axis=1, keepdims=True)) / np.sqrt(x64.var(axis=1, keepdims=True) + EPS)
    baseline = torch.nn.functional.layer_norm(torch.from_numpy(x), (shape[1],), eps=EPS)
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), baseline, kind="output",
                  dtype=torch.float32, name="layer_norm")


# ---- MoE block gather + PE transpose (vector_offset gather with oob_mode, get_nc_version,
#      shared_identity_matrix, nc_matmul(is_transpose=True) into 16-bit PSUM slices) -----------

@pytest.mark.parametrize("skip_token", [False, True])
def test_moe_block_gather_transpose(load_kernels, rng, any_target, skip_token):
    k = load_kernels("kernels_nkilib_moe_block")
    tokens, hidden, block = 300, 256, 256
    x = rng.standard_normal((tokens, hidden)).astype(BF16)
    ids = rng.integers(0, tokens, size=block).astype(np.int32)
    if skip_token:
        ids[::7] = tokens + 5                      # out of range: rows skipped, tile keeps its zeros
    out = sim.simulate(k.moe_block_gather_transpose)(x, ids, skip_token=skip_token)
    expected = np.where((ids < tokens)[None, :], x[np.minimum(ids, tokens - 1)].T.astype(np.float32), 0.0)
    np.testing.assert_array_equal(out.astype(np.float32), expected)
    transposes = [e for e in sim.last_run().trace if e.opcode == "nc_matmul"]
    assert len(transposes) == 4 and all(e.attrs["is_transpose"] for e in transposes)


def test_moe_block_gather_out_of_range_token_raises_without_skip(load_kernels, rng):
    k = load_kernels("kernels_nkilib_moe_block")
    x = rng.standard_normal((300, 128)).astype(BF16)
    ids = np.full(128, 400, dtype=np.int32)
    with pytest.raises(sim.NKIRuleError) as info:
        sim.simulate(k.moe_block_gather_transpose)(x, ids)
    assert info.value.instruction == "dma_copy"


# ---- rmsnorm_tkg [T, H] with H sharded over LNC2 (sendrecv on the GpSimd DMA, immediate bias) --

@pytest.mark.parametrize("grid", [1, 2])
def test_rmsnorm_tkg_shard_on_h(load_kernels, rng, trn2, grid):
    k = load_kernels("kernels_nkilib_rmsnorm_tkg")
    x = rng.standard_normal((150, 512)).astype(np.float32)
    kernel = k.rmsnorm_tkg_shard_on_h if grid == 1 else k.rmsnorm_tkg_shard_on_h[grid]
    out = sim.simulate(kernel)(x, EPS)
    x64 = x.astype(np.float64)
    oracle = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + EPS)
    tx = torch.from_numpy(x)
    baseline = tx * torch.rsqrt(tx.square().mean(dim=1, keepdim=True) + EPS)
    assert_parity(torch.from_numpy(out), torch.from_numpy(oracle), baseline, kind="output",
                  dtype=torch.float32, name="rmsnorm_tkg")
    exchanges = [e for e in sim.last_run().trace if e.opcode == "sendrecv"]
    assert len(exchanges) == (0 if grid == 1 else 2 * 2)  # two T tiles on each of the two cores
