"""The serving API: attention over a paged KV cache, as vLLM / FlashInfer hold it.

    o = tiledsl.paged_attention(q, k_cache, v_cache, block_table, kv_lens)

q (batch, queries, heads, d); k_cache / v_cache (pages, page size, kv heads, d / dv), the page
size a power of two 1..256; block_table int32 (batch, max pages per sequence); kv_lens int32
(batch,). Key t of sequence b lies in page block_table[b, t // page size] at slot t % page size.
Masks are aligned bottom-right per sequence: query i of q_len sees key j iff j <= kv_len - q_len + i
(causal), or j in [kv_len - q_len + i - left, ... + right] (window). Up to DECODE_MAX_QUERIES
queries per sequence run on the decode family's paged kernel; longer ones (chunked prefill) on
tiledsl.serving.prefill.paged_prefill. Launches go to the caller's stream (runtime.caller_stream).
"""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..mods.model import NO_MODS
from ..spec import DType, KernelSpec, Mask, Problem


def paged_spec(dtype: DType, head_dim: int, head_dim_v: int, mask: Mask, page_size: int, q_len: int,
               window: tuple[int, int] | None = None, scale: float | None = None, kv_dtype: DType | None = None,
               kv_scale=None, mods=NO_MODS) -> KernelSpec:
    """The decode spec a paged call of `q_len` queries runs: the schedule autoschedule picks for
    the contiguous decode, reading K/V through the block table."""
    from ..dispatch.autoschedule import DECODE_HEAD_DIMS, pick_decode
    if head_dim not in DECODE_HEAD_DIMS or head_dim_v != head_dim:
        raise RuntimeInputError(f"paged_attention: head dim {head_dim}"
                                + (f" / v {head_dim_v}" if head_dim_v != head_dim
                                else "") + f" is not served by the paged decode kernel; head dims: "
                                f"{', '.join(map(str, DECODE_HEAD_DIMS))} (equal for k and v)")
    problem = Problem(head_dim, head_dim_v, dtype, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=scale, kv_page_size=page_size,
                      kv_dtype=kv_dtype, kv_scale=kv_scale, mods=mods)
    spec = pick_decode(problem, q_len)
    if spec is None:
        raise RuntimeInputError(f"paged_attention: no legal decode schedule for head dim {head_dim}, "
                                f"{dtype.value}, {q_len} queries")
    return spec


def paged_attention(q, k_cache, v_cache, block_table, kv_lens, *, causal: bool = False,
                    window: tuple[int, int] | None = None, scale: float | None = None, return_lse: bool = False,
                    k_scale=None, v_scale=None, softcap=None, alibi_slopes=None, sinks=None, score_mod=None,
                    mask_mod=None, aux=None):
    """O (batch, queries, heads, dv) in q's dtype, or (O, LSE (batch, queries, heads) fp32, natural
    log) with `return_lse`. A query that sees no key gets O = 0, LSE = -inf. The block table and
    kv_lens are checked on the host first (serving_checks.check_paged): bad ones are refused.
    float8_e4m3fn caches (both) are an FP8 KV cache, dequantized on chip: value = byte * scale, with
    `k_scale` / `v_scale` float32 (kv_heads,) tensors, or Python floats / 1-element tensors (None: 1.0);
    decode only (up to DECODE_MAX_QUERIES queries). softcap, alibi_slopes, sinks, score_mod, mask_mod and
    aux are attention's (b: the batch entry); no kernel spells them yet: the call checks them and says so."""
    from ..spec import DECODE_MAX_QUERIES
    from ..runtime.paged_views import api_views
    from ..dispatch.tuned import kernel_for
    qv, kv, vv, mask, window = api_views("paged_attention", q, k_cache, v_cache, causal, window)
    q_len = qv.shape[1]
    keywords = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                    aux=aux)
    if any(value is not None for value in keywords.values()):
        _refuse_modifications(qv, kv, vv, block_table, mask, window, scale, keywords)
    fp8 = DType.E4M3 in (kv.dtype, vv.dtype)
    if fp8 and q_len > DECODE_MAX_QUERIES:
        raise RuntimeInputError(f"paged_attention: an FP8 (float8_e4m3fn) KV cache is served by the decode kernel, "
                                f"up to {DECODE_MAX_QUERIES} queries per sequence; q has {q_len} (prefill over FP8 "
                                "caches is not implemented: dequantize first)")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise RuntimeInputError("paged_attention: k_scale / v_scale are for float8_e4m3fn caches; these are "
                                f"{getattr(kv.dtype, 'value', kv.dtype)}")
    if q_len > DECODE_MAX_QUERIES:
        from .prefill import paged_prefill
        return paged_prefill(q, k_cache, v_cache, block_table, kv_lens, causal=causal, window=window, scale=scale,
                             return_lse=return_lse)
    if q_len == 0:
        raise RuntimeInputError("paged_attention: q has no queries (q.shape[1] == 0)")
    page_size = kv.shape[1]
    kv_dtype = kv_scale = None
    if fp8:
        from ..runtime.kv_fp8 import granularity
        kv_dtype, kv_scale = DType.E4M3, granularity(k_scale, v_scale, kv.shape[2])
    spec = paged_spec(qv.dtype, qv.shape[3], vv.shape[3], mask, page_size, q_len, window,
                      None if scale is None else float(scale), kv_dtype, kv_scale)
    extra = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    out, lse = kernel_for(spec)(q, k_cache, v_cache, block_table, kv_lens, **extra)
    # (batch, q_len, heads) views; torch and CuPy both have swapaxes
    return (out, lse.swapaxes(1, 2)) if return_lse else out


def _refuse_modifications(qv, kv, vv, block_table, mask, window, scale, keywords) -> None:
    """Paged attention with score and mask modifications: checked (dispatch/modified.py), then refused:
    neither paged kernel spells them yet (a call that modifies nothing goes on)."""
    from ..dispatch.modified import check_launch, modifications
    from ..families import missing_template
    from ..runtime.tensors import view
    from ..spec import DECODE_MAX_QUERIES
    mods, tensors = modifications("paged_attention", **keywords)
    if not mods.active:
        return
    batch, q_len, heads = qv.shape[:3]
    check_launch(mods, tensors, batch, heads, q_len, view(block_table, "block_table").shape[1] * kv.shape[1],
                 ragged=True, where="paged_attention")
    why = "chunked prefill (q_len > 16) with modifications has no CUDA template yet"
    if q_len <= DECODE_MAX_QUERIES:
        spec = paged_spec(qv.dtype, qv.shape[3], vv.shape[3], mask, kv.shape[1], q_len, window,
                          None if scale is None else float(scale), mods=mods)
        why = missing_template(spec) or why
    raise RuntimeInputError(f"paged_attention: {why} (tiledsl.reference.serving.paged_attention(..., mods=, aux=) "
                            "runs them in float64)")
