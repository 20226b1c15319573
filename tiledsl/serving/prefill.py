"""Chunked prefill over a paged KV cache: the fa2 (mma.sync) family reading K/V through the block
table. tiledsl.serving.paged.paged_attention routes calls with more than DECODE_MAX_QUERIES queries here.

    o = paged_prefill(q, k_cache, v_cache, block_table, kv_lens, causal=True)

q (batch, q_len, heads, d); k_cache / v_cache (pages, page size, kv heads, d / dv), the page size a
power of two 1..256; block_table int32 (batch, max pages); kv_lens int32 (batch,), each sequence's
length including the chunk. The chunk's queries are the last q_len positions of their sequence:
query i sees key j iff j <= kv_len - q_len + i (causal), or j in [kv_len - q_len + i - left,
... + right] (window). The schedule is the fa2 (mma.sync) one autoschedule.pick chooses for
(dtype, head dim, mask) with the cache's page size.
"""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..runtime.launch import SignatureCache
from ..runtime.tensors import signature
from ..spec import KV_PAGE_SIZES, DType, KernelSpec, Mask, Problem


def prefill_spec(arch: str, dtype: DType, head_dim: int, head_dim_v: int, mask: Mask, page_size: int,
                 window: tuple[int, int] | None = None, scale: float | None = None) -> KernelSpec:
    """The paged fa2 spec of a chunked-prefill call (pure: no GPU)."""
    from ..dispatch.autoschedule import pick
    if page_size not in KV_PAGE_SIZES:
        raise RuntimeInputError(f"paged_prefill: the page size (k_cache.shape[1]) must be a power of two in 1..256, "
                                f"got {page_size}")
    problem = Problem(head_dim, head_dim_v, dtype, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=scale, kv_page_size=page_size)
    return pick(arch, problem)


def paged_prefill(q, k_cache, v_cache, block_table, kv_lens, *, causal: bool = False,
                  window: tuple[int, int] | None = None, scale: float | None = None, return_lse: bool = False,
                  validate: bool | None = None):
    """O (batch, q_len, heads, dv) in q's dtype, or (O, LSE (batch, q_len, heads) fp32, natural log)
    with `return_lse`. A query that sees no key gets O = 0, LSE = -inf. The kernel reads the block
    table and kv_lens itself; `validate=True` checks them on the host first. Launches on the caller's
    stream (runtime/device.stream_reader); the first call of a signature prepares the launch."""
    from ..runtime.arguments import mask_arguments, switch
    mask, window, scale = mask_arguments("paged_prefill", causal, window, scale)   # before any spec is built
    causal, return_lse = mask is Mask.CAUSAL, switch("paged_prefill", "return_lse", return_lse)
    tensors = (q, k_cache, v_cache, block_table, kv_lens, None, None)
    key = (tuple(map(signature, tensors[:5])), causal, window, scale, validate)
    call = _calls.get(key)
    if call is None:
        from ..dispatch.kernels import kernel_for
        from ..runtime.device import device_arch
        from ..runtime.paged_views import api_views
        qv, kv, vv, mask, window = api_views("paged_prefill", q, k_cache, v_cache, causal, window)
        spec = prefill_spec(device_arch(), qv.dtype, qv.shape[3], vv.shape[3], mask, kv.shape[1], window, scale)
        call = _calls.put(key, kernel_for(spec).prepare_call(tensors, validate=validate))
    out, lse = call(*tensors)
    if not return_lse:
        return out
    return out, lse.swapaxes(1, 2)   # (batch, q_len, heads) views (torch and CuPy both have swapaxes)


_calls = SignatureCache()
