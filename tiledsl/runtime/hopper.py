"""Runtime for the Hopper warp-specialized family: the FA2 grid and launch order, with Q, K and V
handed to the kernel as TMA tensor maps instead of pointers and strides. TMA reads rows through
byte strides that are multiples of 16 from a 16-byte aligned address: the checks every kernel makes
before launch (runtime.Kernel.check_inputs) already refuse anything else, naming the tensor."""
from __future__ import annotations

from ..errors import LaunchError, RuntimeInputError
from ..mods.model import AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, Documents
from .aux_args import AuxArguments, aux_names
from .device import capturing, stream_reader
from .inputs import Shapes
from .kernel import Kernel
from .index_checks import add_check, host_validation
from .launch import CallBuilder, allocator, i32, pointer_arg, strides_args
from ..spec import DType, ItemOrder, LaunchKind, Mask
from .fp8_descales import FP8_DESCALES, descale_views
from .tensor_maps import e4m3_element, map_arg
from .tensors import TensorView

PERSISTENT_MASKED_TILES = 16
# `launch dynamic`: (device, stream handle) -> the int32 pair [next ticket, producers done] its kernels
# share. One per stream: launches on a stream run one after another, and each leaves the pair at zero
# (templates/tile_scheduler.cuh); launches on two streams may overlap, so they never share one.
_ITEM_COUNTERS: dict[tuple[int, int], object] = {}
# Launches captured into CUDA graphs each get a pair of their own, so graphs replayed side by side never
# share one: taken from a per-device pool zeroed by the first eager dynamic launch (no fill node in the
# graph), or, with no pool or the pool used up, allocated under capture (zero-filled by a node of the
# graph). Captured pairs are kept for the process's life: their memory is never handed to anything else.
CAPTURE_POOL_PAIRS = 4096
_CAPTURE_POOLS: dict[int, list] = {}   # device -> [pool array, pairs handed out]
_CAPTURED_COUNTERS: list = []


def item_counter_provider(like, device_id: int):
    """A no-argument function that returns the zeroed counter pair (an int32 array of 2, in `like`'s
    framework) for one dynamic launch on the caller's current stream: the stream's own for eager
    launches; under CUDA graph capture a pair no other launch uses. Read per call: a prepared call
    may run on any stream."""
    stream = stream_reader(like)
    zeros = allocator(like, (2,), "int32", zero=True)

    def counter():
        if capturing(like):
            pool = _CAPTURE_POOLS.get(device_id)
            if pool is not None and pool[1] < CAPTURE_POOL_PAIRS:
                pool[1] += 1
                return pool[0][2 * pool[1] - 2:2 * pool[1]]
            _CAPTURED_COUNTERS.append(zeros())
            return _CAPTURED_COUNTERS[-1]
        key = (device_id, stream())
        found = _ITEM_COUNTERS.get(key)
        if found is None:
            if device_id not in _CAPTURE_POOLS:
                pool = allocator(like, (2 * CAPTURE_POOL_PAIRS,), "int32", zero=True)()
                _synchronize(like)   # once per device: graphs replay on other streams, after the fill
                _CAPTURE_POOLS[device_id] = [pool, 0]
            found = _ITEM_COUNTERS[key] = zeros()
        return found
    return counter


def _synchronize(like) -> None:
    if type(like).__module__.startswith("torch"):
        import torch
        torch.cuda.synchronize(like.device)
    else:
        from .device import cupy_module
        cupy_module().cuda.get_current_stream().synchronize()


def launch_rule(problem, kv_tiles: int) -> tuple[bool, str]:
    """(persistent, why) of the runtime's launch for a spec without `launch` whose sequences have kv_tiles
    tiles of keys (HopperKernel's docstring says why)."""
    if problem.mods.document is not None:
        # an item sees about one document's tiles, whatever the sequence's length, and a persistent block's
        # producer searches the next item's documents while the consumers finish this one
        return True, "documents: an item sees about one document's kv tiles"
    if problem.mask is Mask.NONE and problem.mods.mask_mod is None:
        return True, "no mask, every item costs the same"
    # a mask_mod's items, like a mask's, see different numbers of kv tiles
    walk = kv_tiles <= PERSISTENT_MASKED_TILES
    return walk, f"items of {'at most' if walk else 'over'} {PERSISTENT_MASKED_TILES} kv tiles"


