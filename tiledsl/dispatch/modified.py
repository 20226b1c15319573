"""The Python API's score and mask modifications: `tiledsl.attention(..., softcap=, alibi_slopes=, sinks=,
document_ids=, document_bounds=, score_mod=, mask_mod=, aux=)` (and paged_attention / varlen_attention's
same keywords) become the spec's Modifications (mods/model.py) and the aux tensors a launch passes, the
same ones `softcap = 30`, `mask = causal & document`, `score_mod = ...` write in a spec
(tiledsl.spec_for prints it).

  softcap          a float > 0
  alibi_slopes     "geometric" (the ALiBi paper's slopes for the head count) or a float tensor (heads,) or
                   (batch, heads)
  sinks            a float tensor (heads,): one learned logit per head joins the softmax
  document_ids     an int tensor (batch, kv_len): query i sees key j when the ids at i + kv_len - q_len and
                   at j are equal and >= 0 (negative: padding, in no document)
  document_bounds  an int tensor (batch, documents + 1) of cu_seqlens-like offsets instead of ids
  score_mod        DSL text ("score + bias[h, q_idx - kv_idx]"), a Python callable (mods/trace.py), or a
                   mods.expr tree
  mask_mod         the same, a condition
  aux              the expressions' aux tensors by name
The aux tensors' shapes and element kinds are checked before launch (mods/checks.check_aux: shapes only,
no device sync).
"""
from __future__ import annotations

import numbers

from ..errors import RuntimeInputError
from ..mods.model import (AUX_ALIBI, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_SINKS, AlibiSlopes, Documents,
                          Modifications, NO_MODS)

KEYWORDS = ("softcap", "alibi_slopes", "sinks", "document_ids", "document_bounds", "score_mod", "mask_mod", "aux")


def modifications(where: str = "attention", *, softcap=None, alibi_slopes=None, sinks=None, document_ids=None,
                  document_bounds=None, score_mod=None, mask_mod=None, aux=None, differentiable: bool = False
                  ) -> tuple[Modifications, dict]:
    """(the Modifications of the keywords, the aux tensors by name). `differentiable`: the call needs a
    gradient, so score_mod must have one in score."""
    fields, tensors = {}, dict(aux or {})
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < float(softcap) < float("inf"):
            raise RuntimeInputError(f"{where}: softcap must be a finite number > 0, got {softcap!r}")
        fields["softcap"] = float(softcap)
    if isinstance(alibi_slopes, str):
        if alibi_slopes != "geometric":
            raise RuntimeInputError(f"{where}: alibi_slopes is 'geometric' or a float tensor, got {alibi_slopes!r}")
        fields["alibi"] = AlibiSlopes.GEOMETRIC
    elif alibi_slopes is not None:
        fields["alibi"], tensors[AUX_ALIBI] = AlibiSlopes.GIVEN, alibi_slopes
    if sinks is not None:
        fields["sinks"], tensors[AUX_SINKS] = True, sinks
    if document_ids is not None and document_bounds is not None:
        raise RuntimeInputError(f"{where}: pass document_ids or document_bounds, not both")
    if document_ids is not None:
        fields["document"], tensors[AUX_DOCUMENT_IDS] = Documents.IDS, document_ids
    if document_bounds is not None:
        fields["document"], tensors[AUX_DOCUMENT_BOUNDS] = Documents.BOUNDS, document_bounds
    for role, given in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if given is not None:
            fields[role], tensors = expression(where, role, given, tensors, differentiable)
    return (Modifications(**fields) if fields else NO_MODS), tensors


def keywords_key(softcap, alibi_slopes, sinks) -> tuple:
    """What a prepared call's key holds of the built-in keywords: softcap's value, ALiBi's kind or its tensor's
    signature, the sinks' signature (the tensors themselves are read by pointer on every call)."""
    from ..runtime.tensors import signature
    return (softcap if isinstance(softcap, (int, float)) else repr(softcap),
            alibi_slopes if isinstance(alibi_slopes, str) else signature(alibi_slopes), signature(sinks))


def expression(where: str, role: str, given, aux: dict, differentiable: bool = False):
    """(the tree of `given`: DSL text, a callable or a tree, the aux dict with captured tensors)."""
    from ..mods.expr import Aux, Apply, Const, Var
    from ..mods.validate import ExprRuleError, validate_expression
    if isinstance(given, str):
        from ..errors import SpecError
        from ..frontend.parse import parse_text
        backward = "    backward {\n    }\n" if differentiable else ""
        text = f"attention {role} {{\n    head_dim = 64\n    {role} = {given}\n{backward}}}\n"
        try:
            (spec,) = parse_text(text, f"<{role}>")
        except SpecError as err:
            raise RuntimeInputError(f"{where}: {role}: {err.render()}") from None
        return getattr(spec.problem.mods, role), aux
    if isinstance(given, (Const, Var, Aux, Apply)):
        try:
            validate_expression(given, role, differentiable)
        except ExprRuleError as err:
            raise RuntimeInputError(f"{where}: {role}: {err}") from None
        return given, aux
    if callable(given):
        from ..mods.trace import TraceError, trace
        try:
            return trace(given, role, aux, differentiable)
        except TraceError as err:
            raise RuntimeInputError(f"{where}: {err}") from None
    raise RuntimeInputError(f"{where}: {role} is DSL text, a callable or an expression tree, got "
                            f"{type(given).__name__}")


def shapes_of(aux: dict) -> dict:
    """name -> (shape, is_float) of the aux tensors (torch, CuPy, NumPy: by their shape and dtype)."""
    out = {}
    for name, value in aux.items():
        dtype = str(getattr(value, "dtype", ""))
        out[name] = (tuple(getattr(value, "shape", ())), "float" in dtype or "bfloat" in dtype)
    return out


def check_launch(mods: Modifications, aux: dict, batch: int, heads: int, q_len: int, kv_len: int,
                 ragged: bool = False, where: str = "attention") -> None:
    """mods/checks.check_aux on the tensors' shapes (no sync). `ragged`: kv_lens shorten the sequences
    by amounts not read here, so an expression's kv_len may be anything in 0..kv_len."""
    from ..mods.checks import check_aux
    check_aux(mods, shapes_of(aux), batch, heads, q_len, kv_len, [0, kv_len] if ragged else None, where)
