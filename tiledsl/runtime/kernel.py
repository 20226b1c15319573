"""Kernel: a compiled attention kernel of the fa2 family (the base of every family's class): it loads the
cubin, checks the tensors it is handed, and launches on the caller's stream.

A call is prepared once per signature of its tensors (runtime/launch.py): the checks, the grid and
the packed parameters of the first call are kept, and a later call with the same shapes, strides,
dtypes and devices only reads the new pointers and launches. Each family class says what its call
is (`build_call`: views, checks, outputs) and what it launches (`add_launches`)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..device_limits import resident_blocks
from ..errors import RuntimeInputError
from ..hw import MAX_GRID_YZ
from ..lower.plan import bounds_indices
from ..spec import DType, KernelSpec
from .block_order import order_groups
from .compile import cached_cubin
from .device import current_device, device_arch, device_limits, load_functions
from .index_checks import add_kv_lens_check
from .inputs import Shapes, check_int32_vector, check_operand
from .availability import require_gpu
from .launch import Arg, CallBuilder, SignatureCache, address_arg, i32, i64, pointer_arg
from .tensors import TensorView, signature

if TYPE_CHECKING:
    from ..lower.plan import KernelPlan

BATCHED = "(batch, heads, seqlen, head_dim)"


def kernel_arguments(plan, values: dict) -> tuple:
    """The launch arguments of `plan`'s kernel: one per parameter of plan.parameters (the list that also
    spells the kernel's signature), taken by its name from `values` and made by its kind: a pointer from
    its TensorView (None: 0; launch.pointer_arg) or as the Arg it is (launch.address_arg), an int32 or
    int64 from its value, a tensor map as it is. A name missing or left over is a bug in the caller."""
    from ..lower.plan import parameter_kind
    make = {"pointer": lambda value: value if isinstance(value, Arg) else pointer_arg(value), "i32": i32, "i64": i64,
            "map": lambda value: value,
            "u64": lambda value: value if isinstance(value, Arg) else Arg("u64", int(value))}
    flat = [p for line in plan.parameters for p in line]
    missing, unknown = [p.name for p in flat if p.name not in values], sorted(set(values) - {p.name for p in flat})
    if missing or unknown:
        raise RuntimeError(f"{plan.kernel_name}: launch arguments missing {missing}, not parameters {unknown}")
    return tuple(make[parameter_kind(p.type)](values[p.name]) for p in flat)


class PlanRecord(SimpleNamespace):
    """A KernelPlan's fields read back from the warm cache (runtime/warm.py; nested dataclasses as
    PlanRecords): what the kernel classes read at launch (launch geometry, constants). A Kernel built
    on one is given its source and cubin by warm.load: there is no plan to render."""


class Kernel:
    """A compiled attention kernel: `o, lse = kernel(q, k, v)` with q (batch, heads, q_len, d) and
    k, v (batch, kv_heads, kv_len, d / dv); any strides whose last is 1. Build one with
    tiledsl.compile (families.py picks the family's subclass where its launch differs)."""

    CALL = ("q", "k", "v", "kv_lens", "out", "lse")   # the call's tensors, in the order calls pass them
    aux_names: tuple[str, ...] = ()   # the modifications' aux tensors after CALL's own (runtime/aux_args.py)

    def __init__(self, spec: KernelSpec, plan: KernelPlan):
        self.spec = spec
        self.plan = plan
        if not isinstance(plan, PlanRecord):
            from ..codegen.render import render
            self.source = render(self.plan)
        self.cubin_path: Path | None = None   # the cubin in the disk cache, once known
        self.name = self.plan.kernel_name
        # whether the kernel bounds its kv_lens and block table itself (the error word is a parameter)
        self.bounds_indices = bounds_indices(self.plan)
        self.order_groups: int | None = None   # FA2 launch order; None: block_order.order_groups decides
        self._slots: dict[int, int] = {}       # device -> resident blocks (slots())
        self._functions: dict[int, object] = {}
        self._calls = SignatureCache()

    def __repr__(self) -> str:
        return f"<tiledsl.Kernel {self.name}>"

    def function_names(self) -> dict[str, int]:
        """The module's functions this kernel launches -> their dynamic shared memory."""
        return {self.name: self.plan.launch.smem_bytes}

    def functions(self, device_id: int | None = None) -> dict:
        """The loaded functions of this kernel's module on `device_id` (None: the current device),
        compiled (or read from the disk cache) and loaded once per device."""
        device_id = current_device() if device_id is None else device_id
        fns = self._functions.get(device_id)
        if fns is None:
            if self.cubin_path is None or not self.cubin_path.is_file():
                self.cubin_path = cached_cubin(self.source, self.name, device_arch())
            fns = self._functions[device_id] = load_functions(self.cubin_path, self.function_names(), device_id)
        return fns

    def function(self, device_id: int | None = None):
        return self.functions(device_id)[self.name]

    # -- a call ------------------------------------------------------------------------------------
    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None, *, validate: bool | None = None):
        return self.run_call((q, k, v, kv_lens, out, lse), (validate,), validate=validate)

    def run_call(self, tensors: tuple, scalars: tuple, **options):
        """Run the call on `tensors` (CALL order) through its PreparedCall, prepared on the first call
        of their signature with these `scalars` (the hashable part of `options`)."""
        key = (tuple(map(signature, tensors)), scalars, self.launch_options())
        call = self._calls.get(key)
        if call is None:
            call = self._calls.put(key, self.prepare_call(tensors, **options))
        return call(*tensors)

    def launch_options(self) -> tuple:
        """The attributes a caller may set that change the launch (part of every prepared call's key)."""
        return (self.order_groups,)

    def prepare_call(self, tensors: tuple, immediate: bool = False, **options):
        """The PreparedCall of a call on `tensors` (in CALL order), or with `immediate` the filled
        CallBuilder of one launch (runtime/launch.py)."""
        require_gpu("running a kernel")   # before the builder allocates anything: one line on a GPU-less machine
        builder = CallBuilder(self.name, tensors, self.CALL, tensors[0], immediate)
        self.build_call(builder, **options)
        return builder if immediate else builder.build()

    def build_call(self, b: CallBuilder, validate: bool | None = None) -> None:
        self.add_launches(b, *self.checked_call(b, validate))

    def checked_call(self, b: CallBuilder, validate: bool | None) -> tuple:
        """(q, k, v, O, LSE, kv_lens, shapes) of a contiguous call: the inputs checked, kv_lens' check
        added, the outputs provided."""
        q, k, v, kv_lens = (b.view(i) for i in range(4))
        shapes = self.check_inputs(q, k, v, kv_lens)
        b.require_aligned(q, k, v)
        add_kv_lens_check(b, 3, shapes.kv_len, validate, self.bounds_indices)
        p = self.spec.problem
        o = b.output(4, (shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v), p.output_dtype)
        lse = b.output(5, (shapes.batch, shapes.heads, shapes.q_len), DType.FP32, contiguous=True)
        return q, k, v, o, lse, kv_lens, shapes

    def check_inputs(self, q: TensorView, k: TensorView, v: TensorView, kv_lens: TensorView | None) -> Shapes:
        p = self.spec.problem
        for t in (q, k, v):
            check_operand(t, self.name, p.dtype, 4, q.device_id, BATCHED)
        batch, heads, q_len, dq = q.shape
        kb, kv_heads, kv_len, dk = k.shape
        if dq != p.head_dim_qk or dk != p.head_dim_qk:
            raise RuntimeInputError(f"{self.name}: built for head_dim {p.head_dim_qk}; q has {dq}, k has {dk}")
        if v.shape[3] != p.head_dim_v:
            raise RuntimeInputError(f"{self.name}: built for head_dim_v {p.head_dim_v}; v has {v.shape[3]}")
        if kb != batch or v.shape[:3] != k.shape[:3]:
            raise RuntimeInputError(f"{self.name}: shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{self.name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        if batch * heads > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch*heads = {batch * heads} exceeds {MAX_GRID_YZ} per launch")
        if kv_lens is not None:
            check_int32_vector(kv_lens, self.name, batch, q.device_id)
        return Shapes(batch, heads, kv_heads, q_len, kv_len)

    # -- direct launches (benchmarks, the tuner) --------------------------------------------------------
    def prepare(self, q, k, v, kv_lens=None, out=None, lse=None):
        """Check the inputs and allocate (or check) the outputs once: (views (q, k, v, out, lse,
        kv_lens), Shapes, out, lse) for `launch`."""
        b = CallBuilder(self.name, (q, k, v, kv_lens, out, lse), self.CALL, q, immediate=True)
        qv, kv, vv, lens = (b.view(i) for i in range(4))
        shapes = self.check_inputs(qv, kv, vv, lens)
        p = self.spec.problem
        ov = b.output(4, (shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v), p.output_dtype)
        lv = b.output(5, (shapes.batch, shapes.heads, shapes.q_len), DType.FP32, contiguous=True)
        out, lse = b.results
        return (qv, kv, vv, ov, lv, lens), shapes, out, lse

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        """Launch once on checked views (prepare, check_inputs) on `stream` (None: q's framework's)."""
        b = CallBuilder(self.name, (), (), q.owner, immediate=True)
        self.add_launches(b, q, k, v, o, lse, kv_lens, shapes)
        b.run(stream)

    def bind(self, q, k, v, kv_lens=None, out=None, lse=None, **options):
        """(run, out, lse): the outputs allocated once and `run()` a prepared call into them, which
        only launches (benchmarks time it)."""
        tensors = (q, k, v, kv_lens, out, lse)
        if out is None or lse is None:
            out, lse = self.prepare_call(tensors, immediate=True, **options).results
        tensors = (q, k, v, kv_lens, out, lse)
        call = self.prepare_call(tensors, **options)
        return (lambda: call(*tensors)), out, lse

    # -- FA2's launch ------------------------------------------------------------------------------------
    def attention_args(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
                       kv_lens: TensorView | None, shapes: Shapes, like=None, **values) -> tuple:
        """The launch arguments of a one-block-per-query-tile kernel (fa2, fa1), in the order of its plan's
        parameter list: the tensors, lengths and strides every such kernel takes, the error word where
        the kernel bounds its indices (in the framework of `like`, the call's tensor), and `values` by
        parameter name for the rest (order_groups, a paged cache's block table, FA1's workspace)."""
        named = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "kv_lens": kv_lens, "q_len": shapes.q_len,
                 "kv_len": shapes.kv_len, "heads": shapes.heads, "kv_group": shapes.heads // shapes.kv_heads}
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
            named.update(zip((f"{name}_batch_stride", f"{name}_head_stride", f"{name}_row_stride"), t.strides[:3]))
        if self.bounds_indices:
            named["index_errors"] = self.error_word_arg(q.device_id, like)
        return kernel_arguments(self.plan, {**named, **values})

    @staticmethod
    def error_word_arg(device_id: int, like) -> Arg:
        """The error word of `device_id` (runtime/device_errors.py; allocated on the device's first
        call, then the same address on every call) as a launch argument."""
        from .device_errors import error_pointer
        return address_arg(error_pointer(device_id, like))

    def order_groups_for(self, shapes: Shapes, device_id: int) -> int:
        """Launch-order groups of (batch, head) pairs (runtime/block_order.py); `self.order_groups` overrides."""
        pairs = shapes.batch * shapes.heads
        if self.order_groups is not None:
            return max(1, min(int(self.order_groups), pairs))
        return order_groups(self.spec.problem.mask, pairs, -(-shapes.q_len // self.plan.launch.tile_q),
                            self.slots(device_id))

    def slots(self, device_id: int) -> int:
        """Blocks of this kernel resident at once on the device (SMs x blocks per SM, from the
        compiled kernel's registers), worked out once per device: every launch reads it."""
        if device_id not in self._slots:
            limits, launch = device_limits(device_id), self.plan.launch
            registers = int(getattr(self.function(device_id), "num_regs", 0) or limits.max_registers_per_thread)
            per_sm, _ = resident_blocks(limits, registers, launch.threads, launch.smem_bytes)
            self._slots[device_id] = limits.sm_count * max(per_sm, 1)
        return self._slots[device_id]

    def add_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                     lse: TensorView, kv_lens: TensorView | None, shapes: Shapes) -> None:
        """FA2: a 1-D grid of q tiles x (batch, head) pairs in runtime/block_order.py's order."""
        tile_q = self.plan.launch.tile_q
        q_tiles, pairs = (shapes.q_len + tile_q - 1) // tile_q, shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes, like=b.like,
                                   order_groups=self.order_groups_for(shapes, b.device_id))
        launch = self.plan.launch
        b.launch(self.function(b.device_id), (q_tiles * pairs, 1, 1), launch.threads, launch.smem_bytes, args,
                 self.name)
