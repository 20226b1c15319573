"""Facts of the tensor-core hardware the templates are written for (NVIDIA Hopper, sm_90a): instruction
shapes, warp and warpgroup sizes, the copy engine's box and swizzle sizes. One home for each; the numbers a
particular GPU reports (SMs, shared memory, registers) are device_limits.py's."""

WARP_THREADS = 32
WARPGROUP_WARPS = 4                                  # a wgmma is issued by 4 warps together
WARPGROUP_THREADS = WARPGROUP_WARPS * WARP_THREADS   # 128

MMA_ROWS = 16         # mma.sync m16n8k16: rows of one MMA tile (a warp's share of a tile is a multiple of it)
MMA_K = 16            # mma.sync m16n8k16: head-dim columns per k step (and per ldmatrix.x4 row pair)
WGMMA_ROWS = 64       # wgmma m64nNk16: rows of one warpgroup's MMA

PANEL_COLUMNS = 64    # 16-bit columns of one 128-byte swizzled panel (a TMA box row, a wgmma operand row)
PANEL_ROW_BYTES = 128
SWIZZLE_ATOM = 1024   # 8 swizzled 128-byte rows: panels start on this alignment
TMA_BOX_MAX = 256     # elements of one TMA box dimension
MBARRIER_BYTES = 8

MAX_GRID_YZ = 65535   # a launch grid's y and z dimensions
