"""The plan types: plain data a template renders (constants, regions, loop steps, launch geometry), built
by make_plan with the fields every family fills the same way. No networkx, no Jinja."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..spec import DTYPE_PTX, Family, KernelSpec
from ..version import __version__

FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127   # the smallest normal and the largest float


# The range of each integer C type a constant is declared with: a value outside it would be truncated
# by the compiler (with only a warning), so building such a constant is a bug in the checker's bounds.
C_INT_RANGES = {"int": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1)}


@dataclass(frozen=True)
class Constant:
    name: str
    type: str        # int | bool | float | u32 | MaskKind
    value: object
    why: str = ""

    def __post_init__(self):
        bounds = C_INT_RANGES.get(self.type)
        if bounds is not None and not isinstance(self.value, bool) and isinstance(self.value, int) and not (
                bounds[0] <= self.value <= bounds[1]):
            raise ValueError(f"constant {self.name} = {self.value} does not fit in a C {self.type} "
                             f"({bounds[0]}..{bounds[1]})")
        if self.type == "float" and not (isinstance(self.value, (int, float)) and math.isfinite(self.value)
                                         and (self.value == 0 or abs(self.value) >= FLOAT32_TINY)
                                         and abs(self.value) <= FLOAT32_MAX):
            raise ValueError(f"constant {self.name} = {self.value} is not a normal C float")


@dataclass(frozen=True)
class Region:
    """A step of the kernel and the DSL line it came from, for `// [file.tile:LINE] what`."""
    where: str
    what: str


@dataclass(frozen=True)
class LoopOp:
    kind: str                 # barrier | prefetch_kv | wait_k | wait_v | mma_qk | mask | online_softmax | mma_pv
    where: str
    what: str
    pending: int = 0          # wait_*: cp.async groups allowed to stay in flight
    distance: int = 0         # prefetch_kv: how many tiles ahead
    node: str = ""            # the scheduler-graph op this step lowers
    tile: str = ""            # prefetch_*: the kv tile it loads (a CUDA expression; its slot: ring_slot)


@dataclass(frozen=True)
class KvRange:
    """Query rows q0 .. q0 + rows - 1 whose visible kv tiles [begin, end) macros.j2's kv_range
    declares (CUDA expressions and names). The default: a block's own query tile."""
    q0: str = "q0"
    rows: str = "C::BR"
    begin: str = "tile_begin"
    end: str = "tile_end"


@dataclass(frozen=True)
class Parameter:
    """One parameter of a kernel: its CUDA type and name. The list of them (KernelPlan.parameters) is both
    the kernel's signature and the order of the host's launch arguments (runtime/kernel.py
    kernel_arguments), which converts each value by its `kind`."""
    name: str
    type: str

    @property
    def kind(self) -> str:
        return parameter_kind(self.type)


def parameter_kind(cuda_type: str) -> str:
    """How the host passes a parameter of `cuda_type`: pointer | i32 | i64 | u64 | map (a TMA tensor map, by
    value). A function of the type alone, so a plan read back from the warm cache (fields only) has it."""
    if "TensorMap" in cuda_type:
        return "map"
    if "*" in cuda_type:
        return "pointer"
    return {"int": "i32", "i64": "i64", "unsigned long long": "u64"}[cuda_type]


@dataclass(frozen=True)
class SharedBuffer:
    """One buffer of a kernel's shared memory in its typed view (base.cu.j2's struct Shared): the accessor
    `name()`, or for a ring `name(stage)`, returns its 32-bit shared address from the block's base, the
    layout's offset constant plus stage * the stage constant (names of C's constants)."""
    name: str
    offset: str             # e.g. "K_OFFSET"
    stage_bytes: str = ""   # a ring's bytes per stage (e.g. "K_STAGE_BYTES"); "": one buffer


