"""The pieces every family's layout shares: the Layout, Buffer and Registers records, row sizes and swizzles
of 16-bit tiles, Q and the K/V rings, O staging, and the resource rules (threads, shared memory, accumulator
registers) that refuse a spec at its line."""
from __future__ import annotations

from dataclasses import dataclass

from ..device_limits import SMEM_RESERVED_PER_BLOCK, DeviceLimits, register_ceiling, resident_blocks
from ..errors import SpecError
from ..hw import MMA_K, PANEL_COLUMNS
from ..spec import DType, Family, KernelSpec, LoopOrder

SMEM_ALIGN = 128           # every buffer of the mma.sync kernels starts on a 128-byte line

# Addresses, indices, loop state and the softmax bounds: a ballpark measured from ptxas reports.
REGISTER_OVERHEAD = 40

# Where ptxas's register count ("Used N registers") lies for a family's kernels, relative to the layout's
# estimate: (fewest, most) registers above it, measured on a seeded sample of legal configs of every family
# (tests/register_sample.py; bench/register_estimates.py writes the measurement). The estimate counts what the
# kv loop keeps live; ptxas spends what its launch bounds leave beyond that (addresses hoisted out of loops,
# loads in flight, unrolled ring slots), which no per-config sum predicts to a few registers: a family's
# kernels land anywhere in a band this wide, capped at the launch bounds' ceiling. The warp-specialized
# families are not here: setmaxnreg kernels report the ceiling itself.
PTXAS_REGISTER_SPREAD = {            # the measured extremes, 8 registers wider each side
    "fa1": (3, 121),
    "fa2": (-17, 61),
    "fa2_wgmma": (-48, 35),
    "decode": (-1, 116),
    "backward": (15, 77),
    "backward_wgmma": (-82, -26),   # the estimate adds lines whose lifetimes never overlap
}
SETMAXNREG_FAMILIES = ("hopper", "backward_ws")
PTXAS_REGISTER_TOLERANCE = 8   # a range no wider than this either side is printed as the estimate alone


@dataclass(frozen=True)
class Buffer:
    name: str
    offset: int
    bytes: int
    align: int
    stages: int = 1
    stage_bytes: int = 0
    layout: str = ""           # e.g. "xor-swizzled 256 B rows", "padded 144 B rows", "wgmma 64-col panels"
    formula: str = ""          # how `bytes` is counted, with the numbers
    reuses: str = ""           # the buffer whose bytes this one reuses (not counted twice)


@dataclass(frozen=True)
class Registers:
    """One line of the per-thread register estimate."""
    name: str
    amount: int
    formula: str
    accumulator: bool = False  # lives across the whole kv loop (the legality rule counts these)


