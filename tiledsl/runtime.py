"""Runtime: compile a spec's CUDA for the GPU in hand, cache the cubin on disk, and launch it on
tensors from any framework after checking them.

Compilation goes through NVRTC (CuPy's bindings) for the device's own architecture (sm_90a on
Hopper); the cubin is cached under ~/.cache/tiledsl (TILEDSL_CACHE_DIR overrides) by a sha256 of
source, options, architecture and NVRTC version."""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from .block_order import order_groups
from .device_limits import DeviceLimits, current_limits, resident_blocks
from .errors import LaunchError, RuntimeInputError
from .spec import DType, KernelSpec
from .tensors import TensorView, view

if TYPE_CHECKING:
    from .lower import KernelPlan

NVRTC_OPTIONS = ("--std=c++17",)
MAX_GRID_Y = 65535


def cache_dir() -> Path:
    root = os.environ.get("TILEDSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tiledsl")
    return Path(root)


def _cupy():
    try:
        import cupy
    except ImportError:
        raise LaunchError("running kernels needs CuPy (pip install 'tiledsl[gpu]')") from None
    return cupy


def device_arch() -> str:
    """sm_XY of the current device, with the 'a' suffix on Hopper so wgmma/setmaxnreg are legal."""
    cupy = _cupy()
    major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """The cubin of `source` for `arch`, from the disk cache or NVRTC."""
    return cached_cubin(source, name, arch).read_bytes()


def cached_cubin(source: str, name: str, arch: str) -> Path:
    """The disk-cache file of `source`'s cubin for `arch`, compiled by NVRTC first if missing."""
    from cupy_backends.cuda.libs import nvrtc
    options = NVRTC_OPTIONS + (f"--gpu-architecture={arch}",)
    key = hashlib.sha256("\0".join([source, *options, arch, repr(nvrtc.getVersion())]).encode()).hexdigest()
    path = cache_dir() / "cubin" / f"{name}-{key[:16]}.cubin"
    if path.exists():
        return path
    program = nvrtc.createProgram(source, f"{name}.cu", (), ())
    try:
        nvrtc.compileProgram(program, list(options))
    except Exception as err:
        log = nvrtc.getProgramLog(program)
        raise LaunchError(f"{name}: NVRTC failed for {arch}:\n{log or err}") from None
    cubin = nvrtc.getCUBIN(program)
    nvrtc.destroyProgram(program)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    tmp.replace(path)   # atomic: a concurrent reader sees the old file or the whole new one
    return path


class PlanRecord(SimpleNamespace):
    """A KernelPlan's fields read back from the warm cache (warm.py; nested dataclasses as
    PlanRecords): what the kernel classes read at launch (launch geometry, constants). A Kernel built
    on one is given its source and cubin by warm.load: there is no plan to render."""


@dataclass
class Shapes:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int


class Kernel:
    """A compiled attention kernel: `o, lse = kernel(q, k, v)` with q (batch, heads, q_len, d) and
    k, v (batch, kv_heads, kv_len, d / dv); any strides whose last is 1. Build one with
    tiledsl.compile (families.py picks the family's subclass where its launch differs)."""

    def __init__(self, spec: KernelSpec, plan: KernelPlan):
        self.spec = spec
        self.plan = plan
        if not isinstance(plan, PlanRecord):
            from .render import render
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
            cupy = _cupy()
            if self.cubin_path is None or not self.cubin_path.is_file():
                self.cubin_path = cached_cubin(self.source, self.name, device_arch())
            module = cupy.cuda.function.Module()
            module.load(self.cubin_path.read_bytes())
            fn = module.get_function(self.name)
            _allow_dynamic_shared(fn, self.plan.launch.smem_bytes)
            self._module, self._function = module, fn
        return self._function

    # -- input checks ---------------------------------------------------------------------
    def check_inputs(self, q: TensorView, k: TensorView, v: TensorView, kv_lens: TensorView | None) -> Shapes:
        p = self.spec.problem
        for t in (q, k, v):
            if len(t.shape) != 4:
                raise RuntimeInputError(f"{self.name}: {t.name} must be 4-d (batch, heads, seqlen, head_dim), got shape {t.shape}")
            if t.dtype is not p.dtype:
                raise RuntimeInputError(f"{self.name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel was built for {p.dtype.value}")
            if t.strides[3] != 1:
                raise RuntimeInputError(f"{self.name}: {t.name} needs a unit stride on head_dim, got strides {t.strides}")
            if any(s % 8 for s in t.strides[:3]) or t.pointer % 16:
                raise RuntimeInputError(f"{self.name}: {t.name} rows must be 16-byte aligned (strides {t.strides} elements)")
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
        if batch * heads > MAX_GRID_Y:
            raise RuntimeInputError(f"{self.name}: batch*heads = {batch * heads} exceeds {MAX_GRID_Y} per launch")
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
        if lens is not None and not _capturing(q):   # reading the lengths syncs the host: not under graph capture
            _check_kv_lens(kv_lens, shapes.kv_len, self.name)
        out, lse = _allocate_outputs(q, shapes, self.spec.problem, out, lse, self.name)
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
            with _cupy().cuda.Device(device_id):
                fn(grid, (plan.launch.threads, 1, 1), args, shared_mem=plan.launch.smem_bytes, stream=stream)
        except Exception as err:
            raise LaunchError(f"{self.name} (grid {grid}, {plan.launch.threads} threads, "
                              f"{plan.launch.smem_bytes} B shared): launch failed: {err}") from None

    def order_groups_for(self, shapes: Shapes, device_id: int) -> int:
        """Launch-order groups of (batch, head) pairs (block_order.py); `self.order_groups` overrides."""
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
        """FA2: a 1-D grid of q tiles x (batch, head) pairs in block_order.py's order."""
        import numpy as np
        tile_q = self.plan.launch.tile_q
        q_tiles, pairs = (shapes.q_len + tile_q - 1) // tile_q, shapes.batch * shapes.heads
        if q_tiles == 0 or pairs == 0:
            return
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes) + (
            np.int32(self.order_groups_for(shapes, q.device_id)),)
        self.launch_function(self.function(), (q_tiles * pairs, 1, 1), args, q.device_id, stream)


