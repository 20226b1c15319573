"""The backward pass on the GPU (issue 14): dQ, dK, dV of attention from the forward's O and LSE.

    o, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = tiledsl.backward.attention_backward(q, k, v, o, lse, do, causal=True)

`backward_spec` picks the schedule from BACKWARD_TUNED (H200 measurements) or the default
BackwardSchedule; `compile_backward(spec)` builds the module of templates/backward.cu.j2 (preprocess,
kv-outer main kernel, convert or the deterministic q-outer dQ kernel). With BACKWARD_WGMMA on, head dims
64 and 128 on Hopper take the wgmma main kernel instead (templates/backward_wgmma.cu.j2,
BACKWARD_WGMMA_TUNED; chosen_backward_spec decides); `attention_backward(..., mma=...)` forces either. Kernels are compiled once
per process and launched on the caller's stream (runtime.caller_stream); workspaces come from
runtime.allocate (torch's caching allocator under torch).

GQA: a main-kernel block loops over the query heads of its kv head itself (dK, dV stay in
registers), so the group's sum has a fixed order and needs no fp32 workspace, atomics or convert
kernel; the price is fewer blocks (kv tiles x batch x kv heads) when kv heads are few.
"""
from __future__ import annotations

import functools

from .errors import RuntimeInputError, SpecError
from .layout import BACKWARD_PRE_ROWS, backward_layout
from .lower_backward import BackwardPlan, lower_backward
from .render import render
from .spec import BackwardSchedule, DqAccumulate, DType, KernelSpec, LoopOrder, Mask, Mma, Problem, Schedule
from .tensors import view

# (head dim) -> (tile q, tile kv, warps, stages), bf16 at 4k on H200, dq atomic (bench/results/2026-11-30-backward-1.json):
# d64 q128/kv128/w8 230 / 207 TFLOP/s none / causal (0.91x / 0.96x SDPA flash backward); d128 q64/kv128/w8
# 240 / 210 (0.88x / 0.87x). fp16 has the same shapes. Other head dims take the first fallback that fits.
BACKWARD_TUNED: dict[int, tuple[int, int, int, int]] = {64: (128, 128, 8, 2), 128: (64, 128, 8, 2)}
_FALLBACK_TILES = ((64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 8, 2), (16, 128, 8, 2), (16, 64, 4, 1))

# The wgmma main kernel (templates/backward_wgmma.cu.j2): attention_backward uses it when this is on,
# the GPU is a Hopper (sm_90a) and BACKWARD_WGMMA_TUNED has the head dim (same qk and v head dims, atomic dQ);
# everything else keeps the mma.sync kernel. On: validated on the H200 (tests/test_gpu_backward_wgmma.py) and
# 1.3-1.5x the mma.sync kernel at 1k-16k (bench/results/2026-12-01-backward-ab-2.json).
BACKWARD_WGMMA = True
# (head dim) -> (tile q, tile kv, warps, stages) of the wgmma kernel: 2 warpgroups x 64 keys.
# d64 tile q 128 (dQ split by rows), d128 tile q 64 (split by columns): bench/results/2026-12-01-backward-ab-1.json
# (d64 q64 splits dQ by keys, twice the atomics: no faster than mma.sync there).
BACKWARD_WGMMA_TUNED: dict[int, tuple[int, int, int, int]] = {64: (128, 128, 8, 2), 128: (64, 128, 8, 2)}
MAX_GRID_Y = 65535


