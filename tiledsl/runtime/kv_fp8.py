"""FP8 (e4m3) KV cache for decode: the host side of `kv_dtype = e4m3`.

K and V are float8_e4m3fn tensors (PyTorch) read as bytes; the kernel dequantizes them on chip
and applies float32 scales: value = e4m3 byte * scale, one scale per kv head (KvScale.PER_HEAD,
shape (kv_heads,)) or one per tensor (a Python float or a 1-element tensor). The kernel takes
the scales as device float32 arrays; Python floats are copied to q's device here (pass tensors
under CUDA graph capture). Scales are not read on the host: a negative or NaN scale gives what
it gives (the reference does the same arithmetic).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import RuntimeInputError
from ..spec import DType, KvScale
from .tensors import TensorView, view


def _is_scalar(x) -> bool:
    return x is None or isinstance(x, (int, float))


def granularity(k_scale, v_scale, kv_heads: int) -> KvScale:
    """PER_HEAD when either scale is a tensor of kv_heads > 1 values, else PER_TENSOR."""
    for s in (k_scale, v_scale):
        if not _is_scalar(s) and kv_heads > 1 and tuple(getattr(s, "shape", ())) == (kv_heads,):
            return KvScale.PER_HEAD
    return KvScale.PER_TENSOR


def scale_arrays(k_scale, v_scale, kind: KvScale, kv_heads: int, q):
    """(k, v) scale arrays on q's device for a kernel of granularity `kind`: Python floats (None is
    1.0) become float32 arrays (kv_heads values for PER_HEAD); tensors pass as they are (checked
    by check_scale)."""
    n = kv_heads if kind is KvScale.PER_HEAD else 1

    def device_array(x):
        if not _is_scalar(x):
            return x
        value = 1.0 if x is None else float(x)
        if type(q).__module__.startswith("torch"):
            import torch
            return torch.full((n,), value, dtype=torch.float32, device=q.device)
        from .device import cupy_module
        cupy = cupy_module()
        with cupy.cuda.Device(view(q, "q").device_id):
            return cupy.full((n,), value, dtype=cupy.float32)
    return device_array(k_scale), device_array(v_scale)


def check_scale(s: TensorView, name: str, kind: KvScale, kv_heads: int, device_id: int, kernel: str) -> TensorView:
    """A float32 scale array of kv_heads values (PER_HEAD) or one (PER_TENSOR), contiguous, on the GPU."""
    want = (kv_heads,) if kind is KvScale.PER_HEAD else (1,)
    shape = s.shape if s.shape else (1,)
    if s.dtype is not DType.FP32 or shape != want or (s.strides and s.strides[0] != 1 and shape[0] > 1):
        what = f"(kv_heads = {kv_heads},)" if kind is KvScale.PER_HEAD else "a Python float or a 1-element tensor"
        raise RuntimeInputError(f"{kernel}: {name} must be float32 {what}, got {getattr(s.dtype, 'value', s.dtype)} "
                                f"of shape {s.shape}")
    if s.device_id != device_id:
        raise RuntimeInputError(f"{kernel}: {name} is on GPU {s.device_id}, q on GPU {device_id}")
    return s


def kernel_strides(t: TensorView) -> TensorView:
    """The kernel addresses e4m3 rows as pairs of bytes (u16): strides in units of 2 bytes."""
    return replace(t, strides=tuple(s // 2 for s in t.strides[:3]) + (1,))
