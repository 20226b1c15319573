"""`tiledsl.attention`: the entry point. Torch tensors go to the custom op of tiledsl/dispatch/autograd.py
(differentiable, traceable by torch.compile), anything else to tuned.forward. Its own module, so
that autograd (whose op runs tuned.forward) and tuned do not import each other.

    o = tiledsl.attention(q, k, v, causal=True)        # q (batch, heads, seqlen, d), k/v alike
    o, lse = tiledsl.attention(q, k, v, kv_lens=lens, return_lse=True)
"""
from __future__ import annotations

from .runtime.arguments import mask_arguments, switch
from .spec import Mask


def attention(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
              kv_lens=None, return_lse: bool = False, deterministic: bool = False, k_scale=None, v_scale=None,
              validate: bool | None = None, *, softcap=None, alibi_slopes=None, sinks=None, document_ids=None,
              document_bounds=None, prefix=None, block_mask=None, block_size=None, score_mod=None, mask_mod=None,
              aux=None, dropout_p=0.0, dropout_seed=None, q_descale=None, k_descale=None, v_descale=None,
              out_dtype=None):
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

    float8_e4m3fn q, k and v are FP8 attention (the hopper family's e4m3 kernels, head dims 64, 128, 256):
    `q_descale`, `k_descale`, `v_descale` are float32 (value = byte * descale): one value each, (batch, kv_heads)
    each (FlashAttention-3's convention; Q's shared by its kv head's query heads), or per tile ((batch, heads,
    q tiles) and (batch, kv_heads, kv tiles) of the kernel's 128-query / 128-key tiles), as
    tiledsl.quantize_fp8 makes them; None: 1.0. Descales are finite and >= 0 (per-block V descales > 0),
    as quantize_fp8's are: the kernel checks each one it reads (no sync), makes the rows that read a bad one NaN and
    reports it (the next call or tiledsl.check_errors() raises it). O is `out_dtype`
    (bf16 or fp16, default bf16); forward only.

    `validate=True` checks kv_lens on the host first (a sync; runtime/index_checks.py says when the
    default does). The first call of a configuration picks and loads the kernel and prepares its
    launch; a later call with the same shapes, strides, dtypes and devices reads the tensors'
    pointers and launches (runtime/launch.py).

    Score and mask modifications (tiledsl/dispatch/modified.py; `spec_for` prints the spec they make):
    `softcap` (30: scores become 30 tanh(s / 30)), `alibi_slopes` ("geometric" or a float tensor),
    `sinks` (a float tensor (heads,)), `document_ids` (int (batch, kv_len)) or `document_bounds` (int
    (batch, documents + 1)), `prefix` (prefix-LM: an int N, the first N keys visible to every query and the rest
    causal; its own mask, so causal=False and no window), `block_mask` (block-sparse: an int or bool tensor
    (batch or 1, heads or 1, q blocks, kv blocks), nonzero = computed, of `block_size` (q, kv) blocks, default 128;
    or a FlexAttention BlockMask),
    `score_mod` / `mask_mod` (DSL text, or a callable traced by tiledsl/mods/trace.py) and `aux` (their aux
    tensors by name), `dropout_p` (a probability in [0, 1): dropout on the attention weights, 0 the plain kernels;
    the seed is torch's CUDA generator's for torch tensors, `dropout_seed` an int for a fixed mask, else a counter
    tiledsl holds: tiledsl/dispatch/dropout.py; refused under CUDA-graph capture). All of them run on the hopper
    family's forward kernels (families.BUILT_MODS; a call of 1..16 queries with only softcap, alibi_slopes and sinks
    runs the decode kernels, which spell those three); a mask_mod
    together with block_mask is refused (each picks the kv tiles an item walks). The warp-specialized Hopper
    backward (head dims 64, 128, 256) differentiates softcap and ALiBi, sinks (which get their gradient when they
    require grad), the documents, prefix, block_mask, score_mod (dS through its derivative; softcap and a score_mod
    together are refused: write the cap in the score_mod), mask_mod (without documents, prefix or block_mask) and
    dropout (redrawing the forward's mask from the (seed, offset) autograd saves; not beside score_mod or mask_mod):
    torch tensors that require grad go through autograd (under torch.compile the custom ops
    tiledsl::attention_forward_mods / attention_backward_mods; block_mask, prefix, the expressions and dropout run
    eagerly there); deterministic=True with both documents and block_mask is refused (layout.backward_ws:
    ws_ordered_refusal). The expressions' aux tensors get no gradient (FlexAttention's rule for captured buffers: one
    that requires grad is refused; pass it detached). A score_mod without a gradient (floor of the score) and a
    call that needs a gradient through a problem the backward does not take are refused before it runs. Documents
    are runs of one id each (packed sequences); the host checks that where it checks kv_lens (`validate`;
    validate=False keeps the call sync-free). Any other modification, or another family, checks its aux tensors,
    then raises RuntimeInputError naming what is missing."""
    mask, window, scale = mask_arguments("attention", causal, window, scale)   # before any spec is built
    causal, return_lse = mask is Mask.CAUSAL, switch("attention", "return_lse", return_lse)
    deterministic = switch("attention", "deterministic", deterministic)
    fp8 = "float8" in str(getattr(q, "dtype", ""))
    if fp8 and (k_scale is not None or v_scale is not None):
        from .errors import RuntimeInputError
        raise RuntimeInputError("attention: k_scale / v_scale dequantize an FP8 KV cache read by fp16 / bf16 q; "
                                "float8_e4m3fn q, k, v (FP8 attention) take q_descale, k_descale and v_descale")
    if not (softcap is None and alibi_slopes is None and sinks is None and document_ids is None
            and document_bounds is None and prefix is None and block_mask is None and block_size is None
            and score_mod is None and mask_mod is None and aux is None and not dropout_p and dropout_seed is None):
        from .dispatch.modified import check_mask, modifications
        from .dispatch.tuned import modified_forward
        keywords = dict(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, document_ids=document_ids,
                        document_bounds=document_bounds, prefix=prefix, block_mask=block_mask, block_size=block_size,
                        score_mod=score_mod, mask_mod=mask_mod, aux=aux, dropout_p=dropout_p)
        needs_grad = any(getattr(x, "requires_grad", False) for x in (q, k, v, sinks))
        mods, tensors = modifications("attention", differentiable=needs_grad, **keywords)
        check_mask("attention", mods, mask)
        if mods.active and fp8:
            from .errors import RuntimeInputError
            raise RuntimeInputError(f"attention: FP8 (float8_e4m3fn) attention has no kernel with score or mask "
                                    f"modifications ({', '.join(mods.config())}); pass bf16 or fp16 q, k, v for them")
        if mods.dropout is not None:
            from .dispatch.dropout import draw_rng
            from .mods.model import AUX_DROPOUT
            tensors[AUX_DROPOUT] = draw_rng("attention", q, dropout_seed)
        elif dropout_seed is not None:
            from .errors import RuntimeInputError
            raise RuntimeInputError("attention: dropout_seed seeds dropout; pass dropout_p > 0 with it")
        if mods.active and type(q).__module__.startswith("torch"):   # autograd and torch.compile's path
            if _entry.tuned is None:
                _load_entry_points()
            return _entry.autograd.torch_modified_attention(q, k, v, causal, window, scale, kv_lens, return_lse,
                                                            deterministic, validate, mods, tensors)
        if mods.active:
            out, lse = modified_forward(q, k, v, causal, window, scale, kv_lens, mods, tensors, validate)
            return (out, lse) if return_lse else out
    if _entry.tuned is None:
        _load_entry_points()
    if fp8:
        out, lse = _entry.tuned.fp8_forward(q, k, v, causal, window, scale, kv_lens, q_descale, k_descale, v_descale,
                                            out_dtype, validate)
        return (out, lse) if return_lse else out
    if any(x is not None for x in (q_descale, k_descale, v_descale, out_dtype)):
        from .errors import RuntimeInputError
        raise RuntimeInputError("attention: q_descale, k_descale, v_descale and out_dtype are for FP8 attention "
                                f"(float8_e4m3fn q, k, v); q is {getattr(q, 'dtype', type(q).__name__)}")
    if type(q).__module__.startswith("torch") and k_scale is None and v_scale is None and \
            "float8" not in str(k.dtype):
        return _entry.autograd.torch_attention(q, k, v, causal, window, scale, kv_lens, return_lse, deterministic,
                                               validate)
    out, lse = _entry.tuned.forward(q, k, v, causal, window, scale, kv_lens, k_scale, v_scale, validate)
    return (out, lse) if return_lse else out


def _serving_spec_for(q, k, v, dtype, layout: str, causal, window, scale, arch, name, modifications) -> str:
    """spec_for's paged and varlen specs (serving/paged.py's and serving/varlen.py's picks)."""
    from .dispatch.modified import modifications as build
    from .errors import RuntimeInputError
    from .tune.search import spec_to_dsl
    rank = 4 if layout == "paged" else 3
    if dtype is None or len(q.shape) != rank or len(k.shape) != rank or len(v.shape) != rank:
        axes = "(batch, queries, heads, head_dim)" if layout == "paged" else "(total tokens, heads, head_dim)"
        raise RuntimeInputError(f"spec_for: layout = {layout}: q, k and v must be {rank}-d fp16 or bf16 {axes}; got "
                                f"{getattr(q, 'dtype', '?')} {tuple(getattr(q, 'shape', ()))}")
    mask, window, scale = mask_arguments("spec_for", causal, window, scale)
    mods, _ = build("spec_for", tables=False, **modifications)
    scale = None if scale is None else float(scale)
    if layout == "paged":
        from .serving.paged import paged_spec
        spec = paged_spec(dtype, q.shape[-1], v.shape[-1], mask, k.shape[1], q.shape[1], window, scale, mods=mods)
    else:
        from .serving.varlen import varlen_spec
        spec = varlen_spec(arch, dtype, q.shape[-1], mask, v.shape[-1], window, scale, mods)
        if spec is None:
            raise RuntimeInputError(f"spec_for: no varlen schedule for head_dim {q.shape[-1]}")
    return spec_to_dsl(spec, name or spec.name)


