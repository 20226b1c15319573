"""Runtime for the Hopper warp-specialized family: the FA2 grid and launch order, with Q, K and V
handed to the kernel as TMA tensor maps instead of pointers and strides. TMA reads rows through
byte strides that are multiples of 16 from a 16-byte aligned address: the checks every kernel makes
before launch (runtime.Kernel.check_inputs) already refuse anything else, naming the tensor."""
from __future__ import annotations

from .inputs import Shapes
from .kernel import Kernel
from .launch import CallBuilder, i32, pointer_arg, strides_args
from ..spec import Mask
from .tensor_maps import map_arg
from .tensors import TensorView

PERSISTENT_MASKED_TILES = 16


class HopperKernel(Kernel):
    """A compiled hopper kernel; called like any Kernel: `o, lse = kernel(q, k, v)`.

    `persistent` True launches one block per resident slot, each walking work items in launch
    order, so a block's next Q, K and V load while it stores the last O; False launches one block
    per item, and the GPU hands the next item to whichever SM frees first. None (the default)
    picks as measured (bench/NOTES.md): persistent without a mask (every item costs the same), and
    under a causal or window mask while an item sees at most PERSISTENT_MASKED_TILES kv tiles; one
    block per item for longer masked items, whose costs spread so far that the static walk balances
    them worse than the GPU's block scheduler."""
    persistent: bool | None = None

    def launch_options(self) -> tuple:
        return super().launch_options() + (self.persistent,)

    def add_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                     lse: TensorView, kv_lens: TensorView | None, shapes: Shapes) -> None:
        plan = self.plan
        tile_q, tile_kv = plan.launch.tile_q, self.spec.schedule.tile_kv
        q_tiles, pairs = -(-shapes.q_len // tile_q), shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        # With no keys no K/V tile is loaded; Q's map stands in (a map needs at least one row).
        k_map, v_map = (map_arg(k, tile_kv), map_arg(v, tile_kv)) if shapes.kv_len else (map_arg(q, tile_q),) * 2
        args = (map_arg(q, tile_q), k_map, v_map, pointer_arg(o), pointer_arg(lse), pointer_arg(kv_lens),
                i32(shapes.q_len), i32(shapes.kv_len), i32(shapes.heads), i32(shapes.heads // shapes.kv_heads),
                *strides_args(o), i32(self.order_groups_for(shapes, b.device_id)), i32(q_tiles * pairs))
        persistent = self.persistent
        if persistent is None:
            persistent = self.spec.problem.mask is Mask.NONE or -(-shapes.kv_len // tile_kv) <= PERSISTENT_MASKED_TILES
        blocks = min(q_tiles * pairs, self.slots(b.device_id)) if persistent else q_tiles * pairs
        b.launch(self.function(b.device_id), (blocks, 1, 1), plan.launch.threads, plan.launch.smem_bytes, args,
                 self.name)