@functools.lru_cache(maxsize=None)
def backward_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
                  window: tuple[int, int] | None = None, scale: float | None = None,
                  deterministic: bool = False, mma: Mma = Mma.SYNC) -> KernelSpec:
    """The backward spec for a problem: BACKWARD_TUNED's schedule for the head dim, else the first of
    the fallback tiles that fits (layout.backward_layout); `deterministic` sums dQ on chip
    (`dq accumulate separate`) instead of with atomics. `mma` wgmma: BACKWARD_WGMMA_TUNED's schedule
    (RuntimeInputError where the wgmma kernel has none). `arch` is for the table's future rows."""
    problem = Problem(head_dim, head_dim_v or head_dim, dtype, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=scale)
    dq = DqAccumulate.SEPARATE if deterministic else DqAccumulate.ATOMIC
    if mma is Mma.WGMMA:
        why = wgmma_refusal(arch, head_dim, head_dim_v, deterministic)
        if why:
            raise RuntimeInputError(f"attention_backward: the wgmma backward {why}")
        b = BackwardSchedule(LoopOrder.KV_OUTER, *BACKWARD_WGMMA_TUNED[head_dim], mma=Mma.WGMMA, dq=dq)
        spec = KernelSpec(f"backward_{arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, Schedule(), backward=b)
        backward_layout(spec)
        return spec
    tuned = BACKWARD_TUNED.get(head_dim) if head_dim_v in (None, head_dim) else None
    error = None
    for tile_q, tile_kv, warps, stages in ((tuned,) if tuned else ()) + _FALLBACK_TILES:
        b = BackwardSchedule(LoopOrder.KV_OUTER, tile_q, tile_kv, warps, stages, dq=dq)
        spec = KernelSpec(f"backward_{arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, Schedule(), backward=b)
        try:
            backward_layout(spec)
            return spec
        except SpecError as err:
            error = err
    raise RuntimeInputError(f"attention_backward: no backward schedule fits head dim {head_dim}/{head_dim_v}: {error}")


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
            from .runtime import _allow_dynamic_shared, _cupy, compile_cubin, device_arch
            cupy = _cupy()
            module = cupy.cuda.function.Module()
            module.load(compile_cubin(self.source, self.name, device_arch()))
            fns = {role: module.get_function(name) for role, name in self.plan.kernel_names.items()}
            _allow_dynamic_shared(fns["main"], self.plan.launch.smem_bytes)
            if "dq" in fns:
                _allow_dynamic_shared(fns["dq"], self.plan.dq_launch.smem_bytes)
            self._module, self._functions = module, fns
        return self._functions

    def check(self, q, k, v, o, lse, do, kv_lens):
        p, name = self.spec.problem, self.name
        views = {n: view(x, n) for n, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do))}
        for t in views.values():
            if len(t.shape) != 4:
                raise RuntimeInputError(f"{name}: {t.name} must be 4-d (batch, heads, seqlen, head_dim), got shape {t.shape}")
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
                                    f"(the forward's return_lse), got {getattr(lv.dtype, 'value', lv.dtype)} {lv.shape}")
        if lv.device_id != views["q"].device_id:
            raise RuntimeInputError(f"{name}: lse is on GPU {lv.device_id}, q on GPU {views['q'].device_id}")
        if batch * heads > MAX_GRID_Y:
            raise RuntimeInputError(f"{name}: batch*heads = {batch * heads} exceeds {MAX_GRID_Y} per launch")
        lens = None
        if kv_lens is not None:
            lens = view(kv_lens, "kv_lens")
            if lens.dtype != "int32" or lens.shape != (batch,) or lens.strides != (1,):
                raise RuntimeInputError(f"{name}: kv_lens must be a contiguous int32 array of shape ({batch},)")
            from .runtime import _capturing, _check_kv_lens
            if not _capturing(q):
                _check_kv_lens(kv_lens, kv_len, name)
        views["lse"] = lv
        return views, lens, (batch, heads, kv_heads, q_len, kv_len)

    def __call__(self, q, k, v, o, lse, do, kv_lens=None):
        import numpy as np
        from .runtime import allocate, caller_stream
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
        from .runtime import data_pointer
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
                   (ptr(vq), ptr(vk), ptr(vv), ptr(vdo), ptr(views["lse"]), d_ptr, acc_ptr, ptr(vdk), ptr(vdv), lens_ptr,
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


def wgmma_refusal(arch: str, head_dim: int, head_dim_v: int | None, deterministic: bool) -> str:
    """Why the wgmma backward can't take a problem ("" when it can)."""
    if not arch.startswith("sm_90"):
        return f"needs a Hopper GPU (sm_90a), this one is {arch}"
    if head_dim not in BACKWARD_WGMMA_TUNED or head_dim_v not in (None, head_dim):
        return (f"is built for head dims {sorted(BACKWARD_WGMMA_TUNED)} (qk = v), not {head_dim}/{head_dim_v or head_dim}; "
                "the mma.sync backward takes the others")
    if deterministic:
        return "sums dQ with fp32 atomics; deterministic=True takes the mma.sync backward"
    return ""


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
    from .errors import LaunchError
    from .runtime import _cupy

    def launch(fn, grid, threads, smem, args):
        try:
            with _cupy().cuda.Device(device_id):
                fn(grid, (threads, 1, 1), args, shared_mem=smem, stream=stream)
        except Exception as err:
            raise LaunchError(f"{name} (grid {grid}, {threads} threads, {smem} B shared): launch failed: {err}") from None
    return launch


def compile_backward(spec: KernelSpec) -> BackwardKernel:
    """The backward module of a spec with a `backward { }` block (SpecError when no template builds it)."""
    if spec.backward is None:
        raise SpecError(f"{spec.name} has no backward schedule", spec.span, spec.source_text, "add `backward { }` to its spec")
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


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, window: tuple[int, int] | None = None,
                       scale: float | None = None, kv_lens=None, deterministic: bool = False, mma: str | None = None):
    """(dq, dk, dv) of attention: q, o, do (batch, heads, q_len, d[v]); k, v (batch, kv_heads, kv_len,
    d[v]); lse fp32 (batch, heads, q_len), natural log, as tiledsl.attention(..., return_lse=True)
    returns it. Masks and kv_lens as the forward's. `deterministic`: bit-identical results run to
    run (dQ summed on chip by a second kernel instead of fp32 atomics). Outputs in q's framework and
    dtype, shaped like q, k, v; launched on the caller's stream. `mma`: "wgmma" or "mma.sync" forces the
    main kernel's instruction (wgmma refuses problems it has no kernel for); None: wgmma when
    BACKWARD_WGMMA is on and it takes the problem, else mma.sync."""
    from .runtime import device_arch
    if causal and window is not None:
        raise ValueError("attention_backward: pass causal=True or window=(left, right), not both")
    qv, vv = view(q, "q"), view(v, "v")
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"attention_backward: q must be fp16 or bf16, got {getattr(qv.dtype, 'value', qv.dtype)}")
    if len(qv.shape) != 4 or len(vv.shape) != 4:
        raise RuntimeInputError(f"attention_backward: q and v must be 4-d (batch, heads, seqlen, head_dim), got "
                                f"shapes {qv.shape} and {vv.shape}")
    d, dv = qv.shape[-1], vv.shape[-1]
    if d % 16 or dv % 16:
        raise RuntimeInputError(f"attention_backward: head dims must be multiples of 16, got q {d}, v {dv}")
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)
    window = tuple(int(w) for w in window) if window is not None else None
    spec = chosen_backward_spec(device_arch(), qv.dtype, d, mask, dv, window, None if scale is None else float(scale),
                                bool(deterministic), mma)
    return kernel_for(spec)(q, k, v, o, lse, do, kv_lens)


def chosen_backward_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
                         window: tuple[int, int] | None = None, scale: float | None = None, deterministic: bool = False,
                         mma: str | None = None) -> KernelSpec:
    """The spec attention_backward runs: `mma` "wgmma" / "mma.sync" forced, or None: wgmma when
    BACKWARD_WGMMA is on and wgmma_refusal has no objection, else mma.sync."""
    if mma is None:
        chosen = Mma.WGMMA if BACKWARD_WGMMA and not wgmma_refusal(arch, head_dim, head_dim_v, deterministic) else Mma.SYNC
    else:
        table = {m.value: m for m in Mma}
        if mma not in table:
            raise ValueError(f"attention_backward: mma must be one of {sorted(table)} or None, got {mma!r}")
        chosen = table[mma]
    return backward_spec(arch, dtype, head_dim, mask, head_dim_v, window, scale, deterministic, chosen)
