"""Rotary position embedding, from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/embeddings/rope.py (``RoPE``,
``RoPE_sbuf``, ``_compute_convert_to_interleaved_mat``, ``_convert_from_interleaved``,
``_convert_to_interleaved``), Copyright Amazon.com, Apache-2.0. Re-typed by hand with the same
structure, calls and arguments (not copied verbatim); comments are ours. The library's
``TensorView(...).slice(step=2)`` / ``.expand_dim(2).broadcast(2, n)`` views are written here as
the equivalent ``.ap()`` views (TensorView builds them with ``.ap()``); input validation trimmed.

Algorithm: x [d, B, H, S] (d on partitions) and cos/sin [d/2, B, S] are DMA'd in (an LNC2 launch
with ``lnc_shard`` splits S); out_even = even*cos - odd*sin, out_odd = odd*cos + even*sin with
``tensor_tensor`` reading cos/sin through a stride-0 ``.ap()`` over the head dim. Interleaved
layouts ([e0, o0, e1, o1, ...] along d) are converted either by stride-2 DMAs or, when
B*H*S <= gemm_moving_fmax and ``relayout_in_sbuf``, by permutation matmuls built from
``nl.shared_constant(nki.tensor.identity(d, nl.float32))`` (``.ap()`` with a stride-2 read,
``nc_transpose``, ``nc_matmul``, ``activation(op=nl.copy)`` out of PSUM).
Shapes: x, out [d_head, B, n_heads, S]; cos, sin [d_head // 2, B, S]. Limits: d_head in {64, 128}.
"""

import nki
import nki.isa as nisa
import nki.language as nl
import nki.tensor as ntensor

from kernels_nkilib_helpers import get_verified_program_sharding_info, kernel_assert


