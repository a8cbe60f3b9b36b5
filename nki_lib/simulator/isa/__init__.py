"""``nki.isa`` for the simulator: every instruction of docs/nki-semantics.md §1 plus the enums."""

from __future__ import annotations

import importlib.util as _ilu

from ..errors import NKIRuleError as NkiValidationError
from ..tensor import VirtualRegister
from . import constants
from ._common import NkiInstruction
from .constants import (
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    sync_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)
from .dma import dma_compute, dma_copy, dma_transpose
from .gpsimd import affine_select, iota, local_gather, nonzero_with_count, tensor_partition_reduce
from .pe import nc_matmul, nc_transpose
from .scalar import activation, activation_reduce
from .sync import (
    core_barrier,
    get_nc_sub_version,
    get_nc_version,
    register_alloc,
    register_load,
    register_move,
    register_store,
    sendrecv,
)
from .vector import (
    max8,
    memset,
    nc_find_index8,
    nc_stream_shuffle,
    range_select,
    reciprocal,
    scalar_tensor_tensor,
    tensor_copy,
    tensor_copy_predicated,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
)

if _ilu.find_spec(__name__ + ".extra") is not None:  # rarely used + MX instructions, maintained separately
    from .extra import *  # noqa: F401,F403


def _accept_enum_values_everywhere():
    """Every public instruction takes an enum parameter's value as well as the member (``_enums.py``)."""
    from ._enums import accept_enum_values

    namespace = globals()
    for name, value in list(namespace.items()):
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", "").startswith(__name__ + "."):
            if not isinstance(value, type):
                namespace[name] = accept_enum_values(value)


_accept_enum_values_everywhere()