@dataclass(frozen=True)
class Layout:
    family: str                # layout function that made it: fa2, fa2_wgmma, fa1, decode, graph model
    arch: str
    buffers: tuple[Buffer, ...]
    smem_bytes: int            # dynamic shared memory the kernel declares (SMEM_BYTES) and launches with
    smem_limit: int
    registers: tuple[Registers, ...]
    register_estimate: int     # feeds __launch_bounds__ (min blocks) and the Q-in-registers choice
    register_limit: int
    threads: int
    min_blocks_per_sm: int     # what __launch_bounds__ promises ptxas
    resident_blocks: int       # device_limits.resident_blocks from the estimate, threads and shared memory
    limit_reason: str          # what limits resident_blocks: registers | shared | threads | blocks
    blocks_by_shared: int      # blocks per SM that shared memory alone allows
    stages: int = 1
    tile_kv: int = 0           # keys per kv tile: the spec's, or a layout override's (decode variants)
    rows_per_warp: int = 0
    keys_per_warp: int = 0
    q_in_registers: bool = False
    generated: bool = True     # False: the graph model of a family or dtype with no template
    register_ceiling: int = 0  # the most registers ptxas may give a thread under the kernel's __launch_bounds__

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    @property
    def accumulator_registers(self) -> int:
        return sum(r.amount for r in self.registers if r.accumulator)

    @property
    def ptxas_registers(self) -> tuple[int, int] | None:
        """(fewest, most) registers per thread ptxas's report will show for this kernel: the ceiling itself
        for a setmaxnreg kernel (its warpgroups re-balance after entry: the estimate is a consumer's, held
        against its setmaxnreg count, not a number ptxas reports), else the estimate moved by the family's
        PTXAS_REGISTER_SPREAD and capped at the ceiling. None: no template, so no ptxas."""
        if not self.generated or not self.register_ceiling:
            return None
        if self.family in SETMAXNREG_FAMILIES:
            return self.register_ceiling, self.register_ceiling
        below, above = PTXAS_REGISTER_SPREAD[self.family]
        return (min(self.register_ceiling, self.register_estimate + below),
                min(self.register_ceiling, self.register_estimate + above))

    @property
    def register_text(self) -> str:
        """What check and explain print about ptxas's count: a number where the range is that narrow, else
        the range and who decides."""
        found = self.ptxas_registers
        if found is None:
            return f"~{self.register_estimate} registers per thread (graph model: no template, no ptxas)"
        low, high = found
        if self.family in SETMAXNREG_FAMILIES:
            return (f"ptxas: {low} registers per thread (the launch bounds' ceiling: setmaxnreg re-balances the "
                    "warpgroups' registers after entry, and their estimates are held against their counts)")
        below, above = PTXAS_REGISTER_SPREAD[self.family]
        if -PTXAS_REGISTER_TOLERANCE <= below and above <= PTXAS_REGISTER_TOLERANCE:
            return f"~{self.register_estimate} registers per thread (ptxas within {low}..{high})"
        spill = "; at the ceiling ptxas may spill" if high >= self.register_ceiling else ""
        return (f"~{self.register_estimate} registers per thread live in the loop; ptxas decides the count: "
                f"{low}..{high} of {self.register_ceiling}{spill}")


# The hint of a size refusal that names no fix; the checker replaces it by edits that check.
GENERIC_SIZE_HINT = "use smaller tiles or more warps"


