"""Training with tiledsl: `tiledsl.attention` on torch tensors as two torch.library custom ops.

    tiledsl::attention_forward(q, k, v, kv_lens, causal, has_window, window_left, window_right,
                               scale, deterministic, validate) -> (o, lse)
    tiledsl::attention_backward(q, k, v, o, lse, do, kv_lens, causal, has_window, window_left,
                                window_right, scale, deterministic, validate) -> (dq, dk, dv)

With softcap, ALiBi, sinks or documents (the modifications the warp-specialized backward spells) two more ops
take them as arguments -- the softcap as a float, ALiBi as "" | "geometric" | "slopes" with its slopes tensor, the
sinks tensor, document_ids or document_bounds -- and the backward op returns dsink fourth (an empty tensor without
sinks):

    tiledsl::attention_forward_mods(q, k, v, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, causal,
                                    has_window, window_left, window_right, scale, softcap, alibi, deterministic,
                                    validate) -> (o, lse)
    tiledsl::attention_backward_mods(q, k, v, o, lse, do, kv_lens, alibi_slopes, sinks, document_ids,
                                     document_bounds, <the same scalars>) -> (dq, dk, dv, dsink)

score_mod / mask_mod (and their aux tensors, which get no gradient) and block_mask / prefix have no op: under
torch.compile they run EagerModifiedAttention as an eager call does.

Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces a model that calls
`tiledsl.attention` as one opaque op, and the forward's autograd formula (register_autograd) saves
q, k, v, O and the LSE and calls the backward op (recomputation: P is never kept). The real
implementations are the forward of dispatch/tuned.py and tiledsl.dispatch.backward.attention_backward, both on the
caller's current stream. The LSE is returned as a constant (marked non-differentiable): a loss
that uses it gets no gradient through it, rather than a wrong one.

An eager call whose inputs need no gradient (inference, or under torch.no_grad) skips autograd and
calls the forward directly: a warm call is then a dictionary lookup and a launch (runtime/launch.py).
Eager calls skip the ops: torch's custom_op wraps every implementation in a dynamo-disable that
imports torch._dynamo on the op's first call (seconds: bench/NOTES.md), more than the rest of a warm
first call. So outside
torch.compile, `tiledsl.attention` runs EagerAttention, an autograd.Function over the same forward and
backward the ops call (their prepared calls: tuned.forward_call, backward.backward_after_forward); under
torch.compile (dynamo has been imported by then) it calls the forward op, which dynamo traces as one node.

`import tiledsl` does not import torch; this module imports it when torch is installed and
registers the ops then (api.attention imports this module on its first torch call, and under
torch.compile that import runs for real, not traced). Without torch the pure helpers below still
import, for the CPU tests. No `from __future__ import annotations` here: torch.library reads the
ops' schema from their annotations, which must be real types.
"""
from ..errors import RuntimeInputError
from ..layout.backward_ws import ws_mods_refusal
from ..lower.expressions import expression_aux
from ..mods.model import AUX_BLOCK_MASK, AUX_DROPOUT
from . import backward, tuned

WINDOW_NONE = (False, 0, 0)   # (has_window, left, right) of "no window": ops take no Optional tuple


def encode_window(window):
    """(has_window, left, right) of attention's `window` argument (None or (left, right))."""
    if window is None:
        return WINDOW_NONE
    left, right = tuned.window_ints(window)
    return True, left, right


def decode_window(has_window: bool, left: int, right: int):
    """attention's `window` argument back from the ops' scalars."""
    return (int(left), int(right)) if has_window else None


def encode_scale(scale):
    """The ops' `scale`: a float, or None for 1/sqrt(head_dim)."""
    return None if scale is None else float(scale)


def encode_mods(mods, aux: dict) -> tuple:
    """(softcap, alibi, alibi_slopes, sinks, document_ids, document_bounds): the modified ops' arguments for `mods`
    (the API's keywords of layout.backward_ws.WS_BUILT_MODS) and their aux tensors by name."""
    from ..mods.model import AUX_ALIBI, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_SINKS
    alibi = "" if mods.alibi is None else mods.alibi.value
    return (mods.softcap, alibi, aux.get(AUX_ALIBI) if alibi == "slopes" else None, aux.get(AUX_SINKS),
            aux.get(AUX_DOCUMENT_IDS), aux.get(AUX_DOCUMENT_BOUNDS))


