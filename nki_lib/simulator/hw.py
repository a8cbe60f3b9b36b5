"""Fixed hardware constants used by instruction checks (docs/nki-semantics.md §3, §8); per-target sizes are in target.py."""

import math

QUADRANT = 32                       # partitions per VectorE shuffle / transpose quadrant
VECTOR_TRANSPOSE_MAX = 32           # VectorE nc_transpose: P, F <= 32
GPSIMD_CORE_PARTITIONS = 16         # GpSimd: 8 cores x 16 partitions
MAX_FREE_DIMS = 4                   # free dims of one hardware access pattern
FREE_MAX_SBUF = 65536               # compute-engine operand: elements per partition in SBUF
FREE_MAX_PSUM = 4096                # compute-engine operand: elements per partition in PSUM
TOPK_WIDTH = 8                      # max8 / nc_find_index8 values per partition
TOPK_MAX_FREE = 16384               # max8 / nc_find_index8: elements per partition
SHUFFLE_KEEP = 255                  # nc_stream_shuffle mask entry that leaves dst unchanged
GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}   # sendrecv gpsimd_dma: bytes per partition by itemsize
MATMUL_TILE_SIZES = (32, 64, 128)   # nc_matmul tile_size entries (32 needs NC-v3+)
LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)
DGE_TRANSPOSE_ROWS = 16             # dma_transpose on the HW DGE: source rows (every rank); indirect: row granule
DGE_TRANSPOSE_LAST_GRANULE = 128    # dma_transpose on the HW DGE: the source's last dim is a multiple of this
DGE_TRANSPOSE_MAX_LAST = 128        # indirect dma_transpose: max elements of the source's last dim
# Scalar-engine activations whose hardware approximation is only valid on a narrow input range
# (docs/nki-semantics.md §7.3): outside it the hardware returns garbage (e.g. sin has no range reduction)
ACTIVATION_RANGES = {"sin": (-math.pi, math.pi), "arctan": (-math.pi / 2, math.pi / 2)}