class HopperKernel(AuxArguments, Kernel):
    """A compiled hopper kernel; called like any Kernel: `o, lse = kernel(q, k, v)`.

    `persistent` True launches one block per resident slot, each walking work items in launch
    order, so a block's next Q, K and V load while it stores the last O; False launches one block
    per item, and the GPU hands the next item to whichever SM frees first. None (the default)
    picks as measured (bench/NOTES.md): persistent without a mask (every item costs the same) or with
    documents, and under a causal or window mask while an item sees at most PERSISTENT_MASKED_TILES kv tiles; one
    block per item for longer masked items, whose costs spread so far that the static walk balances
    them worse than the GPU's block scheduler. A spec's `launch` (plan.launch_kind)
    decides instead of that rule; `persistent` still overrides both (tests, benchmarks), except
    that a grid kernel's blocks each run their own item only. A dynamic kernel launched one block
    per item takes no ticket that finds an item."""
    persistent: bool | None = None

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self.aux_names = aux_names(spec)
        # FP8 inputs: the descales follow (runtime/fp8_descales.py); the modified kernels have no FP8 template
        self.fp8_descales = FP8_DESCALES if spec.problem.fp8 else ()
        if self.aux_names or self.fp8_descales:
            self.CALL = type(self).CALL + self.aux_names + self.fp8_descales

    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None, *, validate: bool | None = None, aux=None,
                 q_descale=None, k_descale=None, v_descale=None):
        """`o, lse = kernel(q, k, v)`; an FP8 kernel (dtype = e4m3) takes float8_e4m3fn q, k, v and their float32
        descales (runtime/fp8_descales.py)."""
        tensors = (q, k, v, kv_lens, out, lse) + self.aux_tensors(aux) + self.descale_tensors(q_descale, k_descale,
                                                                                              v_descale)
        return self.run_call(tensors, (validate,), validate=validate)

    def bind(self, q, k, v, kv_lens=None, out=None, lse=None, aux=None, q_descale=None, k_descale=None,
             v_descale=None, **options):
        """Kernel.bind with the modifications' aux tensors and FP8's descales."""
        tensors = (q, k, v, kv_lens, out, lse) + self.aux_tensors(aux) + self.descale_tensors(q_descale, k_descale,
                                                                                              v_descale)
        if out is None or lse is None:
            out, lse = self.prepare_call(tensors, immediate=True, **options).results
        tensors = (q, k, v, kv_lens, out, lse) + tensors[6:]
        call = self.prepare_call(tensors, **options)
        return (lambda: call(*tensors)), out, lse

    def descale_tensors(self, q_descale, k_descale, v_descale) -> tuple:
        """FP8's descales in CALL order; descales handed to a 16-bit kernel are refused."""
        if self.fp8_descales:
            return (q_descale, k_descale, v_descale)
        if any(x is not None for x in (q_descale, k_descale, v_descale)):
            raise RuntimeInputError(f"{self.name}: q_descale / k_descale / v_descale are for FP8 inputs "
                                    "(dtype = e4m3); "
                                    f"this kernel reads {self.spec.problem.dtype.value} q, k, v")
        return ()

    def add_document_check(self, b: CallBuilder, shapes: Shapes, validate: bool | None) -> None:
        """The host check of the documents' data (mods/checks: ids in runs, bounds in order) on every call
        that checks its index tensors there (runtime/index_checks.host_validation): the kernel reads any
        data in bounds, but documents out of order would give a wrong answer."""
        mods = self.spec.problem.mods
        if mods.document is None or not host_validation(validate) or len(b.tensors) != len(self.CALL):
            return
        from ..mods.checks import check_bounds, check_document_ids
        from .serving_checks import host
        index, kv_len = self.CALL.index(AUX_DOCUMENT_IDS if mods.document is Documents.IDS else AUX_DOCUMENT_BOUNDS), \
            shapes.kv_len
        if mods.document is Documents.IDS:
            add_check(b, lambda tensors: check_document_ids(host(tensors[index], AUX_DOCUMENT_IDS), self.name))
        else:
            add_check(b, lambda tensors: check_bounds(host(tensors[index], AUX_DOCUMENT_BOUNDS), kv_len, self.name))

    def build_call(self, b: CallBuilder, validate: bool | None = None) -> None:
        q, k, v, o, lse, kv_lens, shapes = self.checked_call(b, validate)
        self.add_document_check(b, shapes, validate)
        self.add_launches(b, q, k, v, o, lse, kv_lens, shapes)

    def launch_options(self) -> tuple:
        return super().launch_options() + (self.persistent,)

    def map_elements(self) -> tuple[str, str]:
        """The tensor maps' element kinds (runtime/tensor_maps.ELEMENTS) of (Q and K, V): 16-bit, or e4m3 bytes whose
        box width follows the head dim."""
        p = self.spec.problem
        if p.fp8:
            return e4m3_element(p.head_dim_qk), e4m3_element(p.head_dim_v)
        return "uint16", "uint16"

    def launches_persistent(self, shapes: Shapes) -> bool:
        """Whether this launch is one block per resident slot (else one per work item)."""
        if self.plan.launch_kind == LaunchKind.GRID.value:
            if self.persistent:   # its blocks take blockIdx.x only: fewer blocks would leave items undone
                raise LaunchError(f"{self.name}: a `launch grid` kernel runs one work item per block; persistent "
                                  "launches need `launch persistent` or `launch dynamic`")
            return False
        if self.persistent is not None:
            return self.persistent
        if self.plan.launch_kind:
            return True
        return launch_rule(self.spec.problem, -(-shapes.kv_len // self.spec.schedule.tile_kv))[0]

    def order_groups_for(self, shapes: Shapes, device_id: int) -> int:
        """As Kernel's (longest_first: block_order's groups), with the spec's `launch ... order pair_by_pair`
        putting each pair in its own group."""
        pairs = shapes.batch * shapes.heads
        if self.order_groups is None and self.plan.item_order == ItemOrder.PAIR_BY_PAIR.value:
            return pairs
        return super().order_groups_for(shapes, device_id)

    def add_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                     lse: TensorView, kv_lens: TensorView | None, shapes: Shapes) -> None:
        plan = self.plan
        tile_q, tile_kv = plan.launch.tile_q, self.spec.schedule.tile_kv
        q_tiles, pairs = -(-shapes.q_len // tile_q), shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        # With no keys no K/V tile is loaded; Q's map stands in (a map needs at least one row).
        p = self.spec.problem
        qk_element, v_element = self.map_elements()
        k_map, v_map = ((map_arg(k, tile_kv, qk_element), map_arg(v, tile_kv, v_element)) if shapes.kv_len
                        else (map_arg(q, tile_q, qk_element),) * 2)
        args = (map_arg(q, tile_q, qk_element), k_map, v_map, pointer_arg(o), pointer_arg(lse), pointer_arg(kv_lens),
                self.error_word_arg(b.device_id, b.like), i32(shapes.q_len), i32(shapes.kv_len), i32(shapes.heads),
                i32(shapes.heads // shapes.kv_heads),
                *strides_args(o), i32(self.order_groups_for(shapes, b.device_id)), i32(q_tiles * pairs))
        if plan.launch_kind == LaunchKind.DYNAMIC.value:
            args += (pointer_arg(b.provide("item counter", item_counter_provider(b.like, b.device_id))),)
        args += self.mod_args(b, shapes, ragged=kv_lens is not None)
        if p.fp8:
            args += tuple(pointer_arg(t) for t in descale_views(b, len(self.CALL) - 3, p.descales, shapes, tile_q,
                                                                tile_kv, self.name))
        persistent = self.launches_persistent(shapes)
        blocks = min(q_tiles * pairs, self.slots(b.device_id)) if persistent else q_tiles * pairs
        b.launch(self.function(b.device_id), (blocks, 1, 1), plan.launch.threads, plan.launch.smem_bytes, args,
                 self.name)
