"""The kernel families: one table, FAMILIES, with a row per family and MMA instruction naming its layout
function, its lowering, its template, its kernel class and the serving variants its kernels read (a paged
KV cache, packed sequences), and the functions that read it:

    layout_of(spec, limits)   every size of the spec's kernel (check, the legality pass, explain, the
                              autoscheduler and the tuner all read layouts here)
    lower(spec, limits)       spec -> KernelPlan: the layout once, the scheduler graph once (the passes are
                              handed that layout), then the family's lowering gets (spec, layout, graph)
    compile(spec)             a Kernel of the row's (or serving variant's) class

This is the only module that names the families' own modules. It sits just above layout/, because the
front end (check) and the scheduler's legality pass read a spec's layout through it. What a row names
further up -- its lowering and kernel classes, which import the passes and the runtime -- and what `lower`
and `compile` call there (the passes, the parser) are written "module:attribute" and imported on first
use, so reading the table imports no lowering. Adding a family is its layout function, its lowering, its
template and (if its launch differs) its kernel class, then a row here."""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Callable

from .device_limits import H200, DeviceLimits
from .errors import RuntimeInputError, SpecError
from .layout.base import TEMPLATE_DTYPES, Layout, loop_order_rules
from .layout.decode import decode_layout
from .layout.fa1 import fa1_layout
from .layout.fa2 import fa2_layout, fa2_wgmma_layout
from .layout.hopper import hopper_layout
from .layout.model import graph_model_layout
from .spec import MOD_KEYS, Family, KernelSpec, Mma, SeqLayout

PAGED, VARLEN = "paged", "varlen"


@dataclass(frozen=True)
class Serving:
    """A serving layout a row's kernels read besides batched sequences and a contiguous cache."""
    kind: str                 # PAGED: K and V through a block table | VARLEN: packed sequences with cu_seqlens
    kernel_class: str         # "module:Class" (under tiledsl) that launches it
    template: str = ""        # its own template; "": the row's


@dataclass(frozen=True)
class Row:
    family: Family
    mma: Mma                            # the MMA instruction this row lowers
    layout: Callable[..., Layout]       # (spec, limits, **layout overrides) -> Layout
    lowering: str                       # "module:function": (spec, layout, graph, template, **overrides) -> plan
    template: str                       # under templates/
    kernel_class: str                   # "module:Class" that launches the compiled kernel
    serving: tuple[Serving, ...] = ()

    def variant(self, kind: str) -> Serving | None:
        return next((v for v in self.serving if v.kind == kind), None)


FAMILIES = (
    Row(Family.FA2, Mma.SYNC, fa2_layout, "lower.fa2:lower_fa2", "fa2.cu.j2", "runtime.kernel:Kernel",
        (Serving(PAGED, "runtime.paged_prefill:PagedPrefillKernel"),)),   # chunked prefill
    Row(Family.FA2, Mma.WGMMA, fa2_wgmma_layout, "lower.fa2_wgmma:lower_fa2_wgmma", "fa2_wgmma.cu.j2",
        "runtime.kernel:Kernel"),
    Row(Family.FA1, Mma.SYNC, fa1_layout, "lower.fa1:lower_fa1", "fa1.cu.j2", "runtime.fa1:Fa1Kernel"),
    # split kernel + merge, workspace
    Row(Family.DECODE, Mma.SYNC, decode_layout, "lower.decode:lower_decode", "decode.cu.j2",
        "runtime.decode:DecodeKernel", (Serving(PAGED, "runtime.paged_decode:PagedDecodeKernel"),)),
    # TMA tensor maps, persistent launch
    Row(Family.HOPPER, Mma.WGMMA, hopper_layout, "lower.hopper:lower_hopper", "hopper.cu.j2",
        "runtime.hopper:HopperKernel",
        (Serving(VARLEN, "runtime.varlen:VarlenHopperKernel", "hopper_varlen.cu.j2"),)),
)

# Families with at least one template, in table order (what `compile --skip-unsupported` keeps).
WITH_TEMPLATE = tuple(dict.fromkeys(row.family for row in FAMILIES))


