"""Runtime for the Hopper warp-specialized family: the FA2 grid and launch order, with Q, K and V
handed to the kernel as TMA tensor maps instead of pointers and strides. TMA reads rows through
byte strides that are multiples of 16 from a 16-byte aligned address: the checks every kernel makes
before launch (runtime.Kernel.check_inputs) already refuse anything else, naming the tensor."""
from __future__ import annotations

from .kernel import Kernel
from .inputs import Shapes
from ..spec import Mask
from .tensor_maps import tensor_map
from .tensors import TensorView

PERSISTENT_MASKED_TILES = 16


class HopperKernel(Kernel):
    """A compiled hopper kernel; called like any Kernel: `o, lse = kernel(q, k, v)`.

    `persistent` True launches one block per resident slot, each walking work items in launch
    order, so a block's next Q, K and V load while it stores the last O; False launches one block
    per item, and the GPU hands the next item to whichever SM frees first. None (the default)
    picks as measured (bench/results/2026-11-30-hopper-ablation-3.json and -4.json): persistent
    without a mask (every item costs the same; +5-12% at 1k-8k), and under a causal or window mask
    while an item sees at most PERSISTENT_MASKED_TILES kv tiles (1k: +11-22%); one block per item
    for longer masked items, whose costs spread so far that the static walk balances them worse
    than the GPU's block scheduler (-3% to -18% at 4k-16k)."""
    persistent: bool | None = None

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        import numpy as np
        plan = self.plan
        tile_q, tile_kv = plan.launch.tile_q, self.spec.schedule.tile_kv
        q_tiles, pairs = -(-shapes.q_len // tile_q), shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        i64 = np.int64
        # With no keys no K/V tile is loaded; Q's map stands in (a map needs at least one row).
        k_map, v_map = (tensor_map(k, tile_kv), tensor_map(v, tile_kv)) if shapes.kv_len else (tensor_map(q, tile_q),
                                                                                               ) * 2
        args = (tensor_map(q, tile_q), k_map, v_map,
                np.uintp(o.pointer), np.uintp(lse.pointer), np.uintp(kv_lens.pointer if kv_lens else 0),
                np.int32(shapes.q_len), np.int32(shapes.kv_len), np.int32(shapes.heads),
                np.int32(shapes.heads // shapes.kv_heads), *(i64(s) for s in o.strides[:3]),
                np.int32(self.order_groups_for(shapes, q.device_id)), np.int32(q_tiles * pairs))
        persistent = self.persistent
        if persistent is None:
            persistent = self.spec.problem.mask is Mask.NONE or -(-shapes.kv_len // tile_kv) <= PERSISTENT_MASKED_TILES
        blocks = min(q_tiles * pairs, self.slots(q.device_id)) if persistent else q_tiles * pairs
        self.launch_function(self.function(), (blocks, 1, 1), args, q.device_id, stream)
