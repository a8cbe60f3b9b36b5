"""Cross-entropy forward (online log-sum-exp), from the AWS NKI Library, re-typed.

Source: aws-neuron/nki-library, src/nkilib_src/nkilib/core/loss/cross_entropy.py
(``cross_entropy_forward``), Copyright Amazon.com, Apache-2.0. Re-typed by hand with the same
structure, calls and arguments (not copied verbatim; the input validation helper and the
``name=`` strings are shortened); comments are ours.
Deviation: the library decorates it ``@nki.jit(platform_target="trn2")``; nki-api.md §2.1 says
``platform_target=`` was removed in NKI 0.3 (the target comes from
``NEURON_PLATFORM_TARGET_OVERRIDE``) and the simulator raises on it, so this copy uses ``@nki.jit``
and the test selects trn2 with ``set_target``.

Algorithm: positions are split between the LNC programs (the last takes the remainder); per
batch of ``positions_per_batch`` rows the vocabulary is walked in ``chunk_size`` chunks keeping a
running max m and sum d (``tensor_reduce``, ``tensor_tensor``, ``activation(exp)``,
``tensor_scalar``); lse = m + log(d); the target logit is gathered with a dynamic DMA
(``.ap(scalar_offset=..., indirect_dim=1)``); loss = lse - target logit.
Shapes: logits [N, V], targets [N] int32 -> loss [N], lse [N] (``dtype``).
Limits: positions_per_batch <= 128; chunk_size <= V.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from kernels_nkilib_helpers import div_ceil, get_verified_program_sharding_info


@nki.jit
def cross_entropy_forward(logits_hbm, targets_hbm, positions_per_batch=32, chunk_size=32768,
                          dtype: nki.dtype = nl.bfloat16):
    assert 0 < positions_per_batch <= nl.tile_size.pmax and chunk_size <= logits_hbm.shape[1]
    _, num_cores, core_id = get_verified_program_sharding_info("cross_entropy_forward", (0, 1))

    num_positions, vocab_size = logits_hbm.shape
    num_chunks = div_ceil(vocab_size, chunk_size)
    loss_hbm = nl.ndarray((num_positions,), dtype=dtype, buffer=nl.shared_hbm)
    lse_state_hbm = nl.ndarray((num_positions,), dtype=dtype, buffer=nl.shared_hbm)

    nominal_per_core = num_positions // num_cores
    shard_offset = core_id * nominal_per_core
    positions_per_core = num_positions - shard_offset if core_id == num_cores - 1 else nominal_per_core

    position_idx = nl.ds(shard_offset, positions_per_core)
    targets_shard_hbm = targets_hbm[position_idx]
    loss_shard_hbm = loss_hbm[position_idx]
    lse_state_shard_hbm = lse_state_hbm[position_idx]
    num_batches = div_ceil(positions_per_core, positions_per_batch)

    ppb = positions_per_batch
    batch_targets = nl.ndarray((ppb, 1), dtype=nl.int32, buffer=nl.sbuf)
    batch_m = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_d = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_chunk = nl.ndarray((ppb, chunk_size), dtype=dtype, buffer=nl.sbuf)
    batch_chunk_max = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_m_new = nl.ndarray((ppb, 1), dtype=nl.float32, buffer=nl.sbuf)
    batch_m_diff = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_correction = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_d_corrected = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_exp_chunk = nl.ndarray((ppb, chunk_size), dtype=dtype, buffer=nl.sbuf)
    batch_sum_exp = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_d_new = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_log_d = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_lse = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_target_logits = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)
    batch_loss = nl.ndarray((ppb, 1), dtype=dtype, buffer=nl.sbuf)

    for batch_idx in range(num_batches):
        start = batch_idx * ppb
        rows = min(ppb, positions_per_core - start)
        if rows <= 0:
            break

        nisa.memset(dst=batch_m, value=-float("inf"), name=f"init_m_{batch_idx}")
        nisa.memset(dst=batch_d, value=0.0, name=f"init_d_{batch_idx}")
        nisa.dma_copy(dst=batch_targets[0:rows], src=targets_shard_hbm[start:start + rows],
                      name=f"load_targets_{batch_idx}")

        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(chunk_start + chunk_size, vocab_size)
            chunk_len = chunk_end - chunk_start
            if chunk_len < chunk_size:
                nisa.memset(dst=batch_chunk, value=-float("inf"))
            nisa.dma_copy(dst=batch_chunk[0:rows, 0:chunk_len],
                          src=logits_hbm[shard_offset + start:shard_offset + start + rows, chunk_start:chunk_end])

            nisa.tensor_reduce(op=nl.maximum, data=batch_chunk, dst=batch_chunk_max, axis=1)
            nisa.tensor_tensor(dst=batch_m_new, data1=batch_m, data2=batch_chunk_max, op=nl.maximum)
            nisa.tensor_tensor(dst=batch_m_diff, data1=batch_m, data2=batch_m_new, op=nl.subtract)
            nisa.activation(op=nl.exp, data=batch_m_diff, dst=batch_correction)
            nisa.tensor_tensor(dst=batch_d_corrected, data1=batch_d, data2=batch_correction, op=nl.multiply)
            nisa.tensor_scalar(dst=batch_exp_chunk, data=batch_chunk, op0=nl.subtract, operand0=batch_m_new)
            nisa.activation(op=nl.exp, data=batch_exp_chunk, dst=batch_exp_chunk)
            nisa.tensor_reduce(op=nl.add, data=batch_exp_chunk, dst=batch_sum_exp, axis=1)
            nisa.tensor_tensor(dst=batch_d_new, data1=batch_d_corrected, data2=batch_sum_exp, op=nl.add)
            nisa.tensor_copy(src=batch_m_new, dst=batch_m)
            nisa.tensor_copy(src=batch_d_new, dst=batch_d)

        nisa.activation(op=nl.log, data=batch_d, dst=batch_log_d)
        nisa.tensor_tensor(dst=batch_lse, data1=batch_m, data2=batch_log_d, op=nl.add)

        for position in range(rows):
            absolute_position = shard_offset + start + position
            nisa.dma_copy(
                dst=batch_target_logits[position:position + 1, :],
                src=logits_hbm.ap(pattern=[[vocab_size, 1], [1, 1]], offset=absolute_position * vocab_size,
                                  scalar_offset=batch_targets.ap(pattern=[[1, 1], [1, 1]], offset=position),
                                  indirect_dim=1))

        nisa.tensor_tensor(dst=batch_loss, data1=batch_lse, data2=batch_target_logits, op=nl.subtract)
        nisa.dma_copy(dst=lse_state_shard_hbm[start:start + rows], src=batch_lse[0:rows, 0])
        nisa.dma_copy(dst=loss_shard_hbm[start:start + rows], src=batch_loss[0:rows, 0])

    return loss_hbm, lse_state_hbm
