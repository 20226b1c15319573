"""Random well-formed score / mask expression trees (mods/expr.py) for property tests: every tree keeps
the rules of mods/validate.py for its role (aux tensors: `t1` rank 1 and `t2` rank 2, floats in a
score_mod, ints in a mask_mod; `//` and `%` by positive constants; indices that read neither)."""
from __future__ import annotations

from hypothesis import strategies as st

from tiledsl.mods.expr import Aux, Const, Type, Var, apply

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
AUX_RANKS = {"t1": 1, "t2": 2}


@st.composite
def _tree(draw, t: Type, depth: int, score: bool, aux: Type | None):
    """A tree of type t; `score`: may read score; `aux`: the element type of aux reads (None: none)."""
    leaf = depth <= 0 or draw(st.integers(0, 3)) == 0
    if t is Type.INT:
        if leaf:
            return draw(st.one_of(st.sampled_from([Var(n) for n in INDEX_NAMES]),
                                  st.integers(-50, 50).map(Const)))
        kind = draw(st.sampled_from(["arith", "neg", "divmod", "minmax", "abs", "int", "where"]
                                    + (["aux"] if aux is Type.INT else [])))
    elif t is Type.FLOAT:
        if leaf:
            options = [st.floats(-8, 8, allow_nan=False, width=32).map(lambda x: Const(float(x)))]
            if score:
                options.append(st.just(Var("score")))
            return draw(st.one_of(*options))
        kind = draw(st.sampled_from(["arith", "neg", "div", "minmax", "abs", "unary", "round", "where", "promote"]
                                    + (["aux"] if aux is Type.FLOAT else [])))
    else:
        if leaf or draw(st.booleans()):
            number = draw(st.sampled_from([Type.INT, Type.FLOAT] if score else [Type.INT]))
            op = draw(st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"]))
            return apply(op, draw(_tree(number, depth - 1, score, aux)), draw(_tree(number, depth - 1, score, aux)))
        kind = draw(st.sampled_from(["and", "or", "not", "where"]))
    sub = depth - 1

    def same(x=t):
        return draw(_tree(x, sub, score, aux))
    if kind in ("and", "or"):
        return apply(kind, same(), same())
    if kind == "not":
        return apply("not", same())
    if kind == "arith":
        return apply(draw(st.sampled_from(["add", "sub", "mul"])), same(), same())
    if kind == "neg":
        return apply("neg", same())
    if kind == "divmod":
        return apply(draw(st.sampled_from(["floordiv", "mod"])), same(), Const(draw(st.integers(1, 64))))
    if kind == "minmax":
        return apply(draw(st.sampled_from(["min", "max"])), same(), same())
    if kind == "abs":
        return apply("abs", same())
    if kind == "int":
        return apply("int", draw(_tree(Type.FLOAT, sub, False, None)))
    if kind == "div":
        return apply("div", same(), same())
    if kind == "unary":
        return apply(draw(st.sampled_from(["tanh", "exp", "log", "sqrt", "sigmoid"])), same())
    if kind == "round":
        return apply(draw(st.sampled_from(["floor", "ceil"])), same())
    if kind == "promote":
        return apply("add", same(), draw(_tree(Type.INT, sub, False, None)))
    if kind == "where":
        return apply("where", draw(_tree(Type.BOOL, sub, score, aux)), same(), same())
    name = draw(st.sampled_from(sorted(AUX_RANKS)))
    return Aux(name, tuple(draw(_tree(Type.INT, sub, False, None)) for _ in range(AUX_RANKS[name])), aux)


def expressions(t: Type, score: bool = True, depth: int = 4, aux: bool = True):
    """Trees of type t: a score_mod's (t FLOAT: float aux reads) or a mask_mod's (t BOOL, score=False:
    int aux reads); `aux=False`: no aux reads."""
    return _tree(t, depth, score, None if not aux else Type.FLOAT if t is Type.FLOAT else Type.INT)
