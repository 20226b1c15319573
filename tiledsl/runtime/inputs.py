"""What every kernel class checks and allocates around a launch: the shapes it reads off q, k, v, the
per-sequence kv_lens check, and the O and LSE outputs in the caller's framework."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import RuntimeInputError
from ..spec import DType
from .device import cupy_module
from .tensors import view

if TYPE_CHECKING:
    pass


@dataclass
class Shapes:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int


def check_kv_lens(kv_lens, kv_len: int, name: str) -> None:
    """Per-sequence lengths must lie in [0, kv_len]: checked on the host before launch, since an
    out-of-range length would read past the cache."""
    cupy = cupy_module()
    lens = cupy.asarray(kv_lens) if not hasattr(kv_lens, "cpu") else kv_lens
    low, high = int(lens.min()), int(lens.max())
    if low < 0 or high > kv_len:
        raise RuntimeInputError(f"{name}: kv_lens must lie in [0, {kv_len}], got values in [{low}, {high}]")


def allocate_outputs(q, shapes: Shapes, problem, out, lse, name: str):
    """O (batch, heads, q_len, dv) in q's dtype and LSE (batch, heads, q_len) fp32, in q's framework."""
    o_shape = (shapes.batch, shapes.heads, shapes.q_len, problem.head_dim_v)
    lse_shape = o_shape[:3]
    if type(q).__module__.startswith("torch"):
        import torch
        out = out if out is not None else torch.empty(o_shape, dtype=q.dtype, device=q.device)
        lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        cupy = cupy_module()
        if problem.dtype is DType.BF16 and out is None:
            raise RuntimeInputError(f"{name}: CuPy has no bfloat16 dtype; pass out= (e.g. a PyTorch tensor)")
        out = out if out is not None else cupy.empty(o_shape, dtype=cupy.float16)
        lse = lse if lse is not None else cupy.empty(lse_shape, dtype=cupy.float32)
    ov, lv = view(out, "out"), view(lse, "lse")
    if ov.shape != o_shape or ov.dtype is not problem.dtype:
        raise RuntimeInputError(f"{name}: out must be {o_shape} {problem.dtype.value}, got {ov.shape}")
    if lv.shape != lse_shape or lv.dtype is not DType.FP32 or lv.strides != (shapes.heads * shapes.q_len, shapes.q_len,
                                                                             1):
        raise RuntimeInputError(f"{name}: lse must be a contiguous fp32 array of shape {lse_shape}")
    return out, lse
