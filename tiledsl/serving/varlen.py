"""`varlen_attention`: attention over packed variable-length sequences, FlashAttention's
flash_attn_varlen_func convention, on the tuned hopper schedules.

    o = tiledsl.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)
    o, lse = tiledsl.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)

q (total_q, heads, d), k (total_k, kv_heads, d), v (total_k, kv_heads, dv); cu_seqlens_q/k int32
(batch + 1,) GPU arrays of sequence offsets. Returns O (total_q, heads, dv) in q's dtype, and with
`return_lse` LSE fp32 (heads, total_q), natural log. Masks are aligned bottom-right per sequence.
Every call copies cu_seqlens to the host (checks and the longest-first work list,
runtime/varlen.py): the call syncs the caller's stream there and cannot be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses

from ..mods.model import NO_MODS
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


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, causal: bool = False, window: tuple[int, int] | None = None,
                     scale: float | None = None, return_lse: bool = False, softcap=None, alibi_slopes=None,
                     sinks=None, score_mod=None, mask_mod=None, aux=None):
    """Attention over packed sequences (module docstring). `window=(left, right)` is a sliding
    window around each sequence's bottom-right diagonal; it excludes causal. `max_seqlen_q/k`, when
    given, are checked against cu_seqlens. fp16 or bf16, head dims 64, 128 and 256 (the tuned
    hopper schedules); runs on the caller's current stream (torch's for torch tensors).
    softcap, alibi_slopes, sinks, score_mod, mask_mod and aux are attention's (b: the sequence's index;
    the sequences are the documents already); no kernel spells them yet: the call checks them and says so."""
    from ..errors import RuntimeInputError
    from ..runtime.device import device_arch
    from ..runtime.tensors import view
    from ..dispatch.tuned import kernel_for
    if causal and window is not None:
        raise ValueError("varlen_attention: pass causal=True or window=(left, right), not both "
                         "(a causal window is window=(left, 0))")
    qv, vv = view(q, "q"), view(v, "v")
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"varlen_attention: q must be fp16 or bf16, got {getattr(qv.dtype, 'value', qv.dtype)}")
    if len(qv.shape) != 3 or len(vv.shape) != 3:
        raise RuntimeInputError(f"varlen_attention: q and v must be 3-d (total tokens, heads, head_dim), got shapes "
                                f"{qv.shape} and {vv.shape}")
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)
    window = tuple(int(w) for w in window) if window is not None else None
    mods, tensors = NO_MODS, {}
    keywords = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                    aux=aux)
    if any(value is not None for value in keywords.values()):
        from ..dispatch.modified import check_launch, modifications
        mods, tensors = modifications("varlen_attention", **keywords)
        kv_len = max_seqlen_k or view(k, "k").shape[0]   # no bound read from cu_seqlens: the longest possible
        check_launch(mods, tensors, view(cu_seqlens_q, "cu_seqlens_q").shape[0] - 1, qv.shape[1],
                     max_seqlen_q or qv.shape[0], kv_len, ragged=True, where="varlen_attention")
    spec = varlen_spec(device_arch(), qv.dtype, qv.shape[-1], mask, vv.shape[-1], window,
                       None if scale is None else float(scale), mods)
    if mods.active and spec is not None:
        from ..families import missing_template
        why = missing_template(spec)
        if why:
            raise RuntimeInputError(f"varlen_attention: {why} (tiledsl.reference.serving.varlen_attention(..., "
                                    "mods=, aux=) runs them in float64)")
    if spec is None:
        raise RuntimeInputError(f"varlen_attention: q has head_dim {qv.shape[-1]} and v {vv.shape[-1]}; packed "
                                "sequences run on the tuned hopper schedules: head_dim 64, 128 or 256 (q and v alike), "
                                "on sm_90")
    out, lse = kernel_for(spec)(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return (out, lse) if return_lse else out
