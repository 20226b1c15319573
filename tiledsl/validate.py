"""GPU validation: the exact float64 attention of any inputs, computed with CuPy on the device,
and the error measures the tests and `tiledsl run` report.

It is the textbook formula (softmax(scale Q K^T + mask) V), with masks aligned to the bottom-right
corner exactly as spec.Mask documents, so it checks a kernel's tiling and not its own algorithm."""
from __future__ import annotations

import math

from .spec import DType, Mask, Problem
from .tensors import TensorView, view


def _cupy():
    import cupy
    return cupy


def as_float64(t: TensorView):
    """A float64 CuPy copy of a 16- or 32-bit tensor (bf16 widened by its bit pattern)."""
    cupy = _cupy()
    itemsize = 4 if t.dtype is DType.FP32 else 2
    raw_dtype = {DType.FP16: cupy.float16, DType.FP32: cupy.float32, DType.BF16: cupy.uint16}[t.dtype]
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
    memory = cupy.cuda.UnownedMemory(t.pointer, max(extent, 1) * itemsize, t.owner, t.device_id)
    raw = cupy.ndarray(t.shape, dtype=raw_dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                       strides=tuple(s * itemsize for s in t.strides))
    if t.dtype is DType.BF16:
        return (raw.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return raw.astype(cupy.float64)


def visible_keys(problem: Problem, q_len: int, kv_len: int, kv_len_b: int):
    """Boolean (q_len, kv_len) matrix: may query i attend to key j (sequence of kv_len_b keys)?"""
    cupy = _cupy()
    i = cupy.arange(q_len)[:, None]
    j = cupy.arange(kv_len)[None, :]
    diag = kv_len_b - q_len
    visible = j < kv_len_b
    if problem.mask is Mask.CAUSAL:
        visible = visible & (j <= i + diag)
    elif problem.mask is Mask.WINDOW:
        visible = visible & (j >= i + diag - problem.window_left) & (j <= i + diag + problem.window_right)
    return visible


def reference_attention(problem: Problem, q, k, v, kv_lens=None):
    """(O, LSE) in float64 for q (B, H, Nq, d), k/v (B, Hkv, Nk, d/dv); fully masked rows give
    O = 0 and LSE = -inf."""
    cupy = _cupy()
    qd, kd, vd = (as_float64(view(x, n)) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    batch, heads, q_len, _ = qd.shape
    kv_heads, kv_len = kd.shape[1], kd.shape[2]
    group = heads // kv_heads
    lens = cupy.asnumpy(cupy.asarray(kv_lens)) if kv_lens is not None and not hasattr(kv_lens, "cpu") \
        else (kv_lens.cpu().numpy() if kv_lens is not None else None)
    o = cupy.zeros((batch, heads, q_len, vd.shape[3]), dtype=cupy.float64)
    lse = cupy.full((batch, heads, q_len), -math.inf, dtype=cupy.float64)
    for b in range(batch):
        kv_len_b = int(lens[b]) if lens is not None else kv_len
        visible = visible_keys(problem, q_len, kv_len, kv_len_b)
        for h in range(heads):
            s = problem.scale * (qd[b, h] @ kd[b, h // group].T)
            s = cupy.where(visible, s, -math.inf)
            m = s.max(axis=1, keepdims=True)
            m_safe = cupy.where(cupy.isfinite(m), m, 0.0)
            p = cupy.exp(s - m_safe)
            total = p.sum(axis=1, keepdims=True)
            o[b, h] = cupy.where(total > 0, (p @ vd[b, h // group]) / cupy.where(total > 0, total, 1.0), 0.0)
            lse[b, h] = cupy.where(total[:, 0] > 0, (m_safe + cupy.log(cupy.where(total > 0, total, 1.0)))[:, 0], -math.inf)
    return o, lse


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
    from .bench import poisoned_outputs
    batch, heads, q_len = view(q, "q").shape[:3]
    out, lse = poisoned_outputs(q, (batch, heads, q_len, kernel.spec.problem.head_dim_v), (batch, heads, q_len))
    kernel(q, k, v, kv_lens=kv_lens, out=out, lse=lse)
    _cupy().cuda.runtime.deviceSynchronize()   # the inputs may come from another framework's stream
    ref_o, ref_lse = reference_attention(kernel.spec.problem, q, k, v, kv_lens=kv_lens)
    return relative_error(out, ref_o), lse_error(lse, ref_lse)
