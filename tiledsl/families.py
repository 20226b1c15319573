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
from .mods.model import MASK_MODS, SCORE_MODS
from .spec import KV_DTYPES, Axis, CopyVia, Descale, DType, Family, KernelSpec, LaunchKind, LoopOrder, Mma, SeqLayout

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
    dtypes: tuple[DType, ...] = TEMPLATE_DTYPES   # what its tensor cores compute in (`dtype =`)

    def variant(self, kind: str) -> Serving | None:
        return next((v for v in self.serving if v.kind == kind), None)


@dataclass(frozen=True)
class Features:
    """What a family's kernels take, setting by setting, beside its rows (the MMA instructions, dtypes
    and serving layouts are the rows'). `feature_refusal` reads both for check, for `lower` and so for
    every template: a config one of them takes, the others take too."""
    orders: tuple[LoopOrder, ...]
    warp_axes: tuple[Axis, ...]         # () : the warps follow from the warpgroups
    copies: tuple[CopyVia, ...]
    warpgroups: bool                    # producer / consumer warpgroups, and their overlap
    queries: bool                       # `queries = N`: a few queries per sequence
    split_kv: bool                      # `split kv = N | auto`
    kv_dtypes: tuple[DType, ...] = ()   # K/V storage besides the dtype (an FP8 cache)


FEATURES = {
    Family.FA1: Features((LoopOrder.KV_OUTER,), (Axis.Q, Axis.KV), (CopyVia.CP_ASYNC,), False, False, False),
    Family.FA2: Features((LoopOrder.Q_OUTER,), (Axis.Q,), (CopyVia.CP_ASYNC,), False, False, False),
    Family.DECODE: Features((LoopOrder.Q_OUTER,), (Axis.KV,), (CopyVia.CP_ASYNC,), False, True, True, KV_DTYPES),
    Family.HOPPER: Features((LoopOrder.Q_OUTER,), (), (CopyVia.TMA,), True, False, False),
}


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
        (Serving(VARLEN, "runtime.varlen:VarlenHopperKernel", "hopper_varlen.cu.j2"),),
        TEMPLATE_DTYPES + (DType.E4M3,)),   # e4m3: FP8 Q, K, V (templates/hopper_fp8.cuh)
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


# The modifications each family's forward template spells on each sequence layout (mods/model.py's field
# names); the rest are refused. The hopper template takes them on batched sequences, and its varlen variant
# the score modifications and the expressions (its sequences are the documents already: a document or prefix
# mask is refused there; dropout is the batched kernels' alone); the decode template the score modifications on
# contiguous, paged and FP8 KV caches alike, the expressions on the 16-bit ones. FP8 inputs take none.
EXPRESSIONS = ("score_mod", "mask_mod")
BUILT_MODS = {(Family.HOPPER, SeqLayout.BATCHED): SCORE_MODS + MASK_MODS + ("blocks",) + EXPRESSIONS + ("dropout",),
              (Family.HOPPER, SeqLayout.VARLEN): SCORE_MODS + EXPRESSIONS,
              (Family.DECODE, SeqLayout.BATCHED): SCORE_MODS + EXPRESSIONS}


def takes_mods(family: Family, mods, layout: SeqLayout = SeqLayout.BATCHED) -> bool:
    """Whether `family`'s 16-bit template on `layout` spells every modification of `mods` (BUILT_MODS)."""
    return not set(mods.config()) - set(BUILT_MODS.get((family, layout), ()))


def _mods_refusal(spec: KernelSpec) -> tuple[str, str] | None:
    """(key, what) when the spec modifies its scores or masks in a way no template of its family spells."""
    mods = spec.problem.mods
    if not mods.active:
        return None
    built = BUILT_MODS.get((spec.family, spec.problem.seq_layout), ()) if not spec.problem.fp8 else ()
    if spec.problem.kv_fp8:   # the FP8 KV cache's decode paths spell the built-in score modifications only
        built = tuple(key for key in built if key not in EXPRESSIONS)
    config = {key: value for key, value in mods.config().items() if key not in built}
    if not config:
        return None
    written = [key for key, _ in spec.spans if key in tuple(config) + ("mask",)]
    return (written[0] if written else "mask"), "score and mask modifications (" + ", ".join(config) + ")"