def mod_keywords(softcap, alibi: str, alibi_slopes, sinks, document_ids=None, document_bounds=None) -> dict:
    """tiledsl.attention's (and attention_backward's) keywords back from encode_mods' values."""
    return {"softcap": softcap, "alibi_slopes": {"": None, "geometric": "geometric"}.get(alibi, alibi_slopes),
            "sinks": sinks, "document_ids": document_ids, "document_bounds": document_bounds}


def decode_mods(softcap, alibi: str, alibi_slopes, sinks, document_ids=None, document_bounds=None) -> tuple:
    """(Modifications, aux tensors by name) of encode_mods' values."""
    from .modified import modifications
    return modifications("attention", **mod_keywords(softcap, alibi, alibi_slopes, sinks, document_ids,
                                                     document_bounds))


def gradient_refusal(mods, aux: dict, arch: str, head_dim: int, head_dim_v: int, deterministic: bool = False) -> str:
    """Why a call with `mods` that needs a gradient can't have one ("" when it can), asked before the forward
    runs: the backward's (dispatch/backward.modified_backward_refusal), or ALiBi slopes or an expression's aux
    tensor that require grad (they are constants: no gradient flows to them, and a silent None would read as
    zero)."""
    from ..lower.expressions import expression_aux
    from ..mods.model import AUX_ALIBI
    why = backward.modified_backward_refusal(arch, head_dim, head_dim_v, mods, deterministic)
    if why:
        return why
    if getattr(aux.get(AUX_ALIBI), "requires_grad", False):
        return "alibi_slopes get no gradient (they are constants of the model); pass alibi_slopes.detach()"
    learned = sorted(a.name for a in expression_aux(mods) if getattr(aux.get(a.name), "requires_grad", False))
    if learned:
        return (f"the expressions' aux tensors get no gradient (FlexAttention's rule for captured buffers), and "
                f"{', '.join(learned)} require{'s' if len(learned) == 1 else ''} one; pass .detach()")
    return ""


def torch_modified_attention(q, k, v, causal, window, scale, kv_lens, return_lse, deterministic, validate, mods,
                             aux: dict):
    """api.attention's body for torch tensors with score and mask modifications: the modified forward op under
    torch.compile, EagerModifiedAttention when an input needs a gradient, else the modified forward itself.
    Modifications without a backward (layout.backward_ws.ws_mods_refusal) run only where no gradient is needed."""
    torch = _torch
    if kv_lens is not None and not isinstance(kv_lens, torch.Tensor):
        kv_lens = torch.as_tensor(kv_lens, device=q.device)
    wants_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v, *aux.values()))
    # the modified ops carry softcap, ALiBi, sinks and documents (a block mask, a prefix, an expression or dropout
    # runs eagerly)
    if torch.compiler.is_compiling() and not ws_mods_refusal(mods) and mods.blocks is None and mods.prefix is None \
            and mods.score_mod is None and mods.mask_mod is None and mods.dropout is None:
        softcap, alibi, slopes, sinks, ids, bounds = encode_mods(mods, aux)
        has_window, left, right = encode_window(window)
        o, lse = torch.ops.tiledsl.attention_forward_mods(q, k, v, kv_lens, slopes, sinks, ids, bounds, bool(causal),
                                                          has_window, left, right, encode_scale(scale), softcap, alibi,
                                                          bool(deterministic), validate)
    elif wants_grad:
        from ..runtime.device import device_arch
        why = gradient_refusal(mods, aux, device_arch(), q.shape[-1], v.shape[-1], deterministic)
        if why:
            raise RuntimeInputError(f"attention: no gradient through the modifications ({', '.join(mods.config())})"
                                    f": {why}; call under torch.no_grad() for the forward alone")
        _, _, slopes, sinks, ids, bounds = encode_mods(mods, aux)
        expressions = {a.name: aux[a.name] for a in expression_aux(mods)}
        o, lse = EagerModifiedAttention.apply(q, k, v, kv_lens, slopes, sinks, ids, bounds, aux.get(AUX_BLOCK_MASK),
                                              expressions,
                                              eager_scalars(causal, window, scale, deterministic, validate)
                                              + (mods, aux.get(AUX_DROPOUT)))
    else:
        o, lse = tuned.modified_forward(q, k, v, causal, window, scale, kv_lens, mods, aux, validate)
    return (o, lse) if return_lse else o


