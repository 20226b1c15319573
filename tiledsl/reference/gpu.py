"""GPU validation: the exact float64 attention of any inputs, computed with CuPy on the device,
and the error measures the tests and `tiledsl run` report.

The reference is reference.naive_attention, the textbook formula (softmax(scale Q K^T + mask) V,
masks aligned to the bottom-right corner as spec.Mask documents), run on the GPU through CuPy, so
it checks a kernel's tiling and not its own algorithm."""
from __future__ import annotations

import math

from .forward import naive_attention
from ..spec import DTYPES, DType, Problem
from ..runtime.tensors import TensorView, view


def _cupy():
    import cupy
    return cupy


def as_float64(t: TensorView):
    """A float64 CuPy copy of a 16- or 32-bit tensor (bf16 widened by its bit pattern)."""
    cupy = _cupy()
    itemsize, raw_dtype = DTYPES[t.dtype].bytes, DTYPES[t.dtype].storage
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
    memory = cupy.cuda.UnownedMemory(t.pointer, max(extent, 1) * itemsize, t.owner, t.device_id)
    raw = cupy.ndarray(t.shape, dtype=raw_dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                       strides=tuple(s * itemsize for s in t.strides))
    if t.dtype is DType.BF16:
        return (raw.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return raw.astype(cupy.float64)


def reference_attention(problem: Problem, q, k, v, kv_lens=None):
    """(O, LSE) in float64 on the GPU for q (B, H, Nq, d), k/v (B, Hkv, Nk, d/dv) of any framework:
    reference.naive_attention on float64 CuPy copies. Fully masked rows give O = 0, LSE = -inf."""
    cupy = _cupy()
    qd, kd, vd = (as_float64(view(x, n)) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if kv_lens is not None:
        kv_lens = kv_lens.cpu().numpy() if hasattr(kv_lens, "cpu") else cupy.asnumpy(cupy.asarray(kv_lens))
    return naive_attention(qd, kd, vd, problem.mask, problem.window_left, problem.window_right, problem.scale, kv_lens)


def relative_error(out, ref) -> float:
    """Normwise relative error ||out - ref|| / ||ref||; NaN anywhere gives inf."""
    cupy = _cupy()
    o = as_float64(view(out, "out")) if not isinstance(out, cupy.ndarray) or out.dtype != cupy.float64 else out
    if not bool(cupy.isfinite(o).all()):
        return math.inf
    denominator = float(cupy.linalg.norm(ref)) or 1.0
    return float(cupy.linalg.norm(o - ref)) / denominator


def lse_error(lse, ref_lse) -> float:
    """Max |lse - ref| over finite rows; a mismatch in which rows are -inf (or any NaN) gives inf."""
    cupy = _cupy()
    l = as_float64(view(lse, "lse"))
    if bool(cupy.isnan(l).any()):
        return math.inf
    finite = cupy.isfinite(ref_lse)
    if not bool((cupy.isfinite(l) == finite).all()):
        return math.inf
    if not bool(finite.any()):
        return 0.0
    return float(cupy.abs(l[finite] - ref_lse[finite]).max())


def run_errors(kernel, q, k, v, kv_lens=None) -> tuple[float, float]:
    """(O relative error, LSE max error) of one run of `kernel` into NaN-poisoned outputs (so an
    element it fails to write shows up), against the float64 reference."""
    batch, heads, q_len = view(q, "q").shape[:3]
    out, lse = poisoned_outputs(q, (batch, heads, q_len, kernel.spec.problem.head_dim_v), (batch, heads, q_len))
    kernel(q, k, v, kv_lens=kv_lens, out=out, lse=lse)
    _cupy().cuda.runtime.deviceSynchronize()   # the inputs may come from another framework's stream
    ref_o, ref_lse = reference_attention(kernel.spec.problem, q, k, v, kv_lens=kv_lens)
    return relative_error(out, ref_o), lse_error(lse, ref_lse)


def poisoned_outputs(q, shape_o: tuple, shape_lse: tuple):
    """Output buffers filled with NaN, so an element the kernel fails to write shows up."""
    if type(q).__module__.startswith("torch"):
        import torch
        return (torch.full(shape_o, float("nan"), dtype=q.dtype, device=q.device),
                torch.full(shape_lse, float("nan"), dtype=torch.float32, device=q.device))
    import cupy
    return cupy.full(shape_o, cupy.nan, dtype=q.dtype), cupy.full(shape_lse, cupy.nan, dtype=cupy.float32)
