"""Standard attention in PyTorch float64 for gradient tests (torch imported by the caller's use).

Masks as tiledsl defines them (tiledsl/schedule/masks.py): bottom-right aligned to each sequence's own key
count n = kv_lens[b] (or kv_len): with off = n - q_len, causal shows key j to query i iff
j <= i + off, a window iff i + off - left <= j <= i + off + right; keys j >= n are hidden. GQA by
repeat_interleave of K and V (so autograd sums dK, dV over a group's query heads). A row that
sees no key gets O = 0 and zero gradients, never NaN.

The error measure is relative to the max norm: max |g - ref| / max |ref|. Against a normwise
(Frobenius) measure it does not dilute a local bug: a kernel that drops one kv tile of 64 out of
16 spoils 1/16 of the elements, which a normwise error divides by about 4 and the max norm does not.
"""
from __future__ import annotations

import math

# Bounds of max_relative_error for gradients in the kernel's dtype vs float64. u is the unit
# roundoff (bf16 2^-8, fp16 2^-11). The kernel rounds P and dS to the input dtype before the MMAs
# that sum them (dV, dK, dQ), reads O rounded to it (D = rowsum(dO o O)) and rounds each gradient
# once at the end: about four roundings of relative size u on the terms of every sum, with fp32
# sums. 8u leaves a factor of two over that: 0.031 for bf16, 0.0039 for fp16. PyTorch's own
# attention computed in bf16 (fp16) is off by 0.006-0.009 (0.0005-0.0009) on the shape of
# tests/test_autograd_cpu.py, which checks that the float64 gradient rounded to the dtype stays
# under a quarter of the bound and that a dropped kv tile (0.4-0.9), a softmax scale 10% off
# (0.17-0.32), two kv heads' dK swapped and one key's dV 5% off each exceed it.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
GRAD_TOLERANCE = {name: 8 * u for name, u in UNIT_ROUNDOFF.items()}
OUT_TOLERANCE = {name: 4 * u for name, u in UNIT_ROUNDOFF.items()}


def grad_tolerance(dtype) -> float:
    return GRAD_TOLERANCE[str(dtype).replace("torch.", "")]


def visible_keys(q_len: int, kv_len: int, batch: int, causal=False, window=None, kv_lens=None, device="cpu"):
    """(batch, 1, q_len, kv_len) bool: which keys each query sees."""
    import torch
    i = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    j = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    n = (torch.full((batch,), kv_len, device=device) if kv_lens is None else kv_lens.to(device).long()).view(batch, 1, 1, 1)
    diagonal = i + (n - q_len)
    seen = j < n
    if causal:
        seen = seen & (j <= diagonal)
    if window is not None:
        left, right = window
        seen = seen & (j >= diagonal - left) & (j <= diagonal + right)
    return seen


def attention(q, k, v, causal=False, window=None, scale=None, kv_lens=None):
    """(O, LSE) of standard attention, in q's dtype and precision (call with float64 tensors)."""
    import torch
    batch, heads, q_len, d = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    seen = visible_keys(q_len, k.shape[2], batch, causal, window, kv_lens, q.device)
    any_seen = seen.any(dim=-1, keepdim=True)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~seen, float("-inf")).masked_fill(~any_seen, 0.0)   # a blind row: no -inf - -inf
    lse = torch.logsumexp(s, dim=-1).masked_fill(~any_seen[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1) * seen
    return p @ v, lse


def gradients(q, k, v, do, **mask):
    """(O, LSE, dQ, dK, dV) in float64 of standard attention at q, k, v (any dtype) with upstream do."""
    import torch
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        o, lse = attention(q64, k64, v64, **mask)
        dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), do.double())
    return o.detach(), lse.detach(), dq, dk, dv


def max_relative_error(x, ref) -> float:
    """max |x - ref| / max |ref| (ref's max 0: the absolute max); NaN or inf anywhere gives inf."""
    import torch
    x = x.double()
    if not bool(torch.isfinite(x).all()):
        return math.inf
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    error = float((x - ref).abs().max()) if ref.numel() else 0.0
    return error / scale if scale > 0 else error