@dataclass(frozen=True)
class RingLoad:
    """One of K, V of a kv tile copied into its ring stage: the ring (the Shared view's accessor `name`),
    the rows in HBM and the loader that copies them, with its row layout as template arguments (CUDA)."""
    name: str               # "k" | "v": also its ring's accessor in the Shared view
    rows: str               # this kv head's rows (k_rows); a paged cache's page stride is its batch stride
    batch_stride: str
    row_stride: str
    loader: str             # e.g. load_tile_async<C::BC, C::QK_CHUNKS, C::QK_ROW_BYTES, C::QK_SWIZZLE, C::THREADS>
    slice_bytes: str = ""   # warp slices: one warp's offset in a stage, per warp (C::WARP_K_BYTES)
    copies_entries_ahead: bool = False   # fa2's paged K: also copies the block-table entries STAGES - 1 tiles on


@dataclass(frozen=True)
class KvLoad:
    """How a kernel copies a kv tile's K and V into their ring stage, chosen in lowering (lower/steps.py:
    kv_tile_load); macros.j2's issue_kv_tile spells `walk`'s loader for each."""
    # KV_WALKS: tile | paged_tile (the block, through the block table) | slice (each warp its keys) | paged_slice
    walk: str
    k: RingLoad
    v: RingLoad
    commit_each: bool = True   # a cp.async group per tensor (Q K^T starts before V lands); False: the caller's one

    @property
    def scope(self) -> str:
        """Who loads (and waits for) a tile: the whole block, or each warp its own key slice."""
        return "warp" if self.walk.endswith("slice") else "block"

    @classmethod
    def of(cls, walk: str = "tile", chunks: tuple[str, str] = ("C::D / 8", "C::DV / 8"), fp8: str = "",
           panels: bool = False, commit_each: bool = True) -> "KvLoad":
        """The loads of a `walk` (KV_WALKS) copying `chunks` 16-byte chunks of each K and V row (a row's
        HBM chunks: head dims padded on chip leave the pad alone); rows of 16-bit values in the
        mma.sync layout, wgmma's 64-column `panels`, or an FP8 cache's e4m3 rows (`fp8`: the
        conversion path, layout.FP8_CONVERTS; its `fragments` rings are swizzled)."""
        if walk not in KV_WALKS:
            raise ValueError(f"unknown kv walk {walk!r}: one of {', '.join(KV_WALKS)}")

        def ring(name: str, chunk_count: str) -> RingLoad:
            tensor = name.upper()
            if fp8:
                chunk_count, row_bytes = f"C::{tensor}8_CHUNKS", f"C::{tensor}8_ROW_BYTES"
                swizzle = f"C::{tensor}8_SWIZZLE" if fp8 == "fragments" else "false"
                slice_bytes = f"C::WARP_{tensor}8_BYTES"
            else:
                row = "QK" if name == "k" else "V"
                row_bytes, swizzle, slice_bytes = f"C::{row}_ROW_BYTES", f"C::{row}_SWIZZLE", f"C::WARP_{tensor}_BYTES"
            layout = f"{chunk_count}, {row_bytes}, {swizzle}"
            loader = {"tile": f"load_tile_panels<C::BC, {chunk_count}, C::THREADS>" if panels
                      else f"load_tile_async<C::BC, {layout}, C::THREADS>",
                      "paged_tile": f"load_paged_tile<C, C::BC, {layout}, C::THREADS>",
                      "slice": f"load_tile_async<C::KEYS_PER_WARP, {layout}, 32>",
                      "paged_slice": f"load_paged_slice<C, C::KEYS_PER_WARP, {layout}>"}[walk]
            return RingLoad(name, f"{name}_rows", f"{name}_batch_stride", f"{name}_row_stride", loader,
                            slice_bytes if walk.endswith("slice") else "",
                            copies_entries_ahead=walk == "paged_tile" and name == "k")
        return cls(walk, ring("k", chunks[0]), ring("v", chunks[1]), commit_each)