def _names(families) -> str:
    names = [f.value for f in dict.fromkeys(families)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def feature_refusal(spec: KernelSpec) -> tuple[str, str, str] | None:
    """(setting key, why, hint) for the first setting `spec`'s family does not take (FEATURES and the
    family's rows: MMA instructions, dtypes, serving layouts), or None. Check refuses it at the key's
    line and `lower` refuses it too, so the two answer alike for every family and setting."""
    s, p, fam = spec.schedule, spec.problem, spec.family
    f = FEATURES[fam]
    rows = [row for row in FAMILIES if row.family is fam]
    if not rows:   # a family without a template: row_for names it
        return None
    mmas = tuple(row.mma for row in rows)
    if p.queries_per_seq is not None and not f.queries:   # warpgroups name the family before queries do
        return ("queries", f"queries (decode) and warpgroups ({fam.value}) exclude each other: the {fam.value} family "
                "has no decode path", "remove `warpgroups` for a decode kernel, or `queries` for a hopper kernel")
    if p.seq_layout is SeqLayout.VARLEN and f.queries:
        return ("layout", "layout = varlen packs sequences of any length; `queries = N` (decode) fixes every "
                "sequence's queries", "remove `queries` for varlen prefill, or `layout` for decode")
    if p.kv_dtype is not None and p.kv_dtype not in f.kv_dtypes:
        takers = _names(g for g, feat in FEATURES.items() if p.kv_dtype in feat.kv_dtypes)
        return ("kv_dtype", f"kv_dtype = {p.kv_dtype.value} (an FP8 KV cache) is only for the {takers} family; this "
                f"kernel is {fam.value}", "add `queries = N` (decode), or remove `kv_dtype`")
    if s.fp8_convert is not None and p.kv_dtype is None:
        return ("dequant", "`dequant` says where an FP8 KV cache becomes 16-bit; this kernel reads a "
                f"{p.dtype.value} cache", "add `kv_dtype = e4m3` (decode), or remove `dequant`")
    if p.kv_dtype is not None and p.dtype not in (DType.FP16, DType.BF16):
        return ("kv_dtype", f"an FP8 KV cache is dequantized to fp16 or bf16 on chip; dtype is {p.dtype.value}",
                "write `dtype = bf16` or `dtype = fp16`")
    refusal = _fp8_refusal(spec)
    if refusal:
        return refusal
    if s.split_kv != 1 and not f.split_kv:
        takers = _names(g for g, feat in FEATURES.items() if feat.split_kv)
        return ("split", f"split kv = {s.split_kv} is only for the {takers} family; this kernel is {fam.value}",
                "split-KV needs `queries = N` (decode); for prefill remove `split`")
    if s.order not in f.orders:
        return ("order", f"the {fam.value} family runs q outer; `order kv, q` is FA1", "write `order q, kv`")
    if f.warp_axes and s.warp_axis not in f.warp_axes:
        if fam is Family.FA2:
            return ("warps", "q-outer (FA2) splits warps along q; warps along kv is FA1's split-K: write "
                    "`order kv, q`", "or write `warps N along q`")
        return ("warps", f"the {fam.value} family splits warps along {f.warp_axes[0].value}: its few query rows can't "
                "be shared out", f"write `warps N along {f.warp_axes[0].value}` (the default for {fam.value})")
    if s.copy not in f.copies:
        if s.copy is CopyVia.TMA:
            takers = _names(g for g, feat in FEATURES.items() if CopyVia.TMA in feat.copies)
            return ("pipeline", f"TMA copies need the {takers} family; {fam.value} copies with cp.async",
                    "write `via cp.async`, or add `warpgroups producer 1, consumer 2` for a Hopper kernel")
        return ("pipeline", f"the {fam.value} family copies with TMA, not {s.copy.value}", "write `via tma`")
    if s.mma not in mmas:
        if len(mmas) == 1 and mmas[0] is Mma.WGMMA:
            return ("mma", f"the {fam.value} family runs on wgmma, not {s.mma.value}",
                    "remove `mma` or write `mma wgmma`")
        takers = _names(row.family for row in FAMILIES if row.mma is s.mma)
        return ("mma", f"`mma {s.mma.value}` is built for the {takers} families; this kernel is {fam.value}",
                f"remove `mma` ({fam.value} uses {' or '.join(m.value for m in mmas)})")
    if (s.pingpong or s.intra_overlap) and not f.warpgroups:
        return ("overlap", f"overlap needs warp specialization (the hopper family); {fam.value} has no warpgroups",
                "add `warpgroups producer 1, consumer 2`, or remove `overlap`")
    row = next(r for r in rows if r.mma is s.mma)
    if p.dtype not in row.dtypes:
        return ("dtype", f"the {fam.value} template computes with {' or '.join(d.value for d in row.dtypes)} tensor "
                f"cores, not {p.dtype.value}", f"dtype = {' or '.join(d.value for d in row.dtypes)}")
    refusal = _serving_refusal(spec)
    if refusal:
        return (refusal[0], missing_template(spec), f"remove `{refusal[0]}`, or use a family whose template reads it "
                "(the README's family table)")
    return None


def _fp8_refusal(spec: KernelSpec) -> tuple[str, str, str] | None:
    """(key, why, hint) for FP8 attention (dtype = e4m3) where its one template does not take a setting, or for
    FP8's own settings on 16-bit inputs."""
    p, s = spec.problem, spec.schedule
    if not p.fp8:
        for key, value in (("out_dtype", p.out_dtype), ("descale", p.descale)):
            if value is not None:
                return (key, f"{key} belongs to FP8 attention (dtype = e4m3); this kernel's inputs are "
                        f"{p.dtype.value}", f"write `dtype = e4m3`, or remove `{key}`")
        return None
    hopper = "add `warpgroups producer 1 regs 40, consumer 2 regs 232` and `pipeline 2 stages via tma` (hopper)"
    if spec.family is not Family.HOPPER:
        return ("dtype", f"dtype = e4m3 (FP8 Q, K and V on e4m3 wgmma) is only for the hopper family; this kernel "
                f"is {spec.family.value}", hopper + ", or write `dtype = bf16`")
    if p.kv_dtype is not None:
        return ("kv_dtype", "dtype = e4m3 stores K and V in e4m3 already", "remove `kv_dtype`")
    if p.seq_layout is SeqLayout.VARLEN and p.descales is Descale.PER_BLOCK:
        # a packed sequence's tiles start at its own first row: per-tile descales would need an offset per
        # sequence, which the kernel's descale indexing (per tensor, per (sequence, kv head)) does not read
        return ("descale", "descale = per_block indexes the tiles of equal-length sequences; layout = varlen packs "
                "sequences of any length, whose tiles have no such index", "write `descale = per_head` (one "
                "descale per (sequence, kv head)) or `descale = per_tensor`, or remove `layout`")
    if s.launch is LaunchKind.DYNAMIC:
        return ("launch", "FP8 attention's producer transposes V for the items it walks by itself; `launch "
                "dynamic` hands items out at run time", "write `launch persistent` or `launch grid`")
    return None


def missing_template(spec: KernelSpec) -> str:
    """Why no template builds `spec` ("" when one does): what `compile --skip-unsupported` skips."""
    if spec.family not in WITH_TEMPLATE:
        return f"the {spec.family.value} family has no CUDA template yet"
    refusal = _serving_refusal(spec)
    if refusal:
        return f"{refusal[1]} has no CUDA template yet for the {spec.family.value} family"
    refusal = _mods_refusal(spec)
    if not refusal:
        return ""
    # the family's 16-bit kernels spell some (BUILT_MODS): say which of its kernels lack them
    kernels = " and ".join(([f"{spec.problem.dtype.value} (FP8)"] if spec.problem.fp8 else [])
                           + (["varlen"] if spec.problem.seq_layout is SeqLayout.VARLEN else []))
    which = f"the {spec.family.value} family's {kernels} kernels" \
        if kernels and any(family is spec.family for family, _ in BUILT_MODS) else f"the {spec.family.value} family"
    return f"{refusal[1]} have no CUDA template yet for {which}"


def row_for(spec: KernelSpec) -> Row:
    """The spec's row; a family (or MMA variant) without a template is a SpecError naming it, and
    so is any setting the family does not take (feature_refusal: a dtype, a serving layout such as
    paged KV or varlen, ... that its template can't read), at that setting's line; score and mask
    modifications parse, check and explain (the float64 reference runs them), but no template spells them
    yet: refused here."""
    if spec.family in WITH_TEMPLATE:
        refusal = feature_refusal(spec)
        if refusal:
            key, message, hint = refusal
            raise SpecError(message, spec.span_of(key), spec.source_text, hint)
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
    if row is None or spec.problem.dtype not in row.dtypes:
        return graph_model_layout(spec, limits)
    return row.layout(spec, limits, **overrides)


def lower(spec: KernelSpec, limits: DeviceLimits = H200, graph=None, **overrides):
    """The KernelPlan of `spec` on `limits`: its layout (computed once, with the overrides the row's
    layout function takes), its scheduler graph (the passes run once, handed that layout), then the
    row's lowering with (spec, layout, graph, template) and the other overrides (decode's
    prefetch_first, hopper's empty_arrivals). `graph`: one the caller has built already for `spec`
    on `limits` (explain, the tuner), reused as it is."""
    row = row_for(spec)   # every setting the family takes, its dtype and serving layouts among them
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
