"""The serving API: attention over a paged KV cache, as vLLM / FlashInfer hold it.

    o = tiledsl.paged_attention(q, k_cache, v_cache, block_table, kv_lens)

q (batch, queries, heads, d); k_cache / v_cache (pages, page size, kv heads, d / dv), the page
size a power of two 1..256; block_table int32 (batch, max pages per sequence); kv_lens int32
(batch,). Key t of sequence b lies in page block_table[b, t // page size] at slot t % page size.
Masks are aligned bottom-right per sequence: query i of q_len sees key j iff j <= kv_len - q_len + i
(causal), or j in [kv_len - q_len + i - left, ... + right] (window). Up to DECODE_MAX_QUERIES
queries per sequence run on the decode family's paged kernel; longer ones (chunked prefill) on
tiledsl.serving.prefill.paged_prefill. Launches go to the caller's stream (runtime/device.stream_reader).
"""
from __future__ import annotations

from ..dispatch.dropout import refuse_dropout
from ..dispatch.modified import keywords_key
from ..errors import RuntimeInputError
from ..mods.model import AUX_ALIBI, AUX_SINKS, NO_MODS
from ..runtime.arguments import mask_arguments, switch
from ..runtime.decode import number_or_none, tensor_or_none
from ..runtime.launch import SignatureCache
from ..runtime.tensors import signature, view
from ..spec import DECODE_MAX_QUERIES, DType, KernelSpec, Mask, Problem


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


# call key -> (PreparedCall, whether its call takes the FP8 scales, the aux tensors' names it takes after them):
# a warm call is this lookup and a launch.
_calls = SignatureCache()
PREFILL_MODS_MISSING = f"chunked prefill (q_len > {DECODE_MAX_QUERIES}) with modifications has no CUDA template yet"


def paged_attention(q, k_cache, v_cache, block_table, kv_lens, *, causal: bool = False,
                    window: tuple[int, int] | None = None, scale: float | None = None, return_lse: bool = False,
                    k_scale=None, v_scale=None, validate: bool | None = None, softcap=None, alibi_slopes=None,
                    sinks=None, score_mod=None, mask_mod=None, aux=None, dropout_p=0.0):
    """O (batch, queries, heads, dv) in q's dtype, or (O, LSE (batch, queries, heads) fp32, natural
    log) with `return_lse`. A query that sees no key gets O = 0, LSE = -inf. The kernel reads the
    block table and kv_lens itself; `validate=True` checks them on the host first (a sync;
    runtime/index_checks.py says when the default does). float8_e4m3fn caches (both) are an FP8 KV
    cache, dequantized on chip: value = byte * scale, with `k_scale` / `v_scale` float32 (kv_heads,)
    tensors, or Python floats / 1-element tensors (None: 1.0); decode only (up to DECODE_MAX_QUERIES
    queries). The first call of a signature picks the kernel and prepares the launch; later ones
    only launch. The key count a launch is sized for is the table's capacity: a table much wider than
    the longest sequence splits decode's keys too finely (plan/run, tiledsl/serving/plan.py, sizes
    them by the host lengths). softcap, alibi_slopes, sinks, score_mod, mask_mod and aux are attention's
    (b: the batch entry): softcap (a float), alibi_slopes ("geometric" or float32 (heads,) / (batch, heads)),
    sinks (float32 (heads,)) and the expressions run in the paged decode kernel (up to DECODE_MAX_QUERIES queries),
    the tensors read by pointer on every call. The expressions' q_idx is a query's position in its sequence
    (kv_len - queries + i: the queries are the sequence's last), kv_idx a key's (logical, not its page slot).
    Chunked prefill with modifications, expressions over an FP8 cache and dropout_p (but 0) are refused, saying
    so."""
    refuse_dropout("paged_attention", dropout_p)
    mask, window, scale = mask_arguments("paged_attention", causal, window, scale)   # before any spec is built
    causal, return_lse = mask is Mask.CAUSAL, switch("paged_attention", "return_lse", return_lse)
    ks, vs = tensor_or_none(k_scale), tensor_or_none(v_scale)
    key = (signature(q), signature(k_cache), signature(v_cache), signature(block_table), signature(kv_lens),
           signature(ks), signature(vs), number_or_none(k_scale), number_or_none(v_scale), causal, window, scale,
           validate)
    built_in = not (softcap is None and alibi_slopes is None and sinks is None)
    expressions = not (score_mod is None and mask_mod is None and aux is None)
    modified = built_in or expressions
    keywords = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks) if modified else {}
    given = {AUX_ALIBI: alibi_slopes, AUX_SINKS: sinks}
    if built_in:   # the built-in ones: their kinds, and their tensors' signatures, are part of the call's key
        key += keywords_key(softcap, alibi_slopes, sinks)
    if expressions:   # the trees and the aux tensors' signatures too (the tensors are read by pointer)
        from ..dispatch.modified import modifications
        keywords.update(score_mod=score_mod, mask_mod=mask_mod, aux=aux)
        mods, given = modifications("paged_attention", **keywords)
        key += (mods, tuple((name, signature(t)) for name, t in sorted((aux or {}).items())))
    hit = _calls.get(key)
    if hit is None:
        hit = _calls.put(key, _prepare_paged(q, k_cache, v_cache, block_table, kv_lens, causal, window, scale,
                                             k_scale, v_scale, validate, keywords))
    call, scaled, aux_names = hit
    if modified:   # the scales' slots, then the aux tensors (none for softcap alone): _prepare_paged's order
        out, lse = call(q, k_cache, v_cache, block_table, kv_lens, None, None, ks, vs, *[given[n] for n in aux_names])
    elif scaled:
        out, lse = call(q, k_cache, v_cache, block_table, kv_lens, None, None, ks, vs)
    else:
        out, lse = call(q, k_cache, v_cache, block_table, kv_lens, None, None)
    # (batch, q_len, heads) views; torch and CuPy both have swapaxes
    return (out, lse.swapaxes(1, 2)) if return_lse else out