# How a kernel walks a kv tile's K and V rows (KvLoad.walk).
KV_WALKS = ("tile", "paged_tile", "slice", "paged_slice")


@dataclass(frozen=True)
class BackwardWgmma:
    """One wgmma wrapper of a backward kernel: m64n{asm.n}k16 (asm: fa2_wgmma.WgmmaAsm), A from registers or
    shared memory, the transpose bits (1 = MN-major) of its shared-memory operands."""
    name: str
    asm: object
    a_in_registers: bool
    trans_a: int
    trans_b: int


@dataclass(frozen=True)
class Launch:
    threads: int
    smem_bytes: int
    tile_q: int


@dataclass(frozen=True)
class KernelPlan:
    kernel_name: str
    family: str
    template: str
    tiledsl_version: str
    source_file: str
    config_hash: str
    spec_lines: tuple[str, ...]
    config_lines: tuple[str, ...]
    dtype_ptx: str
    constants: tuple[Constant, ...]
    regions: dict
    loop_body: tuple[LoopOp, ...]
    min_blocks_per_sm: int
    launch: Launch
    register_estimate: int
    notes: tuple[str, ...] = field(default=())
    mma: str = "mma.sync"     # the graph's MMA instruction: "mma.sync" | "wgmma"
    wgmma_qk: object = None   # wgmma only: lower_wgmma.WgmmaAsm of S = Q K^T (its n = the kv tile)
    wgmma_pv: object = None   # wgmma only: lower_wgmma.WgmmaAsm of O += P V (its n = head dim of v)
    # wgmma's k, its input type (a C string: TILE_DTYPE's macro, or e4m3's literal) and the operands after the
    # scale immediates (16-bit: QK's transpose bits of A and B, PV's of B; e4m3 takes none: both K-major)
    wgmma_k: int = 16
    fp8_inputs: bool = False   # e4m3 Q, K, V (hopper): templates/hopper_fp8.cuh spells the GEMMs and P's packing
    wgmma_inputs: str = "TILE_DTYPE"
    wgmma_qk_tail: str = ", 0, 0"
    wgmma_pv_tail: str = ", 1"
    kv_load: KvLoad = KvLoad.of()  # how a kv tile's K and V reach their ring stage (KvLoad.scope: block | warp)
    # the constants struct attention.cuh's MMA / softmax helpers take ("W": one warp's key slice)
    mma_traits: str = "C"
    mask_rows: str = "tile"        # "tile": rows are the block's query rows | "packed": decode's (head, query) rows
    kv_range: KvRange = KvRange()  # the rows whose kv tiles the kernel walks (kv_range region)
    # a paged KV cache's block-table walk (layout: fa2_page_walk, decode_page_walk); "": contiguous K/V
    kv_pages: str = ""
    headers: tuple[str, ...] = ()   # plain .cuh device headers the kernel pastes (paged_kv.cuh, FP8 paths)
    shared: tuple[SharedBuffer, ...] = ()   # the typed view of shared memory (struct Shared), from the layout
    # the kernel's parameters in order, in the lines the signature prints: what the host passes
    parameters: tuple[tuple[Parameter, ...], ...] = ()
    kv_fp8: bool = False       # decode: K/V stored as e4m3, loaded as bytes and dequantized by each warp
    fp8_convert: str = ""      # with kv_fp8, layout.FP8_CONVERTS: through a 16-bit shared tile, or into fragments
    # Score modifications the kernel spells (families.BUILT_MODS; lower/score_mods.py): softcap and ALiBi in
    # the score_mod op, sinks as the softmax's start; score_mods: any modification (score_mods.cuh is pasted).
    score_mods: bool = False
    softcap: bool = False
    softcap_via: str = ""                 # mods/softcap.TanhVia's value: how tanh runs
    softcap_terms: tuple[str, ...] = ()   # the quotient's coefficients, w^0 first (C::SOFTCAP_Q0, ...)
    softcap_degree: int = 0               # the quotient polynomial's degree (len(softcap_terms) - 1)
    alibi: bool = False
    sinks: bool = False
    # score_mod / mask_mod (lower/expressions.expression_fields: macros.j2's expression_functions pastes them;
    # templates/expressions.cuh applies them in the hopper forward, decode_expressions.cuh in decode,
    # backward_expressions.cuh in the WS backward): the ExprAux struct's fields and its value from the parameters,
    # each tree's CUDA expression and DSL text, mask_mod's box statements and answer (can be false, can be true). A
    # mask_mod also narrows each item's (decode: each split's) kv tiles and steps over the empty ones. In a
    # backward, score_mod's derivative (score_grad_expression: "" where it is 1, so dS takes no multiply).
    expressions: bool = False
    expr_aux_fields: tuple[str, ...] = ()
    expr_aux_value: str = "{}"
    score_expression: str = ""
    score_expression_text: str = ""
    mask_expression: str = ""
    mask_expression_text: str = ""
    mask_box_lines: tuple[str, ...] = ()
    mask_box_answer: tuple[str, str] = ("false", "true")
    score_grad_expression: str = ""
    score_grad_expression_text: str = ""
    score_grad_reads_score: bool = False
    # dropout after the softmax (templates/philox.cuh, dropout.cuh): P's dropped weights zeroed, O's 1 / l
    # becomes C::KEEP_SCALE / l
    dropout: bool = False


    @property
    def loop_bodies(self) -> tuple[tuple[str, tuple[LoopOp, ...]], ...]:
        """(graph loop, the CUDA steps of its body), outer loop first."""
        return (("loop_kv", self.loop_body),)


