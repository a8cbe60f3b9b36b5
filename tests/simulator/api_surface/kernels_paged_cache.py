"""Write new key/value rows into cache slots chosen at run time (written for this project).

``write_to_slots(k_new, v_new, k_cache, v_cache, slots)``: k_new, v_new (T, D); k_cache,
v_cache (N, D) updated in place: k_cache[slots[t]] = k_new[t] (likewise v) for every token t
whose slot is < N; a slot >= N (padding) is skipped. Returns the two caches. Dimension legend:
T new tokens (<= pmax), D row width, N cache slots.

Algorithm: the slot ids are loaded onto one partition; the new rows are loaded onto T partitions;
each row is written by its own DMA whose HBM destination is
``cache.ap([[D, 1], [1, D]], scalar_offset=slot, indirect_dim=0)`` with ``oob_mode.skip``.
Under LNC2 program 0 writes the key cache and program 1 the value cache (different work on the
two cores); under LNC1 one program writes both.
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _write_rows(new_rows, cache, slots_sb):
    n_tokens, width = new_rows.shape
    rows_sb = nl.ndarray((n_tokens, width), dtype=cache.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows_sb, src=new_rows)
    for t in range(n_tokens):
        slot_row = cache.ap([[width, 1], [1, width]], offset=0, scalar_offset=slots_sb[0:1, t:t + 1],
                            indirect_dim=0)
        nisa.dma_copy(dst=slot_row, src=rows_sb[t:t + 1, :], oob_mode=nisa.oob_mode.skip)


@nki.jit
def write_to_slots(k_new, v_new, k_cache, v_cache, slots):
    n_tokens = slots.shape[0]
    slots_sb = nl.ndarray((1, n_tokens), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=slots_sb, src=slots)
    pid = nl.program_id(axis=0)
    pairs = ((k_new, k_cache), (v_new, v_cache))
    mine = pairs if nl.num_programs(axes=0) == 1 else (pairs[pid],)
    for new_rows, cache in mine:
        _write_rows(new_rows, cache, slots_sb)
    return k_cache, v_cache
