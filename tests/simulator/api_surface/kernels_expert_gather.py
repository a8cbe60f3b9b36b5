"""Gather an expert's token rows by index, weight them, and emit them hidden-major (written for
this project).

``gather_weighted_transposed(x, slot_tokens, slot_weights, skip_missing)``: x (T, H) bf16 token
activations, slot_tokens (S,) int32 token ids, slot_weights (S, 1) fp32. Returns out (H, S) bf16
with out[:, s] = slot_weights[s] * x[slot_tokens[s], :]; a slot whose id is >= T is left 0 when
``skip_missing`` and is an error otherwise. Dimension legend: T tokens, H hidden (% pmax == 0),
S slots (% pmax == 0), P = pmax.

Algorithm: per group of P slots, the ids are loaded as a (P, 1) column and one DMA gathers the P
rows with ``.ap(vector_offset=ids, indirect_dim=0)`` into a zeroed (P, H) tile, ``oob_mode.skip``
or ``oob_mode.error``; rows are scaled by their weight (``tensor_scalar``, bf16 out). Each (P, P)
block of the tile is transposed on the Tensor engine: on NeuronCore v3+ (``get_nc_version``) a
matmul in transpose mode against ``nl.shared_identity_matrix`` writing bf16 PSUM, otherwise
``nc_transpose``. Blocks are copied to SBUF and stored at out[h block, slot group].
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _gathered_rows(x, slot_tokens, slot_weights, s0, skip_missing):
    pmax = nl.tile_size.pmax
    hidden = x.shape[1]
    ids_sb = nl.ndarray((pmax, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ids_sb, src=slot_tokens[nl.ds(s0, pmax)])
    rows_sb = nl.ndarray((pmax, hidden), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=rows_sb, value=0.0)
    mode = nisa.oob_mode.skip if skip_missing else nisa.oob_mode.error
    nisa.dma_copy(dst=rows_sb, src=x.ap([[hidden, pmax], [1, hidden]], offset=0, vector_offset=ids_sb,
                                        indirect_dim=0), oob_mode=mode)
    weight_sb = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=weight_sb, src=slot_weights[nl.ds(s0, pmax), :])
    nisa.tensor_scalar(dst=rows_sb, data=rows_sb, op0=nl.multiply, operand0=weight_sb)
    return rows_sb


def _transpose_block(block_sb, identity_sb):
    pmax = nl.tile_size.pmax
    t_psum = nl.ndarray((pmax, pmax), dtype=block_sb.dtype, buffer=nl.psum)
    if nisa.get_nc_version() >= nisa.nc_version.gen3:
        nisa.nc_matmul(dst=t_psum, stationary=block_sb, moving=identity_sb, is_transpose=True)
    else:
        nisa.nc_transpose(dst=t_psum, data=block_sb, engine=nisa.tensor_engine)
    t_sb = nl.ndarray((pmax, pmax), dtype=block_sb.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t_sb, src=t_psum)
    return t_sb


@nki.jit
def gather_weighted_transposed(x, slot_tokens, slot_weights, skip_missing):
    hidden = x.shape[1]
    n_slots = slot_tokens.shape[0]
    pmax = nl.tile_size.pmax
    out = nl.ndarray((hidden, n_slots), dtype=x.dtype, buffer=nl.shared_hbm)
    identity_sb = nl.shared_identity_matrix(pmax, dtype=x.dtype)
    for s0 in range(0, n_slots, pmax):
        rows_sb = _gathered_rows(x, slot_tokens, slot_weights, s0, skip_missing)
        for h0 in range(0, hidden, pmax):
            block_t_sb = _transpose_block(rows_sb[:, nl.ds(h0, pmax)], identity_sb)
            nisa.dma_copy(dst=out[nl.ds(h0, pmax), nl.ds(s0, pmax)], src=block_t_sb)
    return out
