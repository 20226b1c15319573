"""The score and mask expressions of a spec (`score_mod = ...`, `mask_mod = ...`): a small typed tree.

A tree is frozen, hashable data (it is part of a KernelSpec's Problem), built by the front end from
spec text (frontend/check_mods.py) or by tracing a Python callable (mods/trace.py). Every operation is
one `Apply(op, args)` node whose `op` has one row in OPS: its arity, its typing rule, its spelling in
the DSL and its precedence. What the tree means elementwise is mods/numeric.py (NumPy), what it can
take on a box of indices is mods/intervals.py, and `derivative` is its d/d(score) for the backward.

Types: `int` (indices, 32-bit in kernels), `float` (scores, 32-bit in kernels), `bool` (masks).
Names: `score` (float, the scaled score after the built-in modifications), `b`, `h` (batch and query
head), `q_idx`, `kv_idx` (the query's and key's index in their sequence, from 0), `q_len`, `kv_len`
(the sequence's lengths; kv_len is the batch entry's), all int; an aux tensor is read as
`name[i, j, ...]` with int indices that read no aux tensor themselves.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from enum import Enum


class Type(str, Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"


# The names an expression may read, and their types. `score` is only for score_mod.
VARIABLES = {"score": Type.FLOAT, "b": Type.INT, "h": Type.INT, "q_idx": Type.INT, "kv_idx": Type.INT,
             "q_len": Type.INT, "kv_len": Type.INT}
INDEX_VARIABLES = tuple(name for name in VARIABLES if name != "score")


@dataclass(frozen=True)
class OpInfo:
    arity: int
    rule: str            # typing: arith | divide | integer | compare | logic | unary_float | round | to_int |
                         # minmax | where
    spelling: str        # infix/prefix operator, or the function's name
    precedence: int      # infix and prefix operators bind by it (higher binds tighter); functions 0
    infix: bool = False
    prefix: bool = False


# Lowest to highest: | & ~ comparisons + - * / // % unary -. `&` and `|` bind looser than comparisons
# (unlike Python's), so `kv_idx <= q_idx & q_idx - kv_idx < 256` needs no parentheses.
OPS = {
    "or": OpInfo(2, "logic", "|", 1, infix=True),
    "and": OpInfo(2, "logic", "&", 2, infix=True),
    "not": OpInfo(1, "logic", "~", 3, prefix=True),
    "eq": OpInfo(2, "compare", "==", 4, infix=True),
    "ne": OpInfo(2, "compare", "!=", 4, infix=True),
    "lt": OpInfo(2, "compare", "<", 4, infix=True),
    "le": OpInfo(2, "compare", "<=", 4, infix=True),
    "gt": OpInfo(2, "compare", ">", 4, infix=True),
    "ge": OpInfo(2, "compare", ">=", 4, infix=True),
    "add": OpInfo(2, "arith", "+", 5, infix=True),
    "sub": OpInfo(2, "arith", "-", 5, infix=True),
    "mul": OpInfo(2, "arith", "*", 6, infix=True),
    "div": OpInfo(2, "divide", "/", 6, infix=True),
    "floordiv": OpInfo(2, "integer", "//", 6, infix=True),
    "mod": OpInfo(2, "integer", "%", 6, infix=True),
    "neg": OpInfo(1, "arith", "-", 7, prefix=True),
    "abs": OpInfo(1, "arith", "abs", 0),
    "min": OpInfo(2, "minmax", "min", 0),
    "max": OpInfo(2, "minmax", "max", 0),
    "tanh": OpInfo(1, "unary_float", "tanh", 0),
    "exp": OpInfo(1, "unary_float", "exp", 0),
    "log": OpInfo(1, "unary_float", "log", 0),
    "sqrt": OpInfo(1, "unary_float", "sqrt", 0),
    "sigmoid": OpInfo(1, "unary_float", "sigmoid", 0),
    "floor": OpInfo(1, "round", "floor", 0),
    "ceil": OpInfo(1, "round", "ceil", 0),
    "int": OpInfo(1, "to_int", "int", 0),          # toward zero, as C's cast and torch's .long() / .int()
    "where": OpInfo(3, "where", "where", 0),
}
FUNCTIONS = {info.spelling: op for op, info in OPS.items() if not (info.infix or info.prefix)}
INFIX = {info.spelling: op for op, info in OPS.items() if info.infix}
PREFIX = {"-": "neg", "~": "not"}


class ExprTypeError(ValueError):
    """An operation on operands of the wrong type; `node` is the operand at fault (for its span)."""

    def __init__(self, message: str, node: "Expr"):
        super().__init__(message)
        self.node = node


# ---- nodes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Const:
    value: int | float | bool
    kind: Type | None = None     # from the value's Python type; part of equality, so 1 != 1.0 != True here

    def __post_init__(self):   # NumPy scalars become Python numbers
        if isinstance(self.value, bool) or type(self.value).__name__ == "bool_":
            value, kind = bool(self.value), Type.BOOL
        elif isinstance(self.value, numbers.Integral):
            value, kind = int(self.value), Type.INT
        else:
            value, kind = float(self.value), Type.FLOAT
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "kind", kind)

    @property
    def type(self) -> Type:
        return self.kind

    @property
    def args(self) -> tuple:
        return ()


@dataclass(frozen=True)
class Var:
    name: str

    @property
    def type(self) -> Type:
        return VARIABLES[self.name]

    @property
    def args(self) -> tuple:
        return ()


@dataclass(frozen=True)
class Aux:
    """A read of an aux tensor (a named input beside q, k, v): `bias[h, q_idx - kv_idx]`."""
    name: str
    indices: tuple
    dtype: Type            # INT (int32) or FLOAT (float32)

    @property
    def type(self) -> Type:
        return self.dtype

    @property
    def args(self) -> tuple:
        return self.indices


@dataclass(frozen=True)
class Apply:
    op: str
    args: tuple

    @property
    def type(self) -> Type:
        return result_type(self.op, tuple(a.type for a in self.args))


Expr = Const | Var | Aux | Apply


def _numeric(t: Type) -> bool:
    return t in (Type.INT, Type.FLOAT)


class _Mismatch(ValueError):
    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


def result_type(op: str, types: tuple[Type, ...]) -> Type:
    """The type of `op` applied to operands of `types`; a ValueError when they do not fit (its
    `position` is the operand at fault)."""
    rule, spelling = OPS[op].rule, OPS[op].spelling

    def first(test) -> int:
        return next((i for i, t in enumerate(types) if test(t)), 0)
    if rule == "logic":
        if any(t is not Type.BOOL for t in types):
            raise _Mismatch(f"`{spelling}` combines conditions; got {_kinds(types)}",
                            first(lambda t: t is not Type.BOOL))
        return Type.BOOL
    if rule == "where":
        if types[0] is not Type.BOOL:
            raise _Mismatch(f"where(condition, a, b) takes a condition first; got {_kinds(types[:1])}", 0)
        if types[1] is Type.BOOL and types[2] is Type.BOOL:
            return Type.BOOL
        if Type.BOOL in types[1:]:
            raise _Mismatch(f"where's two values must both be numbers or both conditions; got {_kinds(types[1:])}",
                            1 if types[1] is Type.BOOL else 2)
        return Type.FLOAT if Type.FLOAT in types[1:] else Type.INT
    if rule == "compare" and op in ("eq", "ne") and types == (Type.BOOL, Type.BOOL):
        return Type.BOOL
    if Type.BOOL in types:
        what = "compares numbers" if rule == "compare" else "takes numbers"
        raise _Mismatch(f"`{spelling}` {what}; got {_kinds(types)}", first(lambda t: t is Type.BOOL))
    if rule == "compare":
        return Type.BOOL
    if rule == "integer":
        if Type.FLOAT in types:
            raise _Mismatch(f"`{spelling}` takes integers (indices); got {_kinds(types)}",
                            first(lambda t: t is Type.FLOAT))
        return Type.INT
    if rule in ("divide", "unary_float", "round"):
        return Type.FLOAT
    if rule == "to_int":
        return Type.INT
    return Type.FLOAT if Type.FLOAT in types else Type.INT   # arith, minmax


def _kinds(types) -> str:
    words = {Type.INT: "an integer", Type.FLOAT: "a float", Type.BOOL: "a condition"}
    return " and ".join(words[t] for t in types)


def apply(op: str, *args) -> Expr:
    """An Apply node, type-checked: ExprTypeError naming the operand at fault."""
    info = OPS[op]
    if len(args) != info.arity:
        raise ValueError(f"{info.spelling} takes {info.arity} argument(s), got {len(args)}")
    try:
        result_type(op, tuple(a.type for a in args))
    except _Mismatch as err:
        raise ExprTypeError(str(err), args[err.position]) from None
    return Apply(op, tuple(args))


def _plain_number(value, target) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == target


def folded(op: str, *args) -> Expr:
    """apply(op, *args), simplified where an operand makes the result plain (x + 0, x * 1, x * 0, --x):
    for the trees `derivative` builds, which are full of zeros and ones. (x * 0 is 0 even for an
    infinite x: derivatives of finite scores only.)"""
    node = apply(op, *args)
    const = [x.value if isinstance(x, Const) else None for x in args]
    if op in ("add", "sub") and _plain_number(const[1], 0) and args[0].type is node.type:
        return args[0]
    if op == "add" and _plain_number(const[0], 0) and args[1].type is node.type:
        return args[1]
    if op == "sub" and _plain_number(const[0], 0):
        return folded("neg", args[1])
    if op == "mul":
        for i in (0, 1):
            if _plain_number(const[i], 0):
                return Const(0.0 if node.type is Type.FLOAT else 0)
            if _plain_number(const[i], 1) and args[1 - i].type is node.type:
                return args[1 - i]
    if op == "div" and _plain_number(const[0], 0):
        return Const(0.0)
    if op == "neg":
        if isinstance(args[0], Apply) and args[0].op == "neg":
            return args[0].args[0]
        if isinstance(args[0], Const):
            return Const(-args[0].value)
    if op == "where" and args[1] == args[2]:
        return args[1]
    return node


def reads(expr: Expr, kind: type) -> list:
    """Every node of `kind` (Var, Aux, ...) in the tree, in source order."""
    found = [expr] if isinstance(expr, kind) else []
    for arg in expr.args:
        found += reads(arg, kind)
    return found


def depends_on_score(expr: Expr) -> bool:
    return any(v.name == "score" for v in reads(expr, Var))


def substitute(expr: Expr, name: str, value: Expr) -> Expr:
    """The tree with every read of the variable `name` replaced by `value`."""
    if isinstance(expr, Var):
        return value if expr.name == name else expr
    if isinstance(expr, Aux):
        return Aux(expr.name, tuple(substitute(i, name, value) for i in expr.indices), expr.dtype)
    if isinstance(expr, Apply):
        return Apply(expr.op, tuple(substitute(a, name, value) for a in expr.args))
    return expr


# ---- printing -------------------------------------------------------------------------------------

def _number(value) -> str:
    if isinstance(value, bool):
        return "(0 == 0)" if value else "(0 != 0)"
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    return text if ("." in text or "e" in text or "n" in text) else text + ".0"


def source(expr: Expr, parent: int = 0) -> str:
    """The tree as DSL text that parses back to an equal tree (parentheses only where needed)."""
    if isinstance(expr, Const):
        text = _number(expr.value)
        return f"({text})" if text.startswith("-") and parent >= OPS["neg"].precedence else text
    if isinstance(expr, Var):
        return expr.name
    if isinstance(expr, Aux):
        return f"{expr.name}[{', '.join(source(i) for i in expr.indices)}]"
    info = OPS[expr.op]
    if info.infix:
        # left-associative: the right operand of `a - (b - c)` keeps its parentheses; comparisons
        # don't chain, so both sides of one are printed tighter than it
        right_parent = info.precedence + 1
        left_parent = info.precedence + (1 if info.rule == "compare" else 0)
        text = f"{source(expr.args[0], left_parent)} {info.spelling} {source(expr.args[1], right_parent)}"
    elif info.prefix:   # `~(a < b)`: the parentheses `~` doesn't need are kept for the reader
        operand = source(expr.args[0], info.precedence if expr.op == "neg" else 99)
        # `- 1` is the negation of 1, `-1` the number -1: they are different trees
        text = f"{info.spelling}{' ' if isinstance(expr.args[0], Const) else ''}{operand}"
    else:
        return f"{info.spelling}({', '.join(source(a) for a in expr.args)})"
    return f"({text})" if info.precedence < parent else text


# ---- d/d(score) -------------------------------------------------------------------------------

class NotDifferentiable(ValueError):
    """An expression whose gradient in score is undefined or zero everywhere; `node` is where."""

    def __init__(self, message: str, node: Expr):
        super().__init__(message)
        self.node = node


ZERO, ONE = Const(0.0), Const(1.0)


def derivative(expr: Expr) -> Expr:
    """d expr / d score, as a float tree (piecewise operations take the derivative of the branch they
    pick: abs, min, max, where). floor / ceil of a score-dependent value is NotDifferentiable (its
    gradient is zero wherever it exists)."""
    if not depends_on_score(expr):
        return ZERO
    if isinstance(expr, Var):
        return ONE
    op, a, f = expr.op, expr.args, folded
    if op == "where":
        return f("where", a[0], derivative(a[1]), derivative(a[2]))
    if OPS[op].rule in ("round", "to_int", "integer", "compare", "logic"):
        raise NotDifferentiable(f"`{OPS[op].spelling}` of a value that depends on score has no gradient (zero or "
                                "undefined everywhere)", expr)
    d = [derivative(x) for x in a]
    if op in ("add", "sub"):
        return f(op, d[0], d[1])
    if op == "neg":
        return f("neg", d[0])
    if op == "mul":
        return f("add", f("mul", d[0], a[1]), f("mul", a[0], d[1]))
    if op == "div":
        # d0 / b - a d1 / b^2: a constant divisor (d1 = 0) leaves d0 / b, finite even for an infinite b
        quotient = f("sub", f("div", d[0], a[1]), f("div", f("mul", a[0], d[1]), f("mul", a[1], a[1])))
        return _where_moving(d, quotient)
    if op == "tanh":
        return f("mul", f("sub", ONE, f("mul", expr, expr)), d[0])
    if op == "exp":
        return f("mul", expr, d[0])
    if op == "log":
        return _where_moving(d, f("div", d[0], a[0]))
    if op == "sqrt":
        return _where_moving(d, f("div", d[0], f("mul", Const(2.0), expr)))
    if op == "sigmoid":
        return f("mul", f("mul", expr, f("sub", ONE, expr)), d[0])
    if op == "abs":
        return f("where", f("ge", a[0], Const(0)), d[0], f("neg", d[0]))
    if op == "min":
        return f("where", f("le", a[0], a[1]), d[0], d[1])
    if op == "max":
        return f("where", f("ge", a[0], a[1]), d[0], d[1])
    raise AssertionError(f"derivative: no rule for {op}")   # every op of OPS has one above


def _where_moving(d: list, chain: Expr) -> Expr:
    """`chain` where some operand moves with score, else 0: where an operand is flat (max(score, 0) below
    0), a pole of the outer derivative (sqrt's, log's, a quotient's at 0) must not make 0 * inf = NaN."""
    moving = [x for x in d if x != ZERO]
    if not moving or all(isinstance(x, Const) for x in moving):
        return chain
    flat = folded("eq", moving[0], ZERO)
    for x in moving[1:]:
        flat = folded("and", flat, folded("eq", x, ZERO))
    return folded("where", flat, ZERO, chain)
