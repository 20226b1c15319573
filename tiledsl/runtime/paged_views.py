"""Checks and views shared by the kernels that read a paged KV cache (runtime/paged_decode.py: decode;
runtime/paged_prefill.py: fa2 chunked prefill). Both hand the kernel the same token-major tensors
with the same re-ordered strides:

  q (batch, queries, heads, d)          -> viewed (batch, head, query) strides
  k_cache, v_cache (pages, page size, kv heads, d / dv)  -> viewed (page, kv head, slot) strides
  O (batch, queries, heads, dv) in q's dtype, LSE (batch, heads, queries) fp32

The block table and kv_lens are read by the kernel alone: the key count a launch is sized for is the
table's capacity (max pages x page size); runtime/index_checks.py says where the indices are checked.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import RuntimeInputError
from .arguments import mask_arguments
from .index_checks import add_paged_check
from .inputs import Shapes, check_int32_vector, check_operand
from .launch import CallBuilder
from ..spec import KV_PAGE_SIZES, DType, Problem
from .tensors import TensorView, view

TOKEN_MAJOR = "(batch, queries, heads, d)"
CACHE = "(pages, page size, kv heads, d)"


def kernel_order(t: TensorView, shape=None) -> TensorView:
    """`t` with its middle two axes swapped: (batch | page, head, query | slot)."""
    return replace(t, shape=shape or t.shape, strides=(t.strides[0], t.strides[2], t.strides[1], t.strides[3]))


def paged_views(b: CallBuilder, p: Problem, validate: bool | None = None, bounded: bool = False):
    """((q, k, v, block table, kv_lens) views in the kernel's stride order, Shapes) of the call at
    positions 0..4 of `b`, after checking every tensor against the kernel built for `p`; errors
    name the kernel and the tensor. `bounded`: the kernel bounds the table and kv_lens itself."""
    name = b.name
    qv, kv, vv, tv, lv = (b.view(i) for i in range(5))
    check_operand(qv, name, p.dtype, 4, qv.device_id, TOKEN_MAJOR)
    for t in (kv, vv):
        check_operand(t, name, DType.E4M3 if p.kv_fp8 else p.dtype, 4, qv.device_id, CACHE)
    b.require_aligned(qv, kv, vv)
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
    if tv is None or lv is None:
        raise RuntimeInputError(f"{name}: a paged call needs block_table and kv_lens")
    if tv.dtype != "int32" or len(tv.shape) != 2 or tv.shape[0] != batch or tv.strides[1] != 1:
        raise RuntimeInputError(f"{name}: block_table must be int32 (batch = {batch}, max pages) with unit "
                                f"stride along the pages, got {tv.dtype} {tv.shape} strides {tv.strides}")
    if tv.device_id != qv.device_id:
        raise RuntimeInputError(f"{name}: block_table and kv_lens must be on q's GPU {qv.device_id}")
    check_int32_vector(lv, name, batch, qv.device_id)
    add_paged_check(b, 3, 4, num_pages, page_size, validate, bounded)
    shapes = Shapes(batch, heads, kv_heads, q_len, tv.shape[1] * page_size)
    views = (kernel_order(qv, (batch, heads, q_len, dq)), kernel_order(kv), kernel_order(vv), tv, lv)
    return views, shapes


def paged_outputs(b: CallBuilder, p: Problem, shapes: Shapes, out_index: int):
    """(O's view in the kernel's stride order, LSE's view): O (batch, queries, heads, dv) in q's dtype
    and LSE (batch, heads, queries) fp32 at call positions `out_index`, `out_index + 1`, allocated
    or checked."""
    ov = b.output(out_index, (shapes.batch, shapes.q_len, shapes.heads, p.head_dim_v), p.dtype)
    lv = b.output(out_index + 1, (shapes.batch, shapes.heads, shapes.q_len), DType.FP32, contiguous=True)
    return kernel_order(ov, (shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v)), lv


def api_views(api: str, q, k_cache, v_cache, causal: bool, window):
    """The Python API's first checks of a paged call (`api` names the function in messages):
    (q, k_cache, v_cache views, the Mask, the window as ints or None)."""
    mask, window, _ = mask_arguments(api, causal, window, None)
    qv, kv, vv = view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache")
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"{api}: q must be fp16 or bf16, got {getattr(qv.dtype, 'value', qv.dtype)}")
    if len(qv.shape) != 4 or len(kv.shape) != 4 or len(vv.shape) != 4:
        raise RuntimeInputError(f"{api}: q must be (batch, queries, heads, d) and the caches (pages, page "
                                f"size, kv heads, d); got shapes {qv.shape}, {kv.shape}, {vv.shape}")
    if kv.shape[1] not in KV_PAGE_SIZES:
        raise RuntimeInputError(f"{api}: the page size (k_cache.shape[1]) must be a power of two in 1..256, "
                                f"got {kv.shape[1]}")
    return qv, kv, vv, mask, window
