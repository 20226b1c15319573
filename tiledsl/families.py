"""The kernel families: one row per family (and MMA variant where the lowering differs) naming its
lowering, its template and its kernel class, and the two dispatchers that read the table (`lower`,
`compile`).

This is the only module that names the families' own modules: lower/ and runtime/ know none
of them, so adding a family is writing its lowering, template and (if its launch differs) kernel
class, then adding a row here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .errors import RuntimeInputError, SpecError
from .lower.plan import KernelPlan
from .lower.fa2 import lower_fa2
from .lower.decode import lower_decode
from .lower.fa1 import lower_fa1
from .lower.hopper import lower_hopper
from .lower.fa2_wgmma import lower_fa2_wgmma
from .frontend.parse import load_specs
from .runtime.kernel import Kernel
from .runtime.decode import DecodeKernel
from .runtime.paged_decode import PagedDecodeKernel
from .runtime.paged_prefill import PagedPrefillKernel
from .runtime.fa1 import Fa1Kernel
from .runtime.hopper import HopperKernel
from .runtime.varlen import VarlenHopperKernel
from .spec import Family, KernelSpec, Mma, SeqLayout


@dataclass(frozen=True)
class Row:
    family: Family
    mma: Mma | None                          # the variant this row lowers; None: any
    lowering: Callable[..., KernelPlan]      # (spec, **overrides) -> plan
    template: str                            # under templates/
    kernel_class: type[Kernel]               # launches the compiled kernel
    paged_class: type[Kernel] | None = None  # launches it on a paged KV cache (None: the template reads no block table)
    seq_layout: SeqLayout = SeqLayout.BATCHED   # the sequence layout the template reads


FAMILIES = (
    Row(Family.FA2, Mma.SYNC, lower_fa2, "fa2.cu.j2", Kernel, PagedPrefillKernel),
    Row(Family.FA2, Mma.WGMMA, lower_fa2_wgmma, "fa2_wgmma.cu.j2", Kernel),
    Row(Family.FA1, None, lower_fa1, "fa1.cu.j2", Fa1Kernel),
    # split kernel + merge, workspace
    Row(Family.DECODE, None, lower_decode, "decode.cu.j2", DecodeKernel, PagedDecodeKernel),
    Row(Family.HOPPER, None, lower_hopper, "hopper.cu.j2", HopperKernel),   # TMA tensor maps, persistent launch
    # packed sequences
    Row(Family.HOPPER, None, lower_hopper, "hopper_varlen.cu.j2", VarlenHopperKernel, seq_layout=SeqLayout.VARLEN),
)

# Families with at least one template, in table order (what `compile --skip-unsupported` keeps).
WITH_TEMPLATE = tuple(dict.fromkeys(row.family for row in FAMILIES))


def _serving_refusal(spec: KernelSpec) -> tuple[str, str] | None:
    """(key, what) when the spec asks for a serving layout that no template implements yet."""
    if spec.problem.kv_page_size is not None and not any(
            row.family is spec.family and row.mma in (None, spec.schedule.mma) and row.paged_class for row in FAMILIES):
        paged = [row.mma.value for row in FAMILIES if row.family is spec.family and row.paged_class and row.mma]
        return "kv_cache", "paged KV" + (f" on {spec.schedule.mma.value} ({' or '.join(paged)} reads it)"
                                         if paged else "")
    layout = spec.problem.seq_layout
    if layout is not SeqLayout.BATCHED and not any(row.family is spec.family and row.seq_layout is layout
                                                   for row in FAMILIES):
        return "layout", f"layout = {layout.value}"
    return None


def missing_template(spec: KernelSpec) -> str:
    """Why no template builds `spec` ("" when one does): what `compile --skip-unsupported` skips."""
    if spec.family not in WITH_TEMPLATE:
        return f"the {spec.family.value} family has no CUDA template yet"
    refusal = _serving_refusal(spec)
    return f"{refusal[1]} has no CUDA template yet for the {spec.family.value} family" if refusal else ""


def row_for(spec: KernelSpec) -> Row:
    """The spec's row; a family (or MMA variant) without a template is a SpecError naming it, and
    so is a serving layout (paged KV, varlen) that the family's template can't read yet: the
    checker, explain and the float64 reference take those, the kernels come later."""
    refusal = _serving_refusal(spec)
    if refusal:
        raise SpecError(missing_template(spec), spec.span_of(refusal[0]), spec.source_text,
                        "`tiledsl explain` and tiledsl.reference.serving take it; "
                        f"remove `{refusal[0]}` to build a kernel")
    for row in FAMILIES:
        if (row.family is spec.family and row.mma in (None, spec.schedule.mma)
                and row.seq_layout is spec.problem.seq_layout):
            return row
    built = ", ".join(f.value for f in WITH_TEMPLATE)
    if spec.family in WITH_TEMPLATE:
        raise SpecError(f"the {spec.family.value} family has no CUDA template for mma {spec.schedule.mma.value} yet",
                        spec.span_of("mma") or spec.span, spec.source_text,
                        "mma " + " or ".join(r.mma.value for r in FAMILIES if r.family is spec.family and r.mma))
    raise SpecError(f"the {spec.family.value} family has no CUDA template yet", spec.span, spec.source_text,
                    f"families with templates: {built}")


def lower(spec: KernelSpec, **overrides) -> KernelPlan:
    """The plan for `spec` from its family's lowering, naming the family's template."""
    row = row_for(spec)
    return dataclasses.replace(row.lowering(spec, **overrides), template=row.template)


def compile(spec_or_path, name: str | None = None, **overrides) -> Kernel:  # noqa: A001 - tiledsl.compile
    """A Kernel (the family's class) from a KernelSpec, a .tile path or spec text (`name` picks one
    of several); `overrides` go to the family's lowering."""
    if isinstance(spec_or_path, KernelSpec):
        spec = spec_or_path
    else:
        specs = load_specs(spec_or_path)
        if name is not None:
            specs = [s for s in specs if s.name == name]
        if len(specs) != 1:
            names = ", ".join(s.name for s in load_specs(spec_or_path))
            raise RuntimeInputError(f"{spec_or_path}: expected one kernel, found {len(specs)} ({names}); pass name=")
        spec = specs[0]
    row = row_for(spec)
    kernel_class = row.paged_class if spec.problem.kv_page_size is not None else row.kernel_class
    return kernel_class(spec, lower(spec, **overrides))
