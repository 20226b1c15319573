"""The layout pass: `layout_of(spec, limits)`, every size of a kernel from its spec and the device limits,
by the family's layout function (one module per family; the shared pieces in base.py)."""
from __future__ import annotations

from ..device_limits import H200, DeviceLimits
from ..spec import Family, KernelSpec, LoopOrder, Mma
from .base import TEMPLATE_DTYPES, Layout, refuse
from .decode import decode_layout
from .fa1 import fa1_layout
from .fa2 import fa2_layout, fa2_wgmma_layout
from .hopper import hopper_layout
from .model import graph_model_layout

LAYOUTS = {
    (Family.FA2, Mma.SYNC): fa2_layout,
    (Family.FA2, Mma.WGMMA): fa2_wgmma_layout,
    (Family.FA1, Mma.SYNC): fa1_layout,
    (Family.DECODE, Mma.SYNC): decode_layout,
    (Family.HOPPER, Mma.WGMMA): hopper_layout,
}


def layout_of(spec: KernelSpec, limits: DeviceLimits = H200, **overrides) -> Layout:
    """The layout of `spec` on `limits`; SpecError at the spec line when it does not fit. The
    overrides are the lowerings' (e.g. decode's stages / tile_kv, fa2's min_blocks_per_sm)."""
    if spec.family is Family.FA1 and spec.schedule.split_kv != 1:
        refuse(spec, "split", "split kv needs the q-outer order (FA1 already walks kv tiles outermost)",
                "use `order q, kv` or drop `split`")
    if spec.family is Family.HOPPER and spec.schedule.order is LoopOrder.KV_OUTER:
        refuse(spec, "order", "warp-specialized kernels are built for the q-outer order",
               "use `order q, kv` with warpgroups")
    build = LAYOUTS.get((spec.family, spec.schedule.mma))
    if build is None or spec.problem.dtype not in TEMPLATE_DTYPES:
        return graph_model_layout(spec, limits)
    return build(spec, limits, **overrides)