def torch_attention(q, k, v, causal=False, window=None, scale=None, kv_lens=None, return_lse=False,
                    deterministic=False, validate=None):
    """api.attention's body for torch tensors: the forward custom op under torch.compile (which traces
    this function, so it holds only what dynamo can trace), EagerAttention when an input needs a
    gradient, else the forward itself."""
    torch = _torch
    if kv_lens is not None and not isinstance(kv_lens, torch.Tensor):
        kv_lens = torch.as_tensor(kv_lens, device=q.device)   # e.g. a CuPy array, zero-copy
    if torch.compiler.is_compiling():
        has_window, left, right = encode_window(window)
        o, lse = torch.ops.tiledsl.attention_forward(q, k, v, kv_lens, bool(causal), has_window, left, right,
                                                     encode_scale(scale), bool(deterministic), validate)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = EagerAttention.apply(q, k, v, kv_lens, eager_scalars(causal, window, scale, deterministic, validate))
    else:
        o, lse = tuned.forward(q, k, v, causal, window, scale, kv_lens, validate=validate)
    return (o, lse) if return_lse else o


def eager_scalars(causal, window, scale, deterministic, validate) -> tuple:
    """EagerAttention's one non-tensor argument: (causal, window, scale, deterministic, validate), each as
    api.attention checked it (window a pair of ints or None, scale a float or None)."""
    return bool(causal), None if window is None else tuple(window), encode_scale(scale), bool(deterministic), validate


def run_forward(q, k, v, kv_lens, causal, has_window, window_left, window_right, scale, deterministic, validate):
    """(O, LSE) by tuned.forward: the forward op's implementation (the runtime reads the tensors' pointers
    itself: no detach needed)."""
    return tuned.forward(q, k, v, causal, decode_window(has_window, window_left, window_right), scale, kv_lens,
                         validate=validate)


def run_backward(q, k, v, o, lse, do, kv_lens, causal, has_window, window_left, window_right, scale, deterministic,
                 validate):
    """(dQ, dK, dV) by tiledsl.dispatch.backward: the backward op's implementation."""
    grads = backward.attention_backward(q, k, v, o, lse, do, causal=causal,
                                        window=decode_window(has_window, window_left, window_right), scale=scale,
                                        kv_lens=kv_lens, deterministic=deterministic, validate=validate)
    # The backward op's fake promises contiguous gradients (a no-op when they already are).
    return tuple(g.contiguous() for g in grads)


def _dtype_name(torch, dtype):
    """A torch dtype as tiledsl's DType (or its torch name), for the fake op's refusals."""
    from ..spec import DType
    return {torch.float16: DType.FP16, torch.bfloat16: DType.BF16, torch.float32: DType.FP32}.get(
        dtype, str(dtype).replace("torch.", ""))