def spec_lines(spec: KernelSpec) -> tuple[str, ...]:
    if spec.span is None or not spec.source_text:
        return (f"(built in Python: {spec.name})",)
    lines = spec.source_text.splitlines()[spec.span.line - 1: spec.span.end_line]
    return tuple(line.rstrip() for line in lines)


# Where a kernel that bounds its index tensors reports the first bad entry (runtime/device_errors.py).
INDEX_ERRORS = Parameter("index_errors", "int* __restrict__")


def bounds_indices(plan) -> bool:
    """Whether `plan`'s kernel bounds the kv_lens and block-table entries it reads on the device
    (templates/index_bounds.cuh): it takes the error word. A function of the parameter list alone, so
    a plan read back from the warm cache has it (and the runtime asks it without the lowering's imports)."""
    return any(p.name == INDEX_ERRORS.name for line in plan.parameters for p in line)


def make_plan(spec: KernelSpec, family: Family, template: str, constants, regions: dict, loop_body, launch: Launch,
              min_blocks_per_sm: int, register_estimate: int, kernel_name: str | None = None,
              plan_class: type = None, **extra) -> KernelPlan:
    """A KernelPlan (or the family's subclass, `plan_class`) rendered by `template` (the family row's,
    handed to the lowering by families.lower), with the fields every family fills the same way (names,
    hashes, the spec's lines and full config for the generated file's header). `dtype_ptx` in `extra`: a TILE_DTYPE
    other than the inputs' (FP8 inputs: O's 16-bit type)."""
    dtype_ptx = extra.pop("dtype_ptx", DTYPE_PTX[spec.problem.dtype])
    return (plan_class or KernelPlan)(
        kernel_name=kernel_name or spec.kernel_name, family=family.value, template=template,
        tiledsl_version=__version__, source_file=Path(spec.source_file).name,
        config_hash=spec.config_hash, spec_lines=spec_lines(spec),
        config_lines=tuple(json.dumps(spec.config(), indent=1, sort_keys=True).splitlines()),
        dtype_ptx=dtype_ptx, constants=tuple(constants), regions=regions,
        loop_body=tuple(loop_body), min_blocks_per_sm=min_blocks_per_sm, launch=launch,
        register_estimate=register_estimate, **extra,
    )
