"""`varlen_attention`: attention over packed variable-length sequences, FlashAttention's
flash_attn_varlen_func convention, on the tuned hopper schedules.

    o = tiledsl.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)
    o, lse = tiledsl.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)

q (total_q, heads, d), k (total_k, kv_heads, d), v (total_k, kv_heads, dv); cu_seqlens_q/k int32
(batch + 1,) GPU arrays of sequence offsets. Returns O (total_q, heads, dv) in q's dtype, and with
`return_lse` LSE fp32 (heads, total_q), natural log. Masks are aligned bottom-right per sequence.
Given max_seqlen_q and max_seqlen_k (as flash-attn asks), a call reads nothing on the host: no sync,
capturable in a CUDA graph (runtime/varlen.py: the work list then covers every sequence's
ceil(max_seqlen_q / tile) tiles). Without them, or with `validate=True`, cu_seqlens is copied to the
host (a sync), checked, and the work list ordered longest first.

softcap, alibi_slopes, sinks, score_mod and mask_mod run in the same kernel (the hopper template's modifications):
b is the sequence's index (an aux tensor indexed by it has the sequence count first), q_idx and kv_idx positions
within the sequence, q_len and kv_len its lengths; a warm call of a signature reads the tensors' pointers and
launches. A document mask or prefix is refused (the packing is the documents already), and so is a call needing a
gradient (varlen has no backward).

FP8 (float8_e4m3fn q, k, v) runs the hopper family's e4m3 kernels with `layout = varlen`: q_descale, k_descale,
v_descale float32, one value each or (sequences, kv_heads) each (sequence b's row; Q's shared by its kv head's
query heads, FlashAttention-3's convention), O in out_dtype (bf16 or fp16).
"""
from __future__ import annotations

import dataclasses

from ..dispatch.dropout import refuse_dropout
from ..dispatch.modified import keywords_key
from ..mods.model import AUX_ALIBI, AUX_SINKS, NO_MODS
from ..runtime.arguments import length_bound, mask_arguments, switch
from ..runtime.launch import SignatureCache
from ..runtime.tensors import signature
from ..spec import DType, Family, Mask, SeqLayout


def varlen_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
                window: tuple[int, int] | None = None, scale: float | None = None, mods=NO_MODS):
    """The tuned table's hopper spec for (dtype, head dim, mask) with `layout = varlen`, or None when
    the table has no hopper entry for it (varlen runs on the hopper family only). `mods`: score and
    mask modifications (dispatch/modified.py)."""
    from ..dispatch.tuned import tuned_spec
    spec, found = tuned_spec(arch, dtype, head_dim, mask, head_dim_v, window, scale, None, mods)
    if not found or spec.family is not Family.HOPPER:
        return None
    return dataclasses.replace(spec, name=spec.name + "_varlen",
                               problem=dataclasses.replace(spec.problem, seq_layout=SeqLayout.VARLEN))


_kernels: dict = {}   # (q's and v's signature, mask, scale, FP8 options, modifications) -> the varlen kernel
# call key -> (PreparedCall, the aux tensors' names it takes after the outputs) of a call that reads nothing on the
# host (max_seqlen_q and max_seqlen_k given)
_calls = SignatureCache()


