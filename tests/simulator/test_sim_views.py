"""NkiTensor view methods (docs/nki-semantics.md §4.1, §4.2): slice, select, permute, broadcast, expand_dim /
squeeze_dim, reshape_dim, flatten_dims, reshape, is_contiguous, and the on-chip partition-dim
restrictions. Every view is materialised with tensor_copy / dma_copy and compared with NumPy.
"""

import numpy as np
import pytest
from sim_helpers import run_tiles

from nki_lib.simulator import NKIRuleError, jit, simulate
from nki_lib.simulator import isa as nisa
from nki_lib.simulator import language as nl

P, A, B = 8, 6, 5


def _materialise(view):
    out_sb = nl.ndarray(view.shape, dtype=view.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out_sb, src=view)
    return out_sb


@pytest.fixture
def x3(rng):
    return rng.standard_normal((P, A * B)).astype(np.float32)


def _as3d(x_sb):
    t3 = nl.ndarray((P, A, B), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=t3, src=x_sb)
    return t3


def test_slice_select_permute(x3):
    def views(x_sb):
        t3 = _as3d(x_sb)
        return (_materialise(t3.slice(1, 1, 5, step=2)), _materialise(t3.select(2, 3)),
                _materialise(t3.permute((0, 2, 1))))

    sliced, selected, permuted = run_tiles(views, x3)
    ref = x3.reshape(P, A, B)
    np.testing.assert_array_equal(sliced, ref[:, 1:5:2, :])
    np.testing.assert_array_equal(selected, ref[:, :, 3])
    np.testing.assert_array_equal(permuted, ref.transpose(0, 2, 1))


def test_broadcast_expand_squeeze(x3):
    def views(x_sb):
        col = x_sb[:, 2:3]                                   # (P, 1)
        wide = col.broadcast(1, 7)                           # stride-0 read
        grown = x_sb.expand_dim(1)                           # (P, 1, A*B)
        return _materialise(wide), _materialise(grown), _materialise(grown.squeeze_dim(1))

    wide, grown, squeezed = run_tiles(views, x3)
    np.testing.assert_array_equal(wide, np.repeat(x3[:, 2:3], 7, axis=1))
    np.testing.assert_array_equal(grown, x3[:, None, :])
    np.testing.assert_array_equal(squeezed, x3)


def test_reshape_dim_flatten_dims_reshape(x3):
    def views(x_sb):
        split = x_sb.reshape_dim(1, (A, -1))                 # (P, A, B)
        merged = split.flatten_dims(1, 2)                    # (P, A*B)
        reshaped = x_sb.reshape((P, B, A))
        return _materialise(split), _materialise(merged), _materialise(reshaped)

    split, merged, reshaped = run_tiles(views, x3)
    np.testing.assert_array_equal(split, x3.reshape(P, A, B))
    np.testing.assert_array_equal(merged, x3)
    np.testing.assert_array_equal(reshaped, x3.reshape(P, B, A))


def test_is_contiguous_and_partition_restrictions():
    seen = {}

    @jit
    def probe(x_hbm):
        t = nl.ndarray((P, A, B), dtype=nl.float32, buffer=nl.sbuf)
        seen["full"] = t.is_contiguous()
        seen["partition_slice"] = t[2:6].is_contiguous()      # partition dim ignored on chip
        seen["free_step"] = t[:, 0:A:2, :].is_contiguous()
        seen["hbm_row"] = x_hbm[1:3].is_contiguous()
        for name, make in (("permute_partition", lambda: t.permute((1, 0, 2))),
                           ("broadcast_partition", lambda: t[0:1].broadcast(0, 4)),
                           ("reshape_partition", lambda: t.reshape((P * A, B)))):
            try:
                make()
                seen[name] = "accepted"
            except NKIRuleError:
                seen[name] = "rejected"
        return x_hbm

    simulate(probe)(np.zeros((4, 4), np.float32))
    assert seen == {"full": True, "partition_slice": True, "free_step": False, "hbm_row": True,
                    "permute_partition": "rejected", "broadcast_partition": "rejected",
                    "reshape_partition": "rejected"}