def paged_kernel(api: str, qv, kv, vv, mask: Mask, window, scale, k_scale=None, v_scale=None, mods=NO_MODS):
    """(the kernel a paged call on views qv, kv, vv (runtime/paged_views.api_views) runs, whether it takes
    FP8 scales): decode for up to DECODE_MAX_QUERIES queries, chunked prefill (fa2) beyond; refusals
    name `api`. `mods`: score modifications (the decode kernel's: families.BUILT_MODS)."""
    from ..dispatch.kernels import kernel_for
    q_len = qv.shape[1]
    if mods.active and q_len > DECODE_MAX_QUERIES:
        raise RuntimeInputError(f"{api}: {PREFILL_MODS_MISSING} ({', '.join(mods.config())}; q has {q_len} queries; "
                                "tiledsl.reference.serving.paged_attention(..., mods=, aux=) runs them in float64)")
    fp8 = DType.E4M3 in (kv.dtype, vv.dtype)
    if fp8 and q_len > DECODE_MAX_QUERIES:
        raise RuntimeInputError(f"{api}: an FP8 (float8_e4m3fn) KV cache is served by the decode kernel, "
                                f"up to {DECODE_MAX_QUERIES} queries per sequence; q has {q_len} (prefill over FP8 "
                                "caches is not implemented: dequantize first)")
    if fp8 and (mods.score_mod is not None or mods.mask_mod is not None):
        raise RuntimeInputError(f"{api}: score_mod / mask_mod over an FP8 (float8_e4m3fn) KV cache have no CUDA "
                                "template yet (the decode kernel's FP8 paths spell softcap, ALiBi and sinks); "
                                "dequantize the cache or drop the expressions")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise RuntimeInputError(f"{api}: k_scale / v_scale are for float8_e4m3fn caches; these are "
                                f"{getattr(kv.dtype, 'value', kv.dtype)}")
    if q_len > DECODE_MAX_QUERIES:
        from .prefill import prefill_spec
        from ..runtime.device import device_arch
        spec = prefill_spec(device_arch(), qv.dtype, qv.shape[3], vv.shape[3], mask, kv.shape[1], window,
                            None if scale is None else float(scale))
        return kernel_for(spec), False
    if q_len == 0:
        raise RuntimeInputError(f"{api}: q has no queries (q.shape[1] == 0)")
    kv_dtype = kv_scale = None
    if fp8:
        from ..runtime.kv_fp8 import granularity
        kv_dtype, kv_scale = DType.E4M3, granularity(k_scale, v_scale, kv.shape[2])
    spec = paged_spec(qv.dtype, qv.shape[3], vv.shape[3], mask, kv.shape[1], q_len, window,
                      None if scale is None else float(scale), kv_dtype, kv_scale, mods)
    from ..families import missing_template
    why = missing_template(spec) if mods.active else ""
    if why:
        raise RuntimeInputError(f"{api}: {why} (tiledsl.reference.serving.paged_attention(..., mods=, aux=) runs "
                                "them in float64)")
    return kernel_for(spec), fp8


def _prepare_paged(q, k_cache, v_cache, block_table, kv_lens, causal, window, scale, k_scale, v_scale, validate,
                   keywords: dict):
    """(the prepared call, whether it takes FP8 scales, the aux tensors' names it takes after them in CALL order);
    `keywords`: the call's modifications (softcap, alibi_slopes, sinks, score_mod, mask_mod, aux), checked here once
    per key."""
    from ..runtime.paged_views import api_views
    qv, kv, vv, mask, window = api_views("paged_attention", q, k_cache, v_cache, causal, window)
    mods, aux = NO_MODS, {}
    if keywords:
        from ..dispatch.modified import check_launch, modifications
        mods, aux = modifications("paged_attention", **keywords)
        batch, q_len, heads = qv.shape[:3]
        check_launch(mods, aux, batch, heads, q_len, view(block_table, "block_table").shape[1] * kv.shape[1],
                     ragged=True, where="paged_attention", positions=True)
    kernel, fp8 = paged_kernel("paged_attention", qv, kv, vv, mask, window, scale, k_scale, v_scale, mods)
    head = (q, k_cache, v_cache, block_table, kv_lens, None, None)
    if mods.active:
        names = kernel.aux_names
        tensors = head + (tensor_or_none(k_scale), tensor_or_none(v_scale)) + tuple(aux[n] for n in names)
        return kernel.prepare_call(tensors, validate=validate, k_scale=k_scale, v_scale=v_scale), fp8, names
    if fp8:
        tensors = head + (tensor_or_none(k_scale), tensor_or_none(v_scale))
        return kernel.prepare_call(tensors, validate=validate, k_scale=k_scale, v_scale=v_scale), True, ()
    return kernel.prepare_call(head, validate=validate), False, ()