def fp8_varlen_spec(arch: str, head_dim: int, mask: Mask, window, scale, descale, out_dtype: DType):
    """The FP8 prefill spec (dispatch/tuned.fp8_spec: TUNED_FP8's schedule) with `layout = varlen`."""
    from ..dispatch.tuned import fp8_spec
    spec = fp8_spec(arch, head_dim, mask, window, scale, descale, out_dtype, where="varlen_attention")
    return dataclasses.replace(spec, name=spec.name + "_varlen",
                               problem=dataclasses.replace(spec.problem, seq_layout=SeqLayout.VARLEN))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, causal: bool = False, window: tuple[int, int] | None = None,
                     scale: float | None = None, return_lse: bool = False, validate: bool | None = None,
                     softcap=None, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None, aux=None,
                     q_descale=None, k_descale=None, v_descale=None, out_dtype=None, dropout_p=0.0):
    """Attention over packed sequences (module docstring). `window=(left, right)` is a sliding
    window around each sequence's bottom-right diagonal; it excludes causal. `max_seqlen_q/k`, when
    both given, bound the lengths and let the call run without host reads; `validate=True` (or
    leaving them out) checks cu_seqlens on the host instead. fp16 or bf16, head dims 64, 128 and 256
    (the tuned hopper schedules); runs on the caller's current stream (torch's for torch tensors).
    softcap (a float), alibi_slopes ("geometric" or float32 (heads,) / (sequences, heads)) and sinks (float32
    (heads,)) are attention's, b the sequence's index, and run in the varlen kernel (module docstring);
    score_mod, mask_mod and aux are attention's expressions over each sequence (module docstring), their aux
    tensors' shapes checked before launch (no sync).
    float8_e4m3fn q, k, v are FP8 attention (module docstring): `q_descale`, `k_descale`, `v_descale` (None: 1.0)
    and `out_dtype` (bf16 or fp16, default bf16); forward only, no modifications. dropout_p (but 0) is refused."""
    refuse_dropout("varlen_attention", dropout_p)
    mask, window, scale = mask_arguments("varlen_attention", causal, window, scale)   # before any spec is built
    causal, return_lse = mask is Mask.CAUSAL, switch("varlen_attention", "return_lse", return_lse)
    fp8 = "float8" in str(getattr(q, "dtype", ""))
    built_in = not (softcap is None and alibi_slopes is None and sinks is None)
    expressions = not (score_mod is None and mask_mod is None and aux is None)
    modified = built_in or expressions
    fp8_options = _fp8_options(fp8, modified, q_descale, k_descale, v_descale, out_dtype)
    descales = (q_descale, k_descale, v_descale) if fp8 else ()
    keywords = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks) if modified else {}
    tensors = {AUX_ALIBI: alibi_slopes, AUX_SINKS: sinks}
    if expressions:   # their trees and aux tensors' signatures key the call (the tensors are read by pointer)
        keywords.update(score_mod=score_mod, mask_mod=mask_mod, aux=aux)
        mods, tensors = _modifications(keywords)
        refuse_gradients("varlen_attention", q, k, v, *tensors.values())
    bounded = max_seqlen_q is not None and max_seqlen_k is not None and not validate
    if bounded:
        head = (q, k, v, cu_seqlens_q, cu_seqlens_k, None, None)
        key = (tuple(map(signature, head[:5] + descales)), causal, window, scale, max_seqlen_q, max_seqlen_k,
               fp8_options)
        if built_in:   # the built-in ones: their kinds, and their tensors' signatures, are part of the call's key
            key += keywords_key(softcap, alibi_slopes, sinks)
        if expressions:
            key += (mods, tuple((name, signature(t)) for name, t in sorted((aux or {}).items())))
        hit = _calls.get(key)
        if hit is None:
            hit = _calls.put(key, _prepare_bounded(head, descales, causal, window, scale, max_seqlen_q, max_seqlen_k,
                                                   fp8_options, keywords))
        call, aux_names = hit
        if aux_names:   # after the outputs, in the kernel's CALL order (_prepare_bounded's)
            out, lse = call(*head, *[tensors[n] for n in aux_names], *descales)
        else:
            out, lse = call(*head, *descales)
    else:
        mods, tensors = _modifications(keywords)
        kernel = _kernel_of(q, v, causal, window, scale, fp8_options, mods)
        _check_aux(mods, tensors, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
        out, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate=validate,
                          aux=tensors, **dict(zip(("q_descale", "k_descale", "v_descale"), descales)))
    return (out, lse) if return_lse else out


def _modifications(keywords: dict):
    """(the Modifications of softcap / alibi_slopes / sinks, their aux tensors by name); (NO_MODS, {}) without."""
    if not keywords:
        return NO_MODS, {}
    from ..dispatch.modified import modifications
    return modifications("varlen_attention", **keywords)


def refuse_gradients(where: str, *tensors) -> None:
    """varlen has no backward: a call with expressions whose inputs need a gradient is refused, not run without it
    (varlen_attention's and VarlenAttention.run's refusal, named by `where`)."""
    if any(getattr(t, "requires_grad", False) for t in tensors):
        from ..errors import RuntimeInputError
        raise RuntimeInputError(f"{where}: the varlen kernels have no backward, so score_mod / mask_mod give "
                                "no gradient there; call under torch.no_grad() or pass tensors that do not require "
                                "grad (tiledsl.attention differentiates the batched forward's built-in modifications)")