def _register(torch):
    """Define the two ops, their fakes and the autograd formula (once per process)."""
    from typing import Optional, Tuple
    Tensor = torch.Tensor

    @torch.library.custom_op("tiledsl::attention_forward", mutates_args=())
    def attention_forward(q: Tensor, k: Tensor, v: Tensor, kv_lens: Optional[Tensor], causal: bool,
                          has_window: bool, window_left: int, window_right: int, scale: Optional[float],
                          deterministic: bool, validate: Optional[bool]) -> Tuple[Tensor, Tensor]:
        return run_forward(q, k, v, kv_lens, causal, has_window, window_left, window_right, scale, deterministic,
                           validate)

    @attention_forward.register_fake
    def _(q, k, v, kv_lens, causal, has_window, window_left, window_right, scale, deterministic, validate):
        from .tuned import check_q_v
        check_q_v(_dtype_name(torch, q.dtype), tuple(q.shape), tuple(v.shape))
        batch, heads, q_len = q.shape[:3]
        return q.new_empty((batch, heads, q_len, v.shape[-1])), q.new_empty((batch, heads, q_len), dtype=torch.float32)

    @torch.library.custom_op("tiledsl::attention_backward", mutates_args=())
    def attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                           kv_lens: Optional[Tensor], causal: bool, has_window: bool, window_left: int,
                           window_right: int, scale: Optional[float], deterministic: bool, validate: Optional[bool]
                           ) -> Tuple[Tensor, Tensor, Tensor]:
        return run_backward(q, k, v, o, lse, do, kv_lens, causal, has_window, window_left, window_right, scale,
                            deterministic, validate)

    @attention_backward.register_fake
    def _(q, k, v, o, lse, do, kv_lens, causal, has_window, window_left, window_right, scale, deterministic,
          validate):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, kv_lens, *scalars = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, kv_lens)
        ctx.scalars = scalars   # causal, has_window, window_left, window_right, scale, deterministic, validate
        ctx.mark_non_differentiable(lse)

    def op_backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse, kv_lens = ctx.saved_tensors
        dq, dk, dv = torch.ops.tiledsl.attention_backward(q, k, v, o, lse, grad_o.contiguous(), kv_lens, *ctx.scalars)
        return (dq, dk, dv) + (None,) * (1 + len(ctx.scalars))   # kv_lens and the scalars: no gradient

    attention_forward.register_autograd(op_backward, setup_context=setup_context)

    @torch.library.custom_op("tiledsl::attention_forward_mods", mutates_args=())
    def attention_forward_mods(q: Tensor, k: Tensor, v: Tensor, kv_lens: Optional[Tensor],
                               alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], document_ids: Optional[Tensor],
                               document_bounds: Optional[Tensor], causal: bool, has_window: bool, window_left: int,
                               window_right: int, scale: Optional[float], softcap: Optional[float], alibi: str,
                               deterministic: bool, validate: Optional[bool]) -> Tuple[Tensor, Tensor]:
        mods, aux = decode_mods(softcap, alibi, alibi_slopes, sinks, document_ids, document_bounds)
        return tuned.modified_forward(q, k, v, causal, decode_window(has_window, window_left, window_right), scale,
                                      kv_lens, mods, aux, validate, recorded=True)

    @attention_forward_mods.register_fake
    def _(q, k, v, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, causal, has_window, window_left,
          window_right, scale, softcap, alibi, deterministic, validate):
        from .tuned import check_q_v
        check_q_v(_dtype_name(torch, q.dtype), tuple(q.shape), tuple(v.shape))
        batch, heads, q_len = q.shape[:3]
        return q.new_empty((batch, heads, q_len, v.shape[-1])), q.new_empty((batch, heads, q_len), dtype=torch.float32)

    @torch.library.custom_op("tiledsl::attention_backward_mods", mutates_args=())
    def attention_backward_mods(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                                kv_lens: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                                document_ids: Optional[Tensor], document_bounds: Optional[Tensor], causal: bool,
                                has_window: bool, window_left: int, window_right: int, scale: Optional[float],
                                softcap: Optional[float], alibi: str, deterministic: bool, validate: Optional[bool]
                                ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        grads = backward.attention_backward(q, k, v, o, lse, do, causal=causal,
                                            window=decode_window(has_window, window_left, window_right), scale=scale,
                                            kv_lens=kv_lens, deterministic=deterministic, validate=validate,
                                            **mod_keywords(softcap, alibi, alibi_slopes, sinks, document_ids,
                                                           document_bounds))
        dsink = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
        return tuple(g.contiguous() for g in grads[:3]) + (dsink,)

    @attention_backward_mods.register_fake
    def _(q, k, v, o, lse, do, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, causal, has_window,
          window_left, window_right, scale, softcap, alibi, deterministic, validate):
        dsink = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsink

    def setup_context_mods(ctx, inputs, output):
        q, k, v, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, *scalars = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, kv_lens, alibi_slopes, sinks, document_ids, document_bounds)
        ctx.scalars = scalars   # causal, has_window, window_left, window_right, scale, softcap, alibi, deterministic,
        ctx.mark_non_differentiable(lse)   # validate

    def op_backward_mods(ctx, grad_o, grad_lse):
        q, k, v, o, lse, kv_lens, alibi_slopes, sinks, document_ids, document_bounds = ctx.saved_tensors
        dq, dk, dv, dsink = torch.ops.tiledsl.attention_backward_mods(q, k, v, o, lse, grad_o.contiguous(), kv_lens,
                                                                      alibi_slopes, sinks, document_ids,
                                                                      document_bounds, *ctx.scalars)
        # kv_lens, the slopes (constants), the documents and the scalars: no gradient
        return (dq, dk, dv, None, None, dsink if sinks is not None else None, None, None) + (None,) * len(ctx.scalars)

    attention_forward_mods.register_autograd(op_backward_mods, setup_context=setup_context_mods)

    class EagerAttention(torch.autograd.Function):
        """The forward op's autograd formula without the op (see the module docstring: why), for the eager
        call's host cost: one non-tensor argument (eager_scalars) instead of the op's seven, no zero gradient
        made for the LSE (it gets none), and the backward's launches found by the forward's prepared call
        (backward.backward_after_forward) instead of by reading every tensor's signature again."""

        @staticmethod
        def forward(ctx, q, k, v, kv_lens, scalars):
            causal, window, scale, _, validate = scalars
            call = tuned.forward_call(q, k, v, causal, window, scale, kv_lens, validate)
            o, lse = call(q, k, v, kv_lens, None, None)
            ctx.save_for_backward(q, k, v, o, lse, kv_lens)
            ctx.forward_call, ctx.scalars = call, scalars
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)   # grad_lse stays None: no zeros allocated and filled per call
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            if grad_o is None:   # nothing reached O (the LSE carries no gradient)
                return None, None, None, None, None
            q, k, v, o, lse, kv_lens = ctx.saved_tensors
            dq, dk, dv = backward.backward_after_forward(ctx.forward_call, ctx.scalars, q, k, v, o, lse,
                                                         grad_o.contiguous(), kv_lens)
            return dq, dk, dv, None, None

    class EagerModifiedAttention(torch.autograd.Function):
        """The modified forward op's autograd formula without the op (as EagerAttention): one non-tensor argument,
        eager_scalars + (the Modifications, dropout's (seed, offset) or None: the backward redraws the forward's
        mask from it); the slopes, sinks, documents and block mask tensors beside q, k, v and kv_lens, then the
        expressions' aux tensors by name (a dict: they get no gradient)."""

        @staticmethod
        def forward(ctx, q, k, v, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, block_mask, expressions,
                    scalars):
            causal, window, scale, _, validate, mods, rng = scalars
            aux = {name: t for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks),
                                           ("document_ids", document_ids), ("document_bounds", document_bounds),
                                           (AUX_BLOCK_MASK, block_mask), (AUX_DROPOUT, rng)) if t is not None} \
                | expressions
            o, lse = tuned.modified_forward(q, k, v, causal, window, scale, kv_lens, mods, aux, validate,
                                            recorded=True)
            ctx.save_for_backward(q, k, v, o, lse, kv_lens, alibi_slopes, sinks, document_ids, document_bounds,
                                  block_mask)
            ctx.scalars, ctx.expressions = scalars, expressions
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            if grad_o is None:
                return (None,) * 11
            q, k, v, o, lse, kv_lens, alibi_slopes, sinks, document_ids, document_bounds, block_mask = ctx.saved_tensors
            causal, window, scale, deterministic, validate, mods, rng = ctx.scalars
            softcap, alibi, *_ = encode_mods(mods, {})
            masks = {} if block_mask is None else {"block_mask": block_mask, "block_size": mods.blocks}
            masks |= {} if mods.prefix is None else {"prefix": mods.prefix}
            masks |= {"score_mod": mods.score_mod, "mask_mod": mods.mask_mod, "aux": ctx.expressions} \
                if ctx.expressions or mods.score_mod is not None or mods.mask_mod is not None else {}
            masks |= {} if mods.dropout is None else {"dropout_p": mods.dropout, "dropout_rng": rng}
            grads = backward.attention_backward(q, k, v, o, lse, grad_o.contiguous(), causal=causal, window=window,
                                                scale=scale, kv_lens=kv_lens, deterministic=deterministic,
                                                validate=validate,
                                                **mod_keywords(softcap, alibi, alibi_slopes, sinks, document_ids,
                                                               document_bounds), **masks)
            dsink = grads[3] if sinks is not None else None   # (autograd drops it when sinks need none)
            return grads[0], grads[1], grads[2], None, None, dsink, None, None, None, None, None

    return attention_forward, attention_backward, EagerAttention, EagerModifiedAttention


try:
    import torch as _torch
except ImportError:
    _torch = None
# (forward op, backward op, EagerAttention, EagerModifiedAttention); None without torch
OPS = _register(_torch) if _torch is not None else None
EagerAttention = OPS[2] if OPS is not None else None
EagerModifiedAttention = OPS[3] if OPS is not None else None
