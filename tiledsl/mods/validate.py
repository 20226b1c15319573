"""The rules a score_mod or mask_mod tree must keep, whoever built it: the front end from spec text
(frontend/check_mods.py points an error at the text) or the tracer from a Python callable (mods/trace.py).

  - mask_mod is a condition and reads no `score` (visibility is decided, per tile where it can be, before
    any score exists); score_mod is a number;
  - an aux tensor is read with int indices that read neither an aux tensor nor `score`, and holds floats
    when score_mod reads it, ints when mask_mod does (so one tensor serves one of them);
  - `//` and `%` divide by a positive int constant (block patterns: q_idx // 64), and `int(...)` converts
    no score-dependent value (its range is unknown, so int32 could not be promised);
  - with a backward, score_mod has a gradient in score (not floor / ceil of it, and it reads score).
"""
from __future__ import annotations

from .expr import (FUNCTIONS, OPS, VARIABLES, Apply, Aux, Const, Expr, NotDifferentiable, Type, Var, depends_on_score,
                   derivative, reads, source)
from .model import BUILTIN_AUX

RESERVED_NAMES = frozenset(VARIABLES) | frozenset(FUNCTIONS) | frozenset(BUILTIN_AUX)


class ExprRuleError(ValueError):
    """A tree that breaks a rule above; `node` is the part at fault."""

    def __init__(self, message: str, node: Expr):
        super().__init__(message)
        self.node = node


def validate_expression(expr: Expr, role: str, differentiable: bool = False) -> None:
    """Raise ExprRuleError for the first rule `expr` breaks as the spec's `role` ("score_mod" or
    "mask_mod"); `differentiable`: the spec has a backward, so score_mod needs a gradient in score."""
    if role == "mask_mod":
        if expr.type is not Type.BOOL:
            raise ExprRuleError("mask_mod is a condition (which keys a query sees), e.g. kv_idx <= q_idx; this is "
                                "a number", expr)
        for var in reads(expr, Var):
            if var.name == "score":
                raise ExprRuleError("mask_mod can't read score: visibility is decided before the scores exist "
                                    "(a score-dependent change is score_mod's)", var)
    elif expr.type is Type.BOOL:
        raise ExprRuleError("score_mod gives the new score (a number); a condition is a mask: write it as mask_mod",
                            expr)
    wanted = Type.FLOAT if role == "score_mod" else Type.INT
    for node in _nodes(expr):
        if isinstance(node, Aux):
            if node.name in RESERVED_NAMES:
                raise ExprRuleError(f"'{node.name}' is a reserved name; name the aux tensor otherwise", node)
            if node.dtype is not wanted:
                raise ExprRuleError(f"{role} reads its aux tensors as {'floats' if wanted is Type.FLOAT else 'ints'}; "
                                    f"{node.name} is read as {node.dtype.value}", node)
            for index in node.indices:
                if reads(index, Aux):
                    raise ExprRuleError(f"an index can't read an aux tensor ({source(reads(index, Aux)[0])}): its "
                                        "range must be known from the shapes alone", index)
                if depends_on_score(index):
                    raise ExprRuleError("an index can't depend on score", index)
                if index.type is not Type.INT:
                    raise ExprRuleError(f"an index is an int; {source(index)} is a {index.type.value} "
                                        "(int(...) converts a float)", index)
        elif isinstance(node, Apply):
            if node.op in ("floordiv", "mod"):
                divisor = node.args[1]
                if not (isinstance(divisor, Const) and divisor.type is Type.INT and divisor.value > 0):
                    raise ExprRuleError(f"`{OPS[node.op].spelling}` divides by a positive int constant (q_idx // 64); "
                                        f"got {source(divisor)}", divisor)
            if node.op == "int" and depends_on_score(node.args[0]):
                raise ExprRuleError("int(...) of a value that depends on score: its range (and so int32's) is "
                                    "unknown", node)
    if differentiable and role == "score_mod":
        if not depends_on_score(expr):
            raise ExprRuleError("score_mod does not read score, so no gradient reaches q and k; the spec has a "
                                "backward", expr)
        try:
            derivative(expr)
        except NotDifferentiable as err:
            raise ExprRuleError(f"{err}; the spec has a backward, so score_mod needs a gradient in score",
                                err.node) from None


def _nodes(expr: Expr):
    yield expr
    for arg in expr.args:
        yield from _nodes(arg)
