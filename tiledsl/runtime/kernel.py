"""Kernel: a compiled attention kernel of the fa2 family (the base of every family's class): it loads the
cubin, checks the tensors it is handed, and launches on the caller's stream."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..device_limits import resident_blocks
from ..errors import LaunchError, RuntimeInputError
from ..hw import MAX_GRID_YZ
from ..spec import KernelSpec
from .block_order import order_groups
from .compile import cached_cubin
from .device import allow_dynamic_shared, caller_stream, capturing, cupy_module, device_arch, device_limits
from .inputs import Shapes, allocate_outputs, check_kv_lens
from .tensors import TensorView, view

if TYPE_CHECKING:
    from ..lower.plan import KernelPlan


class PlanRecord(SimpleNamespace):
    """A KernelPlan's fields read back from the warm cache (runtime/warm.py; nested dataclasses as
    PlanRecords): what the kernel classes read at launch (launch geometry, constants). A Kernel built
    on one is given its source and cubin by warm.load: there is no plan to render."""


class Kernel:
    """A compiled attention kernel: `o, lse = kernel(q, k, v)` with q (batch, heads, q_len, d) and
    k, v (batch, kv_heads, kv_len, d / dv); any strides whose last is 1. Build one with
    tiledsl.compile (families.py picks the family's subclass where its launch differs)."""

    def __init__(self, spec: KernelSpec, plan: KernelPlan):
        self.spec = spec
        self.plan = plan
        if not isinstance(plan, PlanRecord):
            from ..codegen.render import render
            self.source = render(self.plan)
        self.cubin_path: Path | None = None   # the cubin in the disk cache, once known
        self.name = self.plan.kernel_name
        self.order_groups: int | None = None   # FA2 launch order; None: block_order.order_groups decides
        self._slots: dict[int, int] = {}       # device -> resident blocks (slots())
        self._function = None

    def __repr__(self) -> str:
        return f"<tiledsl.Kernel {self.name}>"

    def function(self):
        if self._function is None:
            cupy = cupy_module()
            if self.cubin_path is None or not self.cubin_path.is_file():
                self.cubin_path = cached_cubin(self.source, self.name, device_arch())
            module = cupy.cuda.function.Module()
            module.load(self.cubin_path.read_bytes())
            fn = module.get_function(self.name)
            allow_dynamic_shared(fn, self.plan.launch.smem_bytes)
            self._module, self._function = module, fn
        return self._function

    # -- input checks ---------------------------------------------------------------------
    def check_inputs(self, q: TensorView, k: TensorView, v: TensorView, kv_lens: TensorView | None) -> Shapes:
        p = self.spec.problem
        for t in (q, k, v):
            if len(t.shape) != 4:
                raise RuntimeInputError(f"{self.name}: {t.name} must be 4-d (batch, heads, seqlen, head_dim), got "
                                        f"shape {t.shape}")
            if t.dtype is not p.dtype:
                raise RuntimeInputError(f"{self.name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel "
                                        f"was built for {p.dtype.value}")
            if t.strides[3] != 1:
                raise RuntimeInputError(f"{self.name}: {t.name} needs a unit stride on head_dim, got strides "
                                        f"{t.strides}")
            if any(s % 8 for s in t.strides[:3]) or t.pointer % 16:
                raise RuntimeInputError(f"{self.name}: {t.name} rows must be 16-byte aligned (strides {t.strides} "
                                        f"elements)")
            if t.device_id != q.device_id:
                raise RuntimeInputError(f"{self.name}: q is on GPU {q.device_id} but {t.name} on GPU {t.device_id}")
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
            if kv_lens.dtype != "int32" or kv_lens.shape != (batch,) or kv_lens.strides != (1,):
                raise RuntimeInputError(f"{self.name}: kv_lens must be a contiguous int32 array of shape ({batch},)")
        return Shapes(batch, heads, kv_heads, q_len, kv_len)

    def prepare(self, q, k, v, kv_lens=None, out=None, lse=None):
        """Check the inputs and allocate (or check) the outputs, once: returns the views
        (q, k, v, out, lse, kv_lens), the Shapes, and the out and lse objects to hand back."""
        qv, kvw, vv = view(q, "q"), view(k, "k"), view(v, "v")
        lens = view(kv_lens, "kv_lens") if kv_lens is not None else None
        shapes = self.check_inputs(qv, kvw, vv, lens)
        if lens is not None and not capturing(q):   # reading the lengths syncs the host: not under graph capture
            check_kv_lens(kv_lens, shapes.kv_len, self.name)
        out, lse = allocate_outputs(q, shapes, self.spec.problem, out, lse, self.name)
        ov, lv = view(out, "out"), view(lse, "lse")
        if ov.strides[3] != 1 or any(s % 8 for s in ov.strides[:3]):
            raise RuntimeInputError(f"{self.name}: out needs unit stride on head_dim and 16-byte aligned rows")
        return (qv, kvw, vv, ov, lv, lens), shapes, out, lse

    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None):
        views, shapes, out, lse = self.prepare(q, k, v, kv_lens, out, lse)
        self.launch(*views, shapes, caller_stream(q))
        return out, lse

    def attention_args(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
                       kv_lens: TensorView | None, shapes: Shapes) -> tuple:
        """The kernel parameters every prefill family starts with (fa2.cu.j2's signature)."""
        import numpy as np
        i64 = np.int64
        return (np.uintp(q.pointer), np.uintp(k.pointer), np.uintp(v.pointer), np.uintp(o.pointer),
                np.uintp(lse.pointer), np.uintp(kv_lens.pointer if kv_lens else 0),
                np.int32(shapes.q_len), np.int32(shapes.kv_len), np.int32(shapes.heads),
                np.int32(shapes.heads // shapes.kv_heads),
                *(i64(s) for s in q.strides[:3]), *(i64(s) for s in k.strides[:3]),
                *(i64(s) for s in v.strides[:3]), *(i64(s) for s in o.strides[:3]))

    def launch_function(self, fn, grid, args, device_id: int, stream=None) -> None:
        """Launch with this plan's block and shared memory; failures name the kernel and launch."""
        plan = self.plan
        try:
            with cupy_module().cuda.Device(device_id):
                fn(grid, (plan.launch.threads, 1, 1), args, shared_mem=plan.launch.smem_bytes, stream=stream)
        except Exception as err:
            raise LaunchError(f"{self.name} (grid {grid}, {plan.launch.threads} threads, "
                              f"{plan.launch.smem_bytes} B shared): launch failed: {err}") from None

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
            registers = int(getattr(self.function(), "num_regs", 0) or limits.max_registers_per_thread)
            per_sm, _ = resident_blocks(limits, registers, launch.threads, launch.smem_bytes)
            self._slots[device_id] = limits.sm_count * max(per_sm, 1)
        return self._slots[device_id]

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        """FA2: a 1-D grid of q tiles x (batch, head) pairs in runtime/block_order.py's order."""
        import numpy as np
        tile_q = self.plan.launch.tile_q
        q_tiles, pairs = (shapes.q_len + tile_q - 1) // tile_q, shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes) + (
            np.int32(self.order_groups_for(shapes, q.device_id)),)
        self.launch_function(self.function(), (q_tiles * pairs, 1, 1), args, q.device_id, stream)