@functools.lru_cache(maxsize=None)
def resolve(path: str):
    """The object a "module:attribute" path under tiledsl names, imported on first use."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attribute)


def _serving_kinds(spec: KernelSpec) -> tuple[str, ...]:
    p = spec.problem
    return ((PAGED,) if p.kv_page_size is not None else ()) + ((VARLEN,) if p.seq_layout is SeqLayout.VARLEN else ())


def _serving_refusal(spec: KernelSpec) -> tuple[str, str] | None:
    """(key, what) when the spec asks for a serving layout that no template implements yet."""
    rows = [row for row in FAMILIES if row.family is spec.family]
    if spec.problem.kv_page_size is not None and not any(row.mma is spec.schedule.mma and row.variant(PAGED)
                                                         for row in rows):
        paged = [row.mma.value for row in rows if row.variant(PAGED)]
        return "kv_cache", "paged KV" + (f" on {spec.schedule.mma.value} ({' or '.join(paged)} reads it)"
                                         if paged else "")
    layout = spec.problem.seq_layout
    if layout is SeqLayout.VARLEN and not any(row.variant(VARLEN) for row in rows):
        return "layout", f"layout = {layout.value}"
    if len(_serving_kinds(spec)) > 1:
        return "layout", f"layout = {layout.value} with a paged KV cache"
    return None


def _mods_refusal(spec: KernelSpec) -> tuple[str, str] | None:
    """(key, what) when the spec modifies its scores or masks: no template spells those yet."""
    mods = spec.problem.mods
    if not mods.active:
        return None
    written = [key for key, _ in spec.spans if key in MOD_KEYS + ("mask",)]
    return (written[0] if written else "mask"), "score and mask modifications (" + ", ".join(mods.config()) + ")"


def missing_template(spec: KernelSpec) -> str:
    """Why no template builds `spec` ("" when one does): what `compile --skip-unsupported` skips."""
    if spec.family not in WITH_TEMPLATE:
        return f"the {spec.family.value} family has no CUDA template yet"
    refusal = _serving_refusal(spec)
    if refusal:
        return f"{refusal[1]} has no CUDA template yet for the {spec.family.value} family"
    refusal = _mods_refusal(spec)
    return f"{refusal[1]} have no CUDA template yet for the {spec.family.value} family" if refusal else ""


def row_for(spec: KernelSpec) -> Row:
    """The spec's row; a family (or MMA variant) without a template is a SpecError naming it, and
    so is a serving layout (paged KV, varlen) that the family's template can't read yet: the
    checker, explain and the float64 reference take those, the kernels come later."""
    refusal = _serving_refusal(spec)
    if refusal:
        raise SpecError(missing_template(spec), spec.span_of(refusal[0]), spec.source_text,
                        "`tiledsl explain` and tiledsl.reference.serving take it; "
                        f"remove `{refusal[0]}` to build a kernel")
    refusal = _mods_refusal(spec)
    if refusal:
        raise SpecError(missing_template(spec), spec.span_of(refusal[0]), spec.source_text,
                        "`tiledsl explain` and the float64 reference (tiledsl.reference) take them")
    for row in FAMILIES:
        if row.family is spec.family and row.mma is spec.schedule.mma:
            return row
    built = ", ".join(f.value for f in WITH_TEMPLATE)
    if spec.family in WITH_TEMPLATE:
        raise SpecError(f"the {spec.family.value} family has no CUDA template for mma {spec.schedule.mma.value} yet",
                        spec.span_of("mma") or spec.span, spec.source_text,
                        "mma " + " or ".join(r.mma.value for r in FAMILIES if r.family is spec.family))
    raise SpecError(f"the {spec.family.value} family has no CUDA template yet", spec.span, spec.source_text,
                    f"families with templates: {built}")


def _serving(spec: KernelSpec, row: Row) -> Serving | None:
    """The row's serving variant the spec reads (row_for has refused the ones it lacks)."""
    kinds = _serving_kinds(spec)
    return row.variant(kinds[0]) if kinds else None


def template_of(spec: KernelSpec) -> str:
    row = row_for(spec)
    variant = _serving(spec, row)
    return variant.template if variant and variant.template else row.template


def layout_parameters(row: Row) -> frozenset[str]:
    """The overrides a row's layout function takes (keyword arguments after spec and limits)."""
    return frozenset(list(inspect.signature(row.layout).parameters)[2:])


