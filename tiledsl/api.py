"""`tiledsl.attention`: the entry point. Torch tensors go to the custom op of tiledsl/dispatch/autograd.py
(differentiable, traceable by torch.compile), anything else to tuned.forward. Its own module, so
that autograd (whose op runs tuned.forward) and tuned do not import each other.

    o = tiledsl.attention(q, k, v, causal=True)        # q (batch, heads, seqlen, d), k/v alike
    o, lse = tiledsl.attention(q, k, v, kv_lens=lens, return_lse=True)
"""
from __future__ import annotations


def attention(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
              kv_lens=None, return_lse: bool = False, deterministic: bool = False, k_scale=None, v_scale=None,
              validate: bool | None = None):
    """Attention of q (batch, heads, seqlen_q, d) over k, v (batch, kv_heads, seqlen_kv, d / dv)
    with the tuned spec for this GPU; returns O (q's dtype), or (O, LSE) with `return_lse` (LSE
    fp32 (batch, heads, seqlen_q), natural log). `window=(left, right)` is a sliding window (keys
    visible before / after the bottom-right aligned diagonal); it excludes causal. `kv_lens`
    (int32, one per batch entry, in [0, seqlen_kv]) limits each sequence's keys. fp16 or bf16;
    head dims that are multiples of 8 up to 256 (autoschedule.supported_head_dims). Runs on the
    caller's current stream (torch's for torch tensors, CuPy's otherwise); capturable in a CUDA
    graph once an eager call of the same shape has compiled the kernel.

    Torch tensors go through the custom op tiledsl::attention_forward (tiledsl/dispatch/autograd.py): the
    result is differentiable when an input requires grad (the LSE is returned as a constant), and
    torch.compile(fullgraph=True) sees one opaque op. `deterministic=True` makes the backward
    bit-identical run to run. CuPy inputs have no autograd.

    float8_e4m3fn k and v are an FP8 KV cache (decode only: seqlen_q <= 16), dequantized on chip with
    `k_scale` / `v_scale` (float32 (kv_heads,) tensors, or Python floats / 1-element tensors; None:
    1.0); that path is forward-only (no autograd).

    `validate=True` checks kv_lens on the host first (a sync; runtime/index_checks.py says when the
    default does). The first call of a configuration picks and loads the kernel and prepares its
    launch; a later call with the same shapes, strides, dtypes and devices reads the tensors'
    pointers and launches (runtime/launch.py)."""
    if causal and window is not None:
        raise ValueError("attention: pass causal=True or window=(left, right), not both "
                         "(a causal window is window=(left, 0))")
    if _entry is None:
        _load_entry_points()
    if type(q).__module__.startswith("torch") and k_scale is None and v_scale is None and \
            "float8" not in str(k.dtype):
        return _entry.autograd.torch_attention(q, k, v, causal, window, scale, kv_lens, return_lse, deterministic,
                                               validate)
    out, lse = _entry.tuned.forward(q, k, v, causal, window, scale, kv_lens, k_scale, v_scale, validate)
    return (out, lse) if return_lse else out


_entry = None   # the implementing modules, imported on the first call (importing them pulls in the runtime)


def _load_entry_points() -> None:
    global _entry
    from types import SimpleNamespace

    from .dispatch import autograd, tuned
    _entry = SimpleNamespace(autograd=autograd, tuned=tuned)