def align(n: int, to: int = SMEM_ALIGN) -> int:
    return -(-n // to) * to


def mma_width(dim: int) -> int:
    """Columns a head dim occupies on chip for mma.sync (m16n8k16 steps and ldmatrix.x4 read 16
    columns at a time): `dim` rounded up to 16. A head dim that is a multiple of 8 but not of 16
    gets one zero 8-column chunk per shared-memory row; HBM is never padded."""
    return -(-dim // MMA_K) * MMA_K


def tile_row_bytes(dim: int) -> tuple[int, bool]:
    """Bytes per shared-memory row of a 16-bit tile with `dim` columns (padded to mma_width), and
    whether it is swizzled. Rows of a multiple of 64 elements are XOR-swizzled; others get one
    16-byte pad (an odd number of 16-byte chunks per row: ldmatrix's 8 rows hit 8 bank groups)."""
    width = mma_width(dim)
    if width % 64 == 0:
        return width * 2, True
    return (width + 8) * 2, False


def row_text(dim: int) -> str:
    row, swizzled = tile_row_bytes(dim)
    return f"xor-swizzled {row} B rows" if swizzled else f"padded {row} B rows"


def row_formula(rows: str, dim: str, width: int) -> str:
    row, _ = tile_row_bytes(width)
    pad = row // 2 - width
    return f"{rows}*({dim}+{pad})*2" if pad else f"{rows}*{dim}*2"


def refuse(spec: KernelSpec, key: str, message: str, hint: str = ""):
    raise SpecError(message, spec.span_of(key), spec.source_text, hint)


def require(ok: bool, spec: KernelSpec, key: str, message: str, hint: str = "") -> None:
    if not ok:
        refuse(spec, key, message, hint)


def loop_order_rules(spec: KernelSpec) -> None:
    """The loop orders a family's kernels are built for (checked before any layout, modelled or not)."""
    if spec.family is Family.FA1 and spec.schedule.split_kv != 1:
        refuse(spec, "split", "split kv needs the q-outer order (FA1 already walks kv tiles outermost)",
               "use `order q, kv` or drop `split`")
    if spec.family is Family.HOPPER and spec.schedule.order is LoopOrder.KV_OUTER:
        refuse(spec, "order", "warp-specialized kernels are built for the q-outer order",
               "use `order q, kv` with warpgroups")


def cp_async_pending(family: Family, stages: int, tile: str, prefetch_first: bool = True) -> int:
    """cp.async groups a kernel leaves in flight when it waits for `tile` ("k", "v", or "kv" for
    FA1's joint wait) of step j; the lowering emits it and explain prints it."""
    if family is Family.FA1:
        return 0 if stages == 1 else stages - 2
    if family is Family.DECODE:
        if stages == 1:
            return 1   # K and V refilled half a step apart: the other one is in flight
        return (2 * stages - 1 if prefetch_first else 2 * stages - 3) if tile == "k" else 2 * stages - 2
    if stages == 1:
        return 1 if tile == "k" else 0
    return 2 * stages - 3 if tile == "k" else 2 * stages - 2


def qkv_buffers(spec: KernelSpec, tile_q: int, tile_kv: int, stages: int, q_row: int, v_row: int,
                 round_to: int, panels: bool = False, element_bytes: int = 2) -> list[Buffer]:
    """Q once, then the K and V rings, each buffer starting on `round_to` (panels of 1-byte elements: FP8's
    swizzled rows of bytes)."""
    p = spec.problem
    if panels:
        qk_text = v_text = (f"wgmma {PANEL_COLUMNS}-col panels, 128 B swizzle" if element_bytes == 2
                            else "rows of bytes, swizzled")
        qk_f = v_f = "{r}*{d}*" + str(element_bytes)
    else:
        qk_text, v_text = row_text(p.head_dim_qk), row_text(p.head_dim_v)
        qk_f = row_formula("{r}", "{d}", p.head_dim_qk)
        v_f = row_formula("{r}", "{d}", p.head_dim_v)
    q_bytes, k_stage, v_stage = tile_q * q_row, tile_kv * q_row, tile_kv * v_row
    k_offset = align(q_bytes, round_to)
    v_offset = align(k_offset + stages * k_stage, round_to)
    return [
        Buffer("Q", 0, q_bytes, round_to, layout=qk_text,
               formula=qk_f.format(r="Br", d="d") + " = " + qk_f.format(r=tile_q, d=p.head_dim_qk)),
        Buffer("K", k_offset, stages * k_stage, round_to, stages, k_stage, qk_text,
               f"{stages}x " + qk_f.format(r="Bc", d="d") + f" = {stages}x " + qk_f.format(r=tile_kv, d=p.head_dim_qk)),
        Buffer("V", v_offset, stages * v_stage, round_to, stages, v_stage, v_text,
               f"{stages}x " + v_f.format(r="Bc", d="dv") + f" = {stages}x " + v_f.format(r=tile_kv, d=p.head_dim_v)),
    ]


def buffers_end(buffers: list[Buffer], round_to: int = SMEM_ALIGN) -> int:
    return align(max(b.offset + b.bytes for b in buffers), round_to)


def thread_register_limit(threads: int, limits: DeviceLimits) -> int:
    return min(limits.max_registers_per_thread, limits.registers_per_sm // max(threads, 1))


def finish(spec: KernelSpec, family: str, limits: DeviceLimits, buffers: list[Buffer], smem: int,
            registers: list[Registers], threads: int, min_blocks: int, register_limit: int | None = None,
            launch_registers: int | None = None, **extra) -> Layout:
    """The resource rules every family shares (threads, shared memory, accumulator registers), then
    the Layout with resident blocks (`launch_registers`: what a thread holds at launch, where that
    is not the estimate: a warp-specialized kernel's warpgroups re-balance theirs afterwards)."""
    estimate = sum(r.amount for r in registers)
    extra.setdefault("tile_kv", spec.schedule.tile_kv)
    layout = Layout(family, limits.arch, tuple(buffers), smem, limits.max_shared_per_block, tuple(registers), estimate,
                    register_limit or thread_register_limit(threads, limits), threads, min_blocks,
                    *resident_blocks(limits, launch_registers or estimate, threads, smem),
                    limits.shared_per_sm // (smem + SMEM_RESERVED_PER_BLOCK),
                    register_ceiling=register_ceiling(limits, threads, min_blocks), **extra)
    hopper = spec.family is Family.HOPPER
    if threads > limits.max_threads_per_block:
        refuse(spec, "warpgroups" if hopper else "warps",
                f"{threads} threads per block > {limits.max_threads_per_block}")
    if smem > layout.smem_limit:
        refuse_shared(spec, layout)
    accumulators = layout.accumulator_registers
    if accumulators > layout.register_limit:
        parts = " + ".join(f"{r.name} {r.amount}" for r in registers if r.accumulator)
        refuse(spec, "warpgroups" if hopper else "tile",
                f"registers: ~{accumulators} per thread estimated ({parts}) > {layout.register_limit} available",
                GENERIC_SIZE_HINT)
    return layout


def refuse_shared(spec: KernelSpec, layout: Layout):
    counted = [b for b in layout.buffers if not b.reuses]
    parts = " + ".join(f"{b.name} {b.stages}x{b.stage_bytes}" if b.stages > 1 else f"{b.name} {b.bytes}"
                       for b in counted)
    padding = layout.smem_bytes - sum(b.bytes for b in counted)
    if padding > 0:
        parts += f" + alignment {padding}"
    stages = layout.stages
    per_stage = sum(b.stage_bytes for b in counted)
    fit = (layout.smem_limit - (layout.smem_bytes - per_stage * stages)) // per_stage if per_stage else 0
    key = "pipeline" if stages > 1 and fit >= 1 else "tile"
    hint = f"at most {fit} stages fit with these tiles" if fit >= 1 else "use smaller tiles (or a smaller head dim)"
    refuse(spec, key, f"shared memory: {layout.smem_bytes} bytes needed ({parts}) > {layout.smem_limit} available "
            f"on {layout.arch}", hint)


def stage_o(spec: KernelSpec, buffers: list[Buffer], end: int) -> int:
    """mma.sync kernels stage the final O for coalesced stores: in Q's rows when the row layouts
    match (each warp reuses only its own rows), else after `end`. Returns the new end."""
    p, s = spec.problem, spec.schedule
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    if (v_row, v_swizzle) == (qk_row, qk_swizzle):
        buffers.append(Buffer("O staging", 0, s.tile_q * v_row, SMEM_ALIGN, layout=row_text(p.head_dim_v),
                              formula="in Q's rows after the kv loop", reuses="Q"))
        return end
    buffers.append(Buffer("O staging", end, s.tile_q * v_row, SMEM_ALIGN, layout=row_text(p.head_dim_v),
                          formula=row_formula("Br", "dv", p.head_dim_v)))
    return align(end + s.tile_q * v_row)


def split_q_rules(spec: KernelSpec, family: str, why: str = "") -> None:
    """Warps along q (fa1 split-Q, fa2): whole 16-row mma tiles per warp, kv tiles in 16-key steps."""
    s = spec.schedule
    require(s.tile_q % s.warps == 0 and s.tile_q // s.warps % 16 == 0 and s.tile_q >= s.warps, spec, "warps",
             f"{s.warps} warps along q give {s.tile_q / s.warps:g} rows each; {family} needs a multiple of 16",
             f"use tile q = {16 * s.warps} or a multiple")
    require(s.tile_kv % 16 == 0, spec, "tile", f"tile kv = {s.tile_kv} is not a multiple of 16{why}",
             "use tile kv = 32, 64 or 128")


# Smaller pages give a row or two per ring entry: a shared read per row costs registers (ptxas spills),
# so those read the block table inline.
FA2_PAGE_RING_MIN = 16

TEMPLATE_DTYPES = (DType.FP16, DType.BF16)