def _check_aux(mods, tensors: dict, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> None:
    """The aux tensors' shapes and kinds against the launch (dispatch/modified.check_launch: no sync), after the
    kernel's pick has checked q's shape: the batch is the sequences cu_seqlens_q describes."""
    if not mods.active:
        return
    from ..dispatch.modified import check_launch
    from ..runtime.tensors import view
    qv = view(q, "q")
    check_launch(mods, tensors, max(view(cu_seqlens_q, "cu_seqlens_q").shape[0] - 1, 0), qv.shape[1],
                 max_seqlen_q or qv.shape[0], max_seqlen_k or view(k, "k").shape[0], ragged=True,
                 where="varlen_attention")


def _prepare_bounded(head, descales, causal, window, scale, max_seqlen_q, max_seqlen_k, fp8_options, keywords):
    """(PreparedCall, the aux tensors' names it takes after the outputs) of a bounded call's first call of a
    signature: the modifications' tensors checked, the kernel picked, the launch prepared."""
    q, k, v, cu_seqlens_q = head[:4]
    mods, tensors = _modifications(keywords)
    kernel = _kernel_of(q, v, causal, window, scale, fp8_options, mods)
    _check_aux(mods, tensors, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    call = kernel.prepare_call(head + kernel.aux_tensors(tensors) + descales,
                               max_seqlen_q=length_bound("varlen_attention", "max_seqlen_q", max_seqlen_q),
                               max_seqlen_k=length_bound("varlen_attention", "max_seqlen_k", max_seqlen_k))
    return call, kernel.aux_names


def _fp8_options(fp8: bool, modified: bool, q_descale, k_descale, v_descale, out_dtype) -> tuple | None:
    """(descale granularity, O's dtype) of an FP8 call, None for 16-bit inputs; FP8's keywords on 16-bit inputs, FP8
    with modifications and per-block descales are refused, each saying why."""
    from ..errors import RuntimeInputError
    given = [x is not None for x in (q_descale, k_descale, v_descale, out_dtype)]
    if not fp8:
        if any(given):
            raise RuntimeInputError("varlen_attention: q_descale, k_descale, v_descale and out_dtype are for FP8 "
                                    "attention (float8_e4m3fn q, k, v)")
        return None
    if modified:
        raise RuntimeInputError("varlen_attention: FP8 (float8_e4m3fn) attention has no kernel with score or mask "
                                "modifications; pass bf16 or fp16 q, k, v for them")
    from ..dispatch.tuned import fp8_descale_kind, fp8_out_dtype
    from ..spec import Descale
    kind = fp8_descale_kind(q_descale, k_descale, v_descale)
    if kind is Descale.PER_BLOCK:
        raise RuntimeInputError("varlen_attention: per-block (3-d) descales index the tiles of equal-length "
                                "sequences; packed sequences take one descale each (per tensor) or (sequences, "
                                "kv_heads) each (per head)")
    return kind, fp8_out_dtype(out_dtype, "varlen_attention")


def _kernel_of(q, v, causal, window, scale, fp8_options=None, mods=NO_MODS):
    key = (signature(q), signature(v), causal, window, scale, fp8_options, mods)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = _kernels[key] = _varlen_kernel(q, v, causal, window, scale, fp8_options, mods)
    return kernel


def _varlen_kernel(q, v, causal, window, scale, fp8_options=None, mods=NO_MODS):
    from ..runtime.tensors import view
    return varlen_kernel(view(q, "q"), view(v, "v"), causal, window, scale, fp8_options, mods)


def varlen_kernel(qv, vv, causal: bool, window, scale, fp8_options: tuple | None = None, mods=NO_MODS):
    """The varlen kernel for packed q, v views (its dtype and head dims) and the mask; `fp8_options`: (descale
    granularity, O's dtype) of e4m3 q, v (FP8 attention); `mods`: score modifications (families.BUILT_MODS's
    varlen entry; FP8 takes none). Refusals name varlen_attention."""
    from ..errors import RuntimeInputError
    from ..runtime.device import device_arch
    from ..dispatch.kernels import kernel_for
    from ..families import missing_template
    mask, window, scale = mask_arguments("varlen_attention", causal, window, scale)
    if len(qv.shape) != 3 or len(vv.shape) != 3:
        raise RuntimeInputError(f"varlen_attention: q and v must be 3-d (total tokens, heads, head_dim), got shapes "
                                f"{qv.shape} and {vv.shape}")
    if fp8_options is not None:
        if mods.active:
            raise RuntimeInputError("varlen_attention: FP8 (float8_e4m3fn) attention has no kernel with score or "
                                    "mask modifications; pass bf16 or fp16 q, k, v for them")
        if qv.dtype is not DType.E4M3 or vv.dtype is not DType.E4M3:
            raise RuntimeInputError("varlen_attention: FP8 attention takes float8_e4m3fn q, k and v; got q "
                                    f"{getattr(qv.dtype, 'value', qv.dtype)}, v {getattr(vv.dtype, 'value', vv.dtype)}")
        if vv.shape[-1] != qv.shape[-1]:
            raise RuntimeInputError(f"varlen_attention: FP8 attention needs one head dim for q and v; q has "
                                    f"{qv.shape[-1]}, v {vv.shape[-1]}")
        return kernel_for(fp8_varlen_spec(device_arch(), qv.shape[-1], mask, window, scale, *fp8_options))
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"varlen_attention: q must be fp16, bf16 or (FP8 attention) float8_e4m3fn, got "
                                f"{getattr(qv.dtype, 'value', qv.dtype)}")
    spec = varlen_spec(device_arch(), qv.dtype, qv.shape[-1], mask, vv.shape[-1], window, scale, mods)
    if spec is None:
        raise RuntimeInputError(f"varlen_attention: q has head_dim {qv.shape[-1]} and v {vv.shape[-1]}; packed "
                                "sequences run on the tuned hopper schedules: head_dim 64, 128 or 256 (q and v alike), "
                                "on sm_90")
    why = missing_template(spec) if mods.active else ""
    if why:
        raise RuntimeInputError(f"varlen_attention: {why} (tiledsl.reference.serving.varlen_attention(..., "
                                "mods=, aux=) runs them in float64)")
    return kernel_for(spec)
