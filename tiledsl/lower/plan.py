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
    tile: str = ""            # prefetch_*: the kv tile it loads and the ring slot it fills (CUDA expressions)
    stage: str = ""


@dataclass(frozen=True)
class KvRange:
    """Query rows q0 .. q0 + rows - 1 whose visible kv tiles [begin, end) macros.j2's kv_range
    declares (CUDA expressions and names). The default: a block's own query tile."""
    q0: str = "q0"
    rows: str = "C::BR"
    begin: str = "tile_begin"
    end: str = "tile_end"


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
    kv_load_scope: str = "block"   # "warp": each warp loads (and waits for) only its key slice of a kv tile
    kv_groups_per_tile: int = 2    # cp.async groups per K/V tile: 2 (K, then V: QK^T starts before V lands) | 1
    # the constants struct attention.cuh's MMA / softmax helpers take ("W": one warp's key slice)
    mma_traits: str = "C"
    mask_rows: str = "tile"        # "tile": rows are the block's query rows | "packed": decode's (head, query) rows
    kv_range: KvRange = KvRange()  # the rows whose kv tiles the kernel walks (kv_range region)
    hbm_chunks: tuple[str, str] = ("C::D / 8", "C::DV / 8")   # 16-byte chunks of a K and a V row in HBM (CUDA)
    # a paged KV cache's block-table walk (layout: fa2_page_walk, decode_page_walk); "": contiguous K/V
    kv_pages: str = ""


    @property
    def loop_bodies(self) -> tuple[tuple[str, tuple[LoopOp, ...]], ...]:
        """(graph loop, the CUDA steps of its body), outer loop first."""
        return (("loop_kv", self.loop_body),)


def spec_lines(spec: KernelSpec) -> tuple[str, ...]:
    if spec.span is None or not spec.source_text:
        return (f"(built in Python: {spec.name})",)
    lines = spec.source_text.splitlines()[spec.span.line - 1: spec.span.end_line]
    return tuple(line.rstrip() for line in lines)


def make_plan(spec: KernelSpec, family: Family, template: str, constants, regions: dict, loop_body, launch: Launch,
              min_blocks_per_sm: int, register_estimate: int, kernel_name: str | None = None,
              plan_class: type = None, **extra) -> KernelPlan:
    """A KernelPlan (or the family's subclass, `plan_class`) rendered by `template` (the family row's,
    handed to the lowering by families.lower), with the fields every family fills the same way (names,
    hashes, the spec's lines and full config for the generated file's header)."""
    return (plan_class or KernelPlan)(
        kernel_name=kernel_name or spec.kernel_name, family=family.value, template=template,
        tiledsl_version=__version__, source_file=Path(spec.source_file).name,
        config_hash=spec.config_hash, spec_lines=spec_lines(spec),
        config_lines=tuple(json.dumps(spec.config(), indent=1, sort_keys=True).splitlines()),
        dtype_ptx=DTYPE_PTX[spec.problem.dtype], constants=tuple(constants), regions=regions,
        loop_body=tuple(loop_body), min_blocks_per_sm=min_blocks_per_sm, launch=launch,
        register_estimate=register_estimate, **extra,
    )
