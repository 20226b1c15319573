"""Checks and views shared by the kernels that read a paged KV cache (runtime/paged_decode.py: decode;
runtime/paged_prefill.py: fa2 chunked prefill). Both hand the kernel the same token-major tensors
with the same re-ordered strides:

  q (batch, queries, heads, d)          -> viewed (batch, head, query) strides
  k_cache, v_cache (pages, page size, kv heads, d / dv)  -> viewed (page, kv head, slot) strides
  O (batch, queries, heads, dv) in q's dtype, LSE (batch, heads, queries) fp32

The block table and kv_lens are checked on the host (serving_checks.check_paged) before every
launch, except under CUDA graph capture (no host reads), where kv_len is the table's capacity.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import RuntimeInputError
from .inputs import Shapes
from .device import capturing
from .serving_checks import check_paged
from ..spec import KV_PAGE_SIZES, DType, Mask, Problem
from .tensors import TensorView, view


def _kernel_order(t: TensorView, shape=None) -> TensorView:
    """`t` with its middle two axes swapped: (batch | page, head, query | slot)."""
    return replace(t, shape=shape or t.shape, strides=(t.strides[0], t.strides[2], t.strides[1], 1))


def paged_views(name: str, p: Problem, q, k_cache, v_cache, block_table, kv_lens):
    """((q, k, v, block table, kv_lens) views in the kernel's stride order, Shapes), after checking
    every tensor against the kernel built for `p`; errors name the kernel and the tensor."""
    qv, kv, vv = view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache")
    for t in (qv, kv, vv):
        if len(t.shape) != 4:
            raise RuntimeInputError(f"{name}: {t.name} must be 4-d, got shape {t.shape} (q: (batch, queries, "
                                    "heads, d); caches: (pages, page size, kv heads, d))")
        if t.device_id != qv.device_id:
            raise RuntimeInputError(f"{name}: q is on GPU {qv.device_id} but {t.name} on GPU {t.device_id}")
        if p.kv_fp8 and t is not qv:   # e4m3 bytes: 16-byte rows are strides of 16 elements
            from .kv_fp8 import check_fp8_kv
            check_fp8_kv(t, name)
            continue
        if t.dtype is not p.dtype:
            raise RuntimeInputError(f"{name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel "
                                    f"was built for {p.dtype.value}")
        if t.strides[3] != 1 or any(s % 8 for s in t.strides[:3]) or t.pointer % 16:
            raise RuntimeInputError(f"{name}: {t.name} needs a unit stride on head_dim and 16-byte aligned "
                                    f"rows (strides {t.strides} elements)")
    batch, q_len, heads, dq = qv.shape
    num_pages, page_size, kv_heads, dk = kv.shape
    if page_size != p.kv_page_size:
        raise RuntimeInputError(f"{name}: built for pages of {p.kv_page_size} keys; k_cache has "
                                f"{page_size} (shape {kv.shape})")
    if dq != p.head_dim_qk or dk != p.head_dim_qk or vv.shape[3] != p.head_dim_v:
        raise RuntimeInputError(f"{name}: built for head dims {p.head_dim_qk} / v {p.head_dim_v}; q has {dq}, "
                                f"k_cache {dk}, v_cache {vv.shape[3]}")
    if vv.shape[:3] != kv.shape[:3]:
        raise RuntimeInputError(f"{name}: k_cache {kv.shape} and v_cache {vv.shape} disagree")
    if kv_heads == 0 or heads % kv_heads:
        raise RuntimeInputError(f"{name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
    tv, lv = view(block_table, "block_table"), view(kv_lens, "kv_lens")
    if tv.dtype != "int32" or len(tv.shape) != 2 or tv.shape[0] != batch or tv.strides[1] != 1:
        raise RuntimeInputError(f"{name}: block_table must be int32 (batch = {batch}, max pages) with unit "
                                f"stride along the pages, got {tv.dtype} {tv.shape} strides {tv.strides}")
    if lv.dtype != "int32" or lv.shape != (batch,) or lv.strides != (1,):
        raise RuntimeInputError(f"{name}: kv_lens must be a contiguous int32 array of shape ({batch},)")
    if tv.device_id != qv.device_id or lv.device_id != qv.device_id:
        raise RuntimeInputError(f"{name}: block_table and kv_lens must be on q's GPU {qv.device_id}")
    if capturing(q):
        kv_len = tv.shape[1] * page_size   # no host reads under capture: the table's capacity
    else:
        _, lens = check_paged(block_table, kv_lens, num_pages, page_size)
        kv_len = int(lens.max()) if batch else 0
    shapes = Shapes(batch, heads, kv_heads, q_len, kv_len)
    views = (_kernel_order(qv, (batch, heads, q_len, dq)), _kernel_order(kv), _kernel_order(vv), tv, lv)
    return views, shapes


def paged_outputs(name: str, p: Problem, q, shapes: Shapes, out, lse):
    """(out, lse, O's view in the kernel's stride order, LSE's view): O (batch, queries, heads, dv) in
    q's dtype and LSE (batch, heads, queries) fp32, allocated in q's framework or checked."""
    o_shape = (shapes.batch, shapes.q_len, shapes.heads, p.head_dim_v)
    lse_shape = (shapes.batch, shapes.heads, shapes.q_len)
    if type(q).__module__.startswith("torch"):
        import torch
        out = out if out is not None else torch.empty(o_shape, dtype=q.dtype, device=q.device)
        lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    elif out is None or lse is None:
        from .device import cupy_module
        cupy = cupy_module()
        if p.dtype is DType.BF16 and out is None:
            raise RuntimeInputError(f"{name}: CuPy has no bfloat16 dtype; pass out= (e.g. a PyTorch tensor)")
        out = out if out is not None else cupy.empty(o_shape, dtype=cupy.float16)
        lse = lse if lse is not None else cupy.empty(lse_shape, dtype=cupy.float32)
    ov, lv = view(out, "out"), view(lse, "lse")
    if ov.shape != o_shape or ov.dtype is not p.dtype or ov.strides[3] != 1 or any(s % 8 for s in ov.strides[:3]):
        raise RuntimeInputError(f"{name}: out must be {o_shape} {p.dtype.value} with unit stride on head_dim "
                                f"and 16-byte aligned rows, got {ov.shape}")
    if lv.shape != lse_shape or lv.dtype is not DType.FP32 or lv.strides != (shapes.heads * shapes.q_len, shapes.q_len,
                                                                             1):
        raise RuntimeInputError(f"{name}: lse must be a contiguous fp32 array of shape {lse_shape}")
    return out, lse, _kernel_order(ov, (shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v)), lv


def api_views(api: str, q, k_cache, v_cache, causal: bool, window):
    """The Python API's first checks of a paged call (`api` names the function in messages):
    (q, k_cache, v_cache views, the Mask, the window as ints or None)."""
    if causal and window is not None:
        raise ValueError(f"{api}: pass causal=True or window=(left, right), not both "
                         "(a causal window is window=(left, 0))")
    qv, kv, vv = view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache")
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"{api}: q must be fp16 or bf16, got {getattr(qv.dtype, 'value', qv.dtype)}")
    if len(qv.shape) != 4 or len(kv.shape) != 4 or len(vv.shape) != 4:
        raise RuntimeInputError(f"{api}: q must be (batch, queries, heads, d) and the caches (pages, page "
                                f"size, kv heads, d); got shapes {qv.shape}, {kv.shape}, {vv.shape}")
    if kv.shape[1] not in KV_PAGE_SIZES:
        raise RuntimeInputError(f"{api}: the page size (k_cache.shape[1]) must be a power of two in 1..256, "
                                f"got {kv.shape[1]}")
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)
    return qv, kv, vv, mask, tuple(int(w) for w in window) if window is not None else None