class _EntryPoints:
    """The implementing modules, imported on the first call (importing them pulls in the runtime). Filled in by
    attribute on this one object: under torch.compile a model's first call is traced, and dynamo follows stores
    to an existing object's attributes but not the making of a new namespace."""
    autograd = None
    tuned = None


_entry = _EntryPoints()


def _load_entry_points() -> None:
    from .dispatch import autograd, tuned
    _entry.autograd, _entry.tuned = autograd, tuned


def spec_for(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None, *,
             arch: str | None = None, name: str | None = None, layout: str = "batched", **modifications) -> str:
    """The spec `attention(q, k, v, ...)` runs, as DSL text that tiledsl.parse_text reads back to the same
    kernel: the tuned schedule for q's shape and dtype on `arch` (None: this GPU's, or sm_90a without one)
    with the call's mask and modifications (attention's keywords; callables are traced). q, k, v may be
    any arrays with .shape and .dtype (shapes are read, never data). `layout`: "paged" prints the spec
    paged_attention(q, k_cache, v_cache, ...) runs (q (batch, queries, heads, d), k (pages, page size, kv heads,
    d)), "varlen" varlen_attention's (q (total, heads, d))."""
    from .dispatch.modified import KEYWORDS, check_mask, modifications as build
    from .dispatch.tuned import tuned_spec
    from .errors import RuntimeInputError
    from .spec import DTYPES, DType
    from .tune.search import spec_to_dsl
    unknown = sorted(set(modifications) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"spec_for: unknown keyword(s) {', '.join(unknown)}; modifications: {', '.join(KEYWORDS)}")
    mask, window, scale = mask_arguments("spec_for", causal, window, scale)
    # the dtype's own name, after any "torch." prefix: "bfloat16" also ends with "float16"
    names = {DTYPES[d].torch: d for d in (DType.FP16, DType.BF16)} | {"half": DType.FP16}
    dtype = names.get(str(getattr(q, "dtype", "")).rsplit(".", 1)[-1])
    if layout not in ("batched", "paged", "varlen"):
        raise RuntimeInputError(f"spec_for: layout is 'batched', 'paged' or 'varlen', got {layout!r}")
    if dtype is None or layout == "batched" and (len(q.shape) != 4 or len(v.shape) != 4):
        raise RuntimeInputError(f"spec_for: q must be 4-d fp16 or bf16 (batch, heads, seqlen, head_dim); got "
                                f"{getattr(q, 'dtype', '?')} {tuple(getattr(q, 'shape', ()))}")
    if arch is None:
        try:
            from .runtime.device import device_arch
            arch = device_arch()
        except Exception:   # no GPU (or no CuPy) here: Hopper's table
            arch = "sm_90a"
    if layout != "batched":
        return _serving_spec_for(q, k, v, dtype, layout, causal, window, scale, arch, name, modifications)
    mods, _ = build("spec_for", tables=False, **modifications)
    check_mask("spec_for", mods, mask)
    spec, _ = tuned_spec(arch, dtype, q.shape[-1], mask, v.shape[-1], window, scale, q.shape[2], mods)
    return spec_to_dsl(spec, name or spec.name)