def layout_of(spec: KernelSpec, limits: DeviceLimits = H200, **overrides) -> Layout:
    """The layout of `spec` on `limits`, from its row's layout function; SpecError at the spec line when
    it does not fit. A family, MMA or dtype without a template gets the scheduler graph's dense-tile
    model (so explain still shows a budget). `overrides` are the row's layout parameters (e.g. decode's
    stages / tile_kv, fa2's min_blocks_per_sm / q_in_registers, fa1's pass_rows)."""
    loop_order_rules(spec)
    row = next((r for r in FAMILIES if r.family is spec.family and r.mma is spec.schedule.mma), None)
    if row is None or spec.problem.dtype not in TEMPLATE_DTYPES:
        return graph_model_layout(spec, limits)
    return row.layout(spec, limits, **overrides)


def lower(spec: KernelSpec, limits: DeviceLimits = H200, graph=None, **overrides):
    """The KernelPlan of `spec` on `limits`: its layout (computed once, with the overrides the row's
    layout function takes), its scheduler graph (the passes run once, handed that layout), then the
    row's lowering with (spec, layout, graph, template) and the other overrides (decode's
    prefetch_first, hopper's empty_arrivals). `graph`: one the caller has built already for `spec`
    on `limits` (explain, the tuner), reused as it is."""
    row = row_for(spec)
    if spec.problem.dtype not in TEMPLATE_DTYPES:
        raise SpecError(f"the {spec.family.value} template computes with fp16 or bf16 tensor cores, not "
                        f"{spec.problem.dtype.value}", spec.span_of("dtype"), spec.source_text, "dtype = bf16 or fp16")
    for_layout = {key: overrides.pop(key) for key in list(overrides) if key in layout_parameters(row)}
    if graph is None:
        layout = layout_of(spec, limits, **for_layout)
        graph = resolve("schedule.passes:run_passes")(spec, limits, layout=layout)
    elif for_layout:
        raise TypeError(f"lower: layout overrides {sorted(for_layout)} need a graph built with them")
    return resolve(row.lowering)(spec, graph.layout, graph, template_of(spec), **overrides)


def _one_kernel(path_or_text, name: str | None) -> KernelSpec:
    """The one concrete kernel of a path or text (`name` picks an attention block); a search space or
    several blocks are a RuntimeInputError that says how to pick one."""
    is_path = resolve("frontend.parse:looks_like_path")(path_or_text)
    items = resolve("frontend.parse:parse_file" if is_path else "frontend.parse:parse_text")(path_or_text)
    where = str(path_or_text) if is_path else "the spec text"
    names = [item.name for item in items]
    if name is not None:
        items = [item for item in items if item.name == name]
        if not items:
            raise RuntimeInputError(f"{where}: no attention block named {name!r}; its blocks: {', '.join(names)}")
    if len(items) == 1 and not isinstance(items[0], KernelSpec):   # a search space
        space = items[0]
        raise RuntimeInputError(f"{where}: '{space.name}' is a search space of {len(space.expand()[0])} legal "
                                "kernels, not one kernel; pick one from tiledsl.load_specs(...) or tune it "
                                f"(`tiledsl tune {where} --seqlen N`)")
    if len(items) != 1:
        raise RuntimeInputError(f"{where}: {len(items)} attention blocks ({', '.join(names)}); pass name= to pick one")
    return items[0]


def compile(spec_or_path, name: str | None = None, limits: DeviceLimits = H200, **overrides):  # noqa: A001
    """A Kernel (the family's class) from a KernelSpec, a .tile path or spec text (`name` picks one
    of several); `overrides` go to `lower`."""
    if isinstance(spec_or_path, KernelSpec):
        spec = spec_or_path
    elif not isinstance(spec_or_path, (str, os.PathLike)):
        raise TypeError(f"tiledsl.compile takes a KernelSpec, a .tile path or spec text, got "
                        f"{type(spec_or_path).__name__}")
    else:
        spec = _one_kernel(spec_or_path, name)
    row = row_for(spec)
    variant = _serving(spec, row)
    return resolve(variant.kernel_class if variant else row.kernel_class)(spec, lower(spec, limits, **overrides))
