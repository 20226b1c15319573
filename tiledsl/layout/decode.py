"""The decode family's layout: a 16-row query tile, K and V rings split across warps along kv, the warps'
partials for the combine, and an FP8 cache's e4m3 rings and conversion path; a paged cache's walk."""
from __future__ import annotations

from ..device_limits import SMEM_RESERVED_PER_BLOCK, DeviceLimits
from ..spec import DTYPE_BYTES, DType, KernelSpec
from .base import (
    REGISTER_OVERHEAD,
    SMEM_ALIGN,
    Buffer,
    Layout,
    Registers,
    align,
    buffers_end,
    finish,
    qkv_buffers,
    require,
    row_text,
    tile_row_bytes,
)

DECODE_COMBINE_PAD_FLOATS = 4  # the quads' float2 stores of a staged O row spread over the banks


def decode_layout(spec: KernelSpec, limits: DeviceLimits, stages: int | None = None,
                  tile_kv: int | None = None) -> Layout:
    p, s = spec.problem, spec.schedule
    stages = s.stages if stages is None else stages
    tile_kv = s.tile_kv if tile_kv is None else tile_kv
    # Two 16-row tiles (O alone 128 registers a thread) spill at 255 registers; groups of more
    # than 16 packed rows run as several row tiles instead, each in its own block.
    require(s.tile_q == 16, spec, "tile",
             f"decode packs query rows into one 16-row MMA tile; tile q = {s.tile_q} is not 16 (larger "
             "kv groups are split into several row tiles at launch)", "tile q = 16")
    require(tile_kv % (16 * s.warps) == 0 and tile_kv > 0, spec, "warps",
             f"{s.warps} warps along kv give tile kv = {tile_kv} / {s.warps} keys per warp; decode needs a multiple "
             f"of 16")
    require(p.head_dim_qk % 16 == 0 and p.head_dim_v % 16 == 0, spec, "head_dim",
             "decode needs head dims that are multiples of 16 (mma m16n8k16)")
    require(stages >= 1, spec, "pipeline", "decode needs at least one pipeline stage")
    require(not p.kv_fp8 or (p.head_dim_qk % 32 == 0 and p.head_dim_v % 32 == 0), spec, "kv_dtype",
             f"an FP8 KV cache needs head dims that are multiples of 32 (whole 16-byte chunks, two per row: a warp's "
             f"16-key slice is one cp.async pass); head dims are {p.head_dim_qk} / {p.head_dim_v}",
             "remove `kv_dtype`, or use head dims 32, 64, 96, 128, ...")
    convert = fp8_convert_of(spec)
    threads, m_tiles, keys_per_warp = s.warps * 32, s.tile_q // 16, tile_kv // s.warps
    qk_row, _ = tile_row_bytes(p.head_dim_qk)
    v_row, _ = tile_row_bytes(p.head_dim_v)
    if p.kv_fp8:
        buffers = fp8_kv_buffers(spec, s.tile_q, tile_kv, stages, qk_row, v_row, convert)
    else:
        buffers = qkv_buffers(spec, s.tile_q, tile_kv, stages, qk_row, v_row, SMEM_ALIGN)
    end = buffers_end(buffers)
    # After the kv loop the same bytes hold the warps' states for the combine (Q is no longer read,
    # the pipeline is drained): combine.cuh's o[rows][DV + pad], m per warp, m, l.
    combine_row = p.head_dim_v + DECODE_COMBINE_PAD_FLOATS
    combine_bytes = 4 * (s.tile_q * combine_row + (s.warps + 2) * s.tile_q)
    buffers.append(Buffer("warp partials", 0, combine_bytes, SMEM_ALIGN, layout=f"fp32 rows of {combine_row} floats",
                          formula=f"4*(rows*(dv+{DECODE_COMBINE_PAD_FLOATS}) + (warps+2)*rows)", reuses="Q, K, V"))
    smem = max(end, align(combine_bytes))
    # Q stays in registers when that fits (one 16-row tile: yes); else mma_qk reads it from shared.
    registers = [Registers("O accumulator", m_tiles * p.head_dim_v // 2, f"M_TILES*dv/2 = {m_tiles}*{p.head_dim_v}/2",
                           True),
                 Registers("S/P accumulator", m_tiles * keys_per_warp // 2,
                           f"M_TILES*keys/2 = {m_tiles}*{keys_per_warp}/2",
                           True),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    if convert == "fragments":
        registers.append(Registers("e4m3 conversion", FP8_FRAGMENT_REGISTERS, "allowance (ptxas ballpark)"))
    q_regs = m_tiles * p.head_dim_qk // 4
    q_in_registers = sum(r.amount for r in registers) + q_regs <= limits.max_registers_per_thread
    if q_in_registers:
        registers.append(Registers("Q fragments", q_regs, f"M_TILES*d/4 = {m_tiles}*{p.head_dim_qk}/4"))
    # Never ask ptxas for more than 2 blocks' worth of registers: 2 x 128 threads still allow 255.
    by_shared = max(1, limits.shared_per_sm // (smem + SMEM_RESERVED_PER_BLOCK))   # = Layout.blocks_by_shared, >= 1
    min_blocks = min(by_shared, 2)
    if s.min_blocks is not None:   # the schedule's promise (benchmarks try 3-4 where shared memory allows)
        require(1 <= s.min_blocks <= by_shared, spec, "warps",
                 f"min blocks {s.min_blocks} per SM: shared memory ({smem} B a block) allows 1..{by_shared}")
        min_blocks = s.min_blocks
    return finish(spec, "decode", limits, buffers, smem, registers, threads, min_blocks, stages=stages,
                   tile_kv=tile_kv, rows_per_warp=s.tile_q, keys_per_warp=keys_per_warp, q_in_registers=q_in_registers)


# How decode turns an FP8 (e4m3) KV cache into MMA operands; the first is the default.
#   shared:    each warp converts its slice of the e4m3 ring into a 16-bit tile in shared memory,
#              which ldmatrix then reads (one more shared-memory pass and tile per K and V).
#   fragments: ldmatrix reads the e4m3 ring itself (each lane gets the bytes of its m16n8k16
#              fragment), and the lanes convert in registers; no 16-bit tile.
FP8_CONVERTS = ("shared", "fragments")

FP8_CONVERT_DEFAULT = FP8_CONVERTS[0]

# Registers the fragments path's ldmatrix words and converted pairs hold beyond the shared path's,
# a ballpark from ptxas reports (bench/NOTES.md): with it Q leaves the registers (mma_qk_fp8 reads
# its fragments from shared memory per k step) at the head dims where ptxas spilled with Q in
# registers, and stays where it did not.
FP8_FRAGMENT_REGISTERS = 56


def fp8_convert_of(spec: KernelSpec) -> str:
    """The FP8 conversion path of a decode spec (FP8_CONVERTS), SpecError for an unknown value or
    one set without an FP8 KV cache; "" for a 16-bit cache."""
    p, value = spec.problem, spec.schedule.fp8_convert
    require(value is None or value in FP8_CONVERTS, spec, "kv_dtype",
             f"unknown fp8_convert {value!r}", "one of " + ", ".join(FP8_CONVERTS))
    require(value is None or p.kv_fp8, spec, "kv_dtype", "fp8_convert needs `kv_dtype = e4m3`")
    if not p.kv_fp8:
        return ""
    return value or FP8_CONVERT_DEFAULT


def kv_stage_row_bytes(dim: int, kv_dtype: DType, convert: str = FP8_CONVERT_DEFAULT) -> int:
    """Bytes per shared-memory row of an FP8 K/V staging tile: the HBM row as it is (dim elements
    of kv_dtype, dim a multiple of 16: whole 16-byte chunks). For `shared` unswizzled: only the
    converting pass reads it, each lane one 16-byte chunk of consecutive chunks (no bank
    conflicts). For `fragments` ldmatrix reads 8 rows' 16-byte chunks at once; rows whose chunk
    count kv_stage_swizzled accepts are XOR-swizzled, others padded to an odd number of chunks."""
    row = dim * DTYPE_BYTES[kv_dtype]
    if convert == "fragments" and not kv_stage_swizzled(row):
        row += 16 if (row // 16) % 2 == 0 else 0
    return row


def kv_stage_swizzled(row_bytes: int) -> bool:
    """Whether a `fragments` e4m3 row of row_bytes is XOR-swizzled (common.cuh's chunk_offset):
    2 or 4 chunks (several rows share a 128-byte line: the XOR takes the row bits above them) or a
    multiple of 8 chunks (the 16-bit tiles' swizzle)."""
    chunks = row_bytes // 16
    return row_bytes % 16 == 0 and (chunks in (2, 4) or chunks % 8 == 0)


def fp8_kv_buffers(spec: KernelSpec, tile_q: int, tile_kv: int, stages: int, q_row: int, v_row: int,
                    convert: str) -> list[Buffer]:
    """Decode with an FP8 KV cache: Q, the K and V rings hold the e4m3 bytes as loaded (half a
    16-bit row); with `shared` also one dequantized K and V tile (16-bit mma.sync layout) that
    each warp refills from its slice of the ring just before its MMA reads it."""
    p = spec.problem
    k8, v8 = (kv_stage_row_bytes(d, p.kv_dtype, convert) for d in (p.head_dim_qk, p.head_dim_v))
    q_bytes, k_stage, v_stage = tile_q * q_row, tile_kv * k8, tile_kv * v8
    k_offset = align(q_bytes, SMEM_ALIGN)
    v_offset = align(k_offset + stages * k_stage, SMEM_ALIGN)
    e8 = p.kv_dtype.value

    def ring_text(row: int) -> str:
        if convert == "shared":
            return f"{e8} rows of {row} B"
        return f"{e8} rows of {row} B, " + ("xor-swizzled" if kv_stage_swizzled(row) else "padded")
    buffers = [
        Buffer("Q", 0, q_bytes, SMEM_ALIGN, layout=row_text(p.head_dim_qk), formula=f"Br*row = {tile_q}*{q_row}"),
        Buffer("K", k_offset, stages * k_stage, SMEM_ALIGN, stages, k_stage, ring_text(k8),
               f"{stages}x Bc*{'d' if k8 == p.head_dim_qk else 'row'} = {stages}x {tile_kv}*{k8}"),
        Buffer("V", v_offset, stages * v_stage, SMEM_ALIGN, stages, v_stage, ring_text(v8),
               f"{stages}x Bc*{'dv' if v8 == p.head_dim_v else 'row'} = {stages}x {tile_kv}*{v8}"),
    ]
    if convert == "fragments":
        return buffers
    kd_offset = align(v_offset + stages * v_stage, SMEM_ALIGN)
    vd_offset = align(kd_offset + tile_kv * q_row, SMEM_ALIGN)
    return buffers + [
        Buffer("K dequantized", kd_offset, tile_kv * q_row, SMEM_ALIGN, layout=row_text(p.head_dim_qk),
               formula=f"Bc*row = {tile_kv}*{q_row}"),
        Buffer("V dequantized", vd_offset, tile_kv * v_row, SMEM_ALIGN, layout=row_text(p.head_dim_v),
               formula=f"Bc*row = {tile_kv}*{v_row}"),
    ]


DECODE_PAGE_ROWS_MIN = 16   # a page this long fills a warp's cp.async pass at any head dim (16 rows x 2+ chunks)


def decode_page_walk(page_size: int | None, keys_per_warp: int) -> str:
    """How a decode warp finds its key slice (keys_per_warp keys starting at a multiple of
    keys_per_warp) in a paged KV cache: "" contiguous cache; "slice" when the page size is a
    multiple of the slice, so every slice lies in one page (one block-table read per slice, then
    the rows are contiguous); "pages" when pages of at least DECODE_PAGE_ROWS_MIN keys tile the
    slice (one read per page, its rows contiguous); "rows" otherwise (small pages, or pages that
    straddle slices: each key row reads its own block-table entry, once per tile)."""
    if page_size is None:
        return ""
    if page_size % keys_per_warp == 0:
        return "slice"
    if page_size >= DECODE_PAGE_ROWS_MIN and keys_per_warp % page_size == 0:
        return "pages"
    return "rows"
