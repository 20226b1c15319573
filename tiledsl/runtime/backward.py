"""The backward module on the GPU: a spec's preprocess, main and convert (or dQ) kernels compiled once per
process and launched on the caller's stream, with workspaces from the caller's allocator."""
from __future__ import annotations

from ..codegen.render import render
from ..errors import RuntimeInputError, SpecError
from ..hw import MAX_GRID_YZ
from ..layout.backward import BACKWARD_PRE_ROWS
from ..lower.backward import BackwardPlan, lower_backward
from ..spec import DType, KernelSpec
from .tensors import view


class BackwardKernel:
    """The compiled backward module of a spec: `dq, dk, dv = kernel(q, k, v, o, lse, do, kv_lens)`."""

    def __init__(self, spec: KernelSpec, plan: BackwardPlan):
        self.spec, self.plan = spec, plan
        self.source = render(plan)
        self.name = plan.kernel_name
        self._functions = None

    def __repr__(self) -> str:
        return f"<tiledsl.BackwardKernel {self.name}>"

    def functions(self) -> dict:
        if self._functions is None:
            from .compile import compile_cubin
            from .device import allow_dynamic_shared, cupy_module, device_arch
            cupy = cupy_module()
            module = cupy.cuda.function.Module()
            module.load(compile_cubin(self.source, self.name, device_arch()))
            fns = {role: module.get_function(name) for role, name in self.plan.kernel_names.items()}
            allow_dynamic_shared(fns["main"], self.plan.launch.smem_bytes)
            if "dq" in fns:
                allow_dynamic_shared(fns["dq"], self.plan.dq_launch.smem_bytes)
            self._module, self._functions = module, fns
        return self._functions

    def check(self, q, k, v, o, lse, do, kv_lens):
        p, name = self.spec.problem, self.name
        views = {n: view(x, n) for n, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do))}
        for t in views.values():
            if len(t.shape) != 4:
                raise RuntimeInputError(f"{name}: {t.name} must be 4-d (batch, heads, seqlen, head_dim), got shape "
                                        f"{t.shape}")
            if t.dtype is not p.dtype:
                raise RuntimeInputError(f"{name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, expected "
                                        f"{p.dtype.value} (q's dtype)")
            if t.strides[3] != 1 or any(s % 8 for s in t.strides[:3]) or t.pointer % 16:
                raise RuntimeInputError(f"{name}: {t.name} needs a unit stride on head_dim and 16-byte aligned rows "
                                        f"(strides {t.strides} elements)")
            if t.device_id != views["q"].device_id:
                raise RuntimeInputError(f"{name}: q is on GPU {views['q'].device_id} but {t.name} on GPU {t.device_id}")
        batch, heads, q_len, d = views["q"].shape
        kb, kv_heads, kv_len, dk = views["k"].shape
        if d != p.head_dim_qk or dk != p.head_dim_qk or views["v"].shape[3] != p.head_dim_v:
            raise RuntimeInputError(f"{name}: built for head_dim {p.head_dim_qk}/{p.head_dim_v}; q has {d}, k {dk}, "
                                    f"v {views['v'].shape[3]}")
        if kb != batch or views["v"].shape[:3] != views["k"].shape[:3]:
            raise RuntimeInputError(f"{name}: shapes disagree: q {views['q'].shape}, k {views['k'].shape}, "
                                    f"v {views['v'].shape}")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        o_shape = (batch, heads, q_len, p.head_dim_v)
        for n in ("o", "do"):
            if views[n].shape != o_shape:
                raise RuntimeInputError(f"{name}: {n} must have shape {o_shape} (q's, with v's head dim), got "
                                        f"{views[n].shape}")
        lv = view(lse, "lse")
        if lv.dtype is not DType.FP32 or lv.shape != (batch, heads, q_len) or lv.strides != (heads * q_len, q_len, 1):
            raise RuntimeInputError(f"{name}: lse must be a contiguous fp32 tensor of shape {(batch, heads, q_len)} "
                                    f"(the forward's return_lse), got {getattr(lv.dtype, 'value', lv.dtype)} "
                                    f"{lv.shape}")
        if lv.device_id != views["q"].device_id:
            raise RuntimeInputError(f"{name}: lse is on GPU {lv.device_id}, q on GPU {views['q'].device_id}")
        if batch * heads > MAX_GRID_YZ:
            raise RuntimeInputError(f"{name}: batch*heads = {batch * heads} exceeds {MAX_GRID_YZ} per launch")
        lens = None
        if kv_lens is not None:
            lens = view(kv_lens, "kv_lens")
            if lens.dtype != "int32" or lens.shape != (batch,) or lens.strides != (1,):
                raise RuntimeInputError(f"{name}: kv_lens must be a contiguous int32 array of shape ({batch},)")
            from .device import capturing
            from .inputs import check_kv_lens
            if not capturing(q):
                check_kv_lens(kv_lens, kv_len, name)
        views["lse"] = lv
        return views, lens, (batch, heads, kv_heads, q_len, kv_len)

    def __call__(self, q, k, v, o, lse, do, kv_lens=None):
        import numpy as np

        from .device import allocate, caller_stream
        views, lens, (batch, heads, kv_heads, q_len, kv_len) = self.check(q, k, v, o, lse, do, kv_lens)
        p, plan = self.spec.problem, self.plan
        stream = caller_stream(q)
        dq, dk, dv = (_empty_like(x, q) for x in (q, k, v))
        if dq is None:
            raise RuntimeInputError(f"{self.name}: CuPy has no bfloat16 dtype; pass PyTorch tensors")
        fns = self.functions()
        device = views["q"].device_id
        atomic = plan.dq_mode == "atomic"
        d_rows = allocate(q, (batch, heads, q_len), "float32", stream)
        dq_accum = allocate(q, (batch, heads, q_len, p.head_dim_qk), "float32", stream) if atomic else None
        vq, vk, vv, vo, vdo = (views[n] for n in ("q", "k", "v", "o", "do"))
        vdq, vdk, vdv = view(dq, "dq"), view(dk, "dk"), view(dv, "dv")
        ptr = lambda t: np.uintp(t.pointer)   # noqa: E731
        strides = lambda t: tuple(np.int64(s) for s in t.strides[:3])   # noqa: E731
        from .device import data_pointer
        d_ptr = np.uintp(data_pointer(d_rows)) if q_len else np.uintp(0)
        acc_ptr = np.uintp(data_pointer(dq_accum)) if atomic and q_len else np.uintp(0)
        lens_ptr = np.uintp(lens.pointer if lens is not None else 0)
        i32 = np.int32
        pairs = batch * heads
        q_blocks = -(-q_len // BACKWARD_PRE_ROWS)
        launch = _launcher(self.name, device, stream)
        if q_blocks and pairs:
            launch(fns["preprocess"], (q_blocks, pairs, 1), plan.pre_threads, 0,
                   (ptr(vo), ptr(vdo), d_ptr, acc_ptr, i32(q_len), i32(heads), *strides(vo), *strides(vdo)))
        kv_blocks = -(-kv_len // plan.tile_kv)
        if kv_blocks and batch * kv_heads:
            launch(fns["main"], (kv_blocks, batch * kv_heads, 1), plan.launch.threads, plan.launch.smem_bytes,
                   (ptr(vq), ptr(vk), ptr(vv), ptr(vdo), ptr(views["lse"]), d_ptr, acc_ptr, ptr(vdk), ptr(vdv),
                    lens_ptr,
                    i32(q_len), i32(kv_len), i32(heads), i32(heads // kv_heads), *strides(vq), *strides(vk),
                    *strides(vv), *strides(vdo), *strides(vdk), *strides(vdv)))
        if q_blocks and pairs:
            if atomic:
                launch(fns["convert"], (q_blocks, pairs, 1), plan.pre_threads, 0,
                       (acc_ptr, ptr(vdq), i32(q_len), i32(heads), *strides(vdq)))
            else:
                tiles = -(-q_len // plan.dq_launch.tile_q)
                launch(fns["dq"], (tiles, pairs, 1), plan.dq_launch.threads, plan.dq_launch.smem_bytes,
                       (ptr(vq), ptr(vk), ptr(vv), ptr(vdo), ptr(views["lse"]), d_ptr, ptr(vdq), lens_ptr,
                        i32(q_len), i32(kv_len), i32(heads), i32(heads // kv_heads), *strides(vq), *strides(vk),
                        *strides(vv), *strides(vdo), *strides(vdq)))
        return dq, dk, dv


def _empty_like(x, like):
    """An empty contiguous array shaped like x in `like`'s framework and dtype (None: CuPy bf16)."""
    shape = tuple(x.shape)
    if type(like).__module__.startswith("torch"):
        import torch
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    import cupy
    if view(like, "q").dtype is DType.BF16:
        return None
    with cupy.cuda.Device(like.device.id):
        return cupy.empty(shape, dtype=cupy.float16)


def _launcher(name: str, device_id: int, stream):
    from ..errors import LaunchError
    from .device import cupy_module

    def launch(fn, grid, threads, smem, args):
        try:
            with cupy_module().cuda.Device(device_id):
                fn(grid, (threads, 1, 1), args, shared_mem=smem, stream=stream)
        except Exception as err:
            raise LaunchError(f"{name} (grid {grid}, {threads} threads, {smem} B shared): launch failed: "
                              f"{err}") from None
    return launch


def compile_backward(spec: KernelSpec) -> BackwardKernel:
    """The backward module of a spec with a `backward { }` block (SpecError when no template builds it)."""
    if spec.backward is None:
        raise SpecError(f"{spec.name} has no backward schedule", spec.span, spec.source_text,
                        "add `backward { }` to its spec")
    return BackwardKernel(spec, lower_backward(spec))


_kernels: dict[KernelSpec, BackwardKernel] = {}


def kernel_for(spec: KernelSpec) -> BackwardKernel:
    """The compiled backward module of `spec`, built (and loaded) once per process."""
    kernel = _kernels.get(spec)
    if kernel is None:
        kernel = compile_backward(spec)
        kernel.functions()
        _kernels[spec] = kernel
    return kernel