def _d_strided(t, start, tile_start, tile_size):
    """t[start::2, :, :, tile_start:tile_start + tile_size] of an HBM [d, B, H, S] tensor, as ``.ap()``."""
    d_head, b, heads, s = t.shape
    return t.ap(pattern=[[2 * b * heads * s, d_head // 2], [heads * s, b], [s, heads], [1, tile_size]],
                offset=start * b * heads * s + tile_start)


def _bcast_heads(t, heads):
    """An SBUF [d/2, B, S] tile read as [d/2, B, heads, S] (stride 0 over heads), as ``.ap()``."""
    half_d, b, s = t.shape
    return t.ap(pattern=[[b * s, half_d], [s, b], [0, heads], [1, s]])


@nki.jit
def RoPE(x_in, cos, sin, lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False):
    d_head, B, n_heads, S = x_in.shape
    kernel_assert(d_head in (64, 128), f"d_head must be 64 or 128, got {d_head}")
    half_d = d_head // 2
    n_prgs, prg_id = 1, 0
    if lnc_shard:
        _, n_prgs, prg_id = get_verified_program_sharding_info("RoPE", (0, 1))
    kernel_assert(S % n_prgs == 0, f"S={S} not divisible by {n_prgs} programs")
    tile_size = S // n_prgs
    tile_start = tile_size * prg_id

    sbuf_relayout_ok = B * n_heads * S <= nl.tile_size.gemm_moving_fmax
    is_dma_relayout = not contiguous_layout and (not relayout_in_sbuf or not sbuf_relayout_ok)
    is_relayout_in_sbuf = not contiguous_layout and relayout_in_sbuf and sbuf_relayout_ok

    x_in_sb = nl.ndarray((d_head, B, n_heads, tile_size), dtype=x_in.dtype, buffer=nl.sbuf)
    if is_dma_relayout:
        nisa.dma_copy(dst=x_in_sb[:half_d, :, :, :], src=_d_strided(x_in, 0, tile_start, tile_size))
        nisa.dma_copy(dst=x_in_sb[half_d:, :, :, :], src=_d_strided(x_in, 1, tile_start, tile_size))
    else:
        nisa.dma_copy(dst=x_in_sb, src=x_in[:, :, :, tile_start:tile_start + tile_size])

    cos_sb = nl.ndarray((half_d, B, tile_size), dtype=cos.dtype, buffer=nl.sbuf)
    sin_sb = nl.ndarray((half_d, B, tile_size), dtype=sin.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=cos_sb, src=cos[:, :, tile_start:tile_start + tile_size])
    nisa.dma_copy(dst=sin_sb, src=sin[:, :, tile_start:tile_start + tile_size])

    x_out_sb = nl.ndarray(x_in_sb.shape, dtype=x_in_sb.dtype, buffer=nl.sbuf)
    RoPE_sbuf(x_in_sb, cos_sb, sin_sb, x_out_sb, convert_from_interleaved=is_relayout_in_sbuf)

    x_out = nl.ndarray(x_in.shape, dtype=x_in.dtype, buffer=nl.shared_hbm)
    if is_dma_relayout:
        nisa.dma_copy(dst=_d_strided(x_out, 0, tile_start, tile_size), src=x_out_sb[:half_d, :, :, :])
        nisa.dma_copy(dst=_d_strided(x_out, 1, tile_start, tile_size), src=x_out_sb[half_d:, :, :, :])
    else:
        nisa.dma_copy(dst=x_out[:, :, :, tile_start:tile_start + tile_size], src=x_out_sb)
    return x_out


def RoPE_sbuf(x_in_sb, cos_sb, sin_sb, x_out_sb, convert_from_interleaved=False):
    d_head, B, n_heads, S = x_out_sb.shape
    half_d = d_head // 2
    if convert_from_interleaved:
        perm = _compute_convert_to_interleaved_mat(x_in_sb)
        x_in_sb = _convert_from_interleaved(x_in_sb, perm)

    sb_odd = nl.ndarray((half_d, B, n_heads, S), dtype=x_in_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=sb_odd, src=x_in_sb[half_d:, :, :, :])
    even_cos = nl.ndarray((half_d, B, n_heads, S), dtype=x_in_sb.dtype, buffer=nl.sbuf)
    odd_cos = nl.ndarray((half_d, B, n_heads, S), dtype=x_in_sb.dtype, buffer=nl.sbuf)
    even_sin = nl.ndarray((half_d, B, n_heads, S), dtype=x_in_sb.dtype, buffer=nl.sbuf)
    odd_sin = nl.ndarray((half_d, B, n_heads, S), dtype=x_in_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(even_cos, x_in_sb[:half_d, :, :, :], _bcast_heads(cos_sb, n_heads), nl.multiply)
    nisa.tensor_tensor(odd_cos, sb_odd[:half_d, :, :, :], _bcast_heads(cos_sb, n_heads), nl.multiply)
    nisa.tensor_tensor(even_sin, x_in_sb[:half_d, :, :, :], _bcast_heads(sin_sb, n_heads), nl.multiply)
    nisa.tensor_tensor(odd_sin, sb_odd[:half_d, :, :, :], _bcast_heads(sin_sb, n_heads), nl.multiply)
    nisa.tensor_tensor(x_out_sb[:half_d, :, :, :], even_cos, odd_sin, nl.subtract)
    nisa.tensor_tensor(x_out_sb[half_d:, :, :, :], odd_cos, even_sin, nl.add)

    if convert_from_interleaved:
        x_out_sb = _convert_to_interleaved(x_out_sb, perm)
    return x_out_sb


def _compute_convert_to_interleaved_mat(x_sb):
    d_head, B, n_heads, S = x_sb.shape
    half_d = d_head // 2
    identity_hbm = nl.shared_constant(ntensor.identity(d_head, nl.float32))
    identity_sb = nl.ndarray((d_head, d_head), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=identity_sb, src=identity_hbm)
    perm = nl.ndarray((d_head, d_head), dtype=x_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=perm.reshape((d_head, 2, half_d)),
                     src=identity_sb.ap(pattern=[[d_head, d_head], [1, 2], [2, half_d]]),
                     engine=nisa.scalar_engine)
    return perm


def _convert_from_interleaved(x_sb, perm):
    d_head, B, n_heads, S = x_sb.shape
    x_converted_sb = nl.ndarray(x_sb.shape, dtype=x_sb.dtype, buffer=nl.sbuf)
    x_psum = nl.ndarray((d_head, B * n_heads * S), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=x_psum, stationary=perm, moving=x_sb.reshape((d_head, B * n_heads * S)))
    nisa.activation(dst=x_converted_sb, op=nl.copy, data=x_psum.reshape((d_head, B, n_heads, S)))
    return x_converted_sb


def _convert_to_interleaved(x_sb, perm):
    d_head, B, n_heads, S = x_sb.shape
    perm_t_sb = nl.ndarray((d_head, d_head), dtype=perm.dtype, buffer=nl.sbuf)
    perm_t_psum = nl.ndarray((d_head, d_head), dtype=perm.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=perm_t_psum, data=perm)
    nisa.tensor_copy(dst=perm_t_sb, src=perm_t_psum, engine=nisa.scalar_engine)
    x_psum = nl.ndarray((d_head, B * n_heads * S), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=x_psum, stationary=perm_t_sb, moving=x_sb.reshape((d_head, B * n_heads * S)))
    nisa.tensor_copy(dst=x_sb, src=x_psum.reshape((d_head, B, n_heads, S)), engine=nisa.scalar_engine)
    return x_sb