# -- streams: every launch goes to the stream the caller's framework is on -------------------------
_external_streams: dict[tuple[int, int], object] = {}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def caller_stream(x):
    """The CuPy stream to launch on for inputs like `x`: PyTorch's current stream on x's device
    (wrapped once per handle as a cupy ExternalStream) for torch tensors, CuPy's current stream
    otherwise. Launching there orders the kernel after the caller's writes of q, k, v and lets
    `torch.cuda.graph` capture it."""
    cupy = _cupy()
    if not _is_torch(x):
        return cupy.cuda.get_current_stream()
    import torch
    handle, device_id = int(torch.cuda.current_stream(x.device).cuda_stream), x.device.index or 0
    key = (handle, device_id)
    stream = _external_streams.get(key)
    if stream is None:
        stream = _external_streams[key] = cupy.cuda.ExternalStream(handle, device_id)
    return stream


def _capturing(x) -> bool:
    """Whether the caller's stream is being captured into a CUDA graph (no host syncs then)."""
    if _is_torch(x):
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    return bool(_cupy().cuda.get_current_stream().is_capturing())


def allocate(like, shape: tuple[int, ...], dtype: str, stream, zero: bool = False):
    """A scratch array of `dtype` ("float32" or "int32") on `like`'s device, in `like`'s framework,
    ordered on `stream`: torch's caching allocator under torch (graph-capture safe, stream-aware),
    CuPy's pool, with the fill on `stream`, otherwise."""
    if _is_torch(like):
        import torch
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=getattr(torch, dtype), device=like.device)
    cupy = _cupy()
    with cupy.cuda.Device(getattr(getattr(like, "device", None), "id", 0)), (stream or contextlib.nullcontext()):
        return (cupy.zeros if zero else cupy.empty)(shape, dtype=dtype)


def data_pointer(array) -> int:
    """Device address of a torch tensor or CuPy array."""
    return int(array.data_ptr()) if _is_torch(array) else int(array.data.ptr)


_DEVICE_LIMITS: dict[int, DeviceLimits] = {}


def device_limits(device_id: int) -> DeviceLimits:
    """The limits of a live device (device_limits.read_device_limits), asked once per device."""
    if device_id not in _DEVICE_LIMITS:
        _DEVICE_LIMITS[device_id] = current_limits(device_id)
    return _DEVICE_LIMITS[device_id]


def _allow_dynamic_shared(fn, nbytes: int) -> None:
    """Raise the function's dynamic shared-memory limit (48 KB unless asked) to what it uses."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        from cupy.cuda import driver
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


def _check_kv_lens(kv_lens, kv_len: int, name: str) -> None:
    """Per-sequence lengths must lie in [0, kv_len]: checked on the host before launch, since an
    out-of-range length would read past the cache."""
    cupy = _cupy()
    lens = cupy.asarray(kv_lens) if not hasattr(kv_lens, "cpu") else kv_lens
    low, high = int(lens.min()), int(lens.max())
    if low < 0 or high > kv_len:
        raise RuntimeInputError(f"{name}: kv_lens must lie in [0, {kv_len}], got values in [{low}, {high}]")


def _allocate_outputs(q, shapes: Shapes, problem, out, lse, name: str):
    """O (batch, heads, q_len, dv) in q's dtype and LSE (batch, heads, q_len) fp32, in q's framework."""
    o_shape = (shapes.batch, shapes.heads, shapes.q_len, problem.head_dim_v)
    lse_shape = o_shape[:3]
    if type(q).__module__.startswith("torch"):
        import torch
        out = out if out is not None else torch.empty(o_shape, dtype=q.dtype, device=q.device)
        lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        cupy = _cupy()
        if problem.dtype is DType.BF16 and out is None:
            raise RuntimeInputError(f"{name}: CuPy has no bfloat16 dtype; pass out= (e.g. a PyTorch tensor)")
        out = out if out is not None else cupy.empty(o_shape, dtype=cupy.float16)
        lse = lse if lse is not None else cupy.empty(lse_shape, dtype=cupy.float32)
    ov, lv = view(out, "out"), view(lse, "lse")
    if ov.shape != o_shape or ov.dtype is not problem.dtype:
        raise RuntimeInputError(f"{name}: out must be {o_shape} {problem.dtype.value}, got {ov.shape}")
    if lv.shape != lse_shape or lv.dtype is not DType.FP32 or lv.strides != (shapes.heads * shapes.q_len, shapes.q_len, 1):
        raise RuntimeInputError(f"{name}: lse must be a contiguous fp32 array of shape {lse_shape}")
    return out, lse

