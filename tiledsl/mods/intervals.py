"""What an expression (mods/expr.py) can take when its names range over intervals.

Interval arithmetic, sound (the true range lies inside the answer) and exact for the shapes masks are
written in (a sum or difference of distinct indices, compared with a constant or another index). Two
uses: a (q tile, kv tile) box's mask is always true (a full tile: no per-element work), never true (an
empty tile: skipped) or either (partial), from the mask's expression alone (schedule/tiles.py); and the
indices an expression can read and the integers it can form over a whole launch (mods/checks.py:
an aux tensor too small, or an int32 that could overflow, is refused before launch).

A number's interval is a Range (lo, hi, nan), bounds included, possibly infinite, with whether it may
be NaN; a condition's is (can be false, can be true).
"""
from __future__ import annotations

import math
from typing import Callable

from .expr import OPS, Apply, Aux, Const, Expr, Type, Var

INF = math.inf
UNKNOWN = (-INF, INF)
EITHER = (True, True)
INT32 = (-(1 << 31), (1 << 31) - 1)


def _mul(x, y):
    # 0 * inf is 0 here: an infinite bound stands for "no bound", and zero times any number is zero
    return 0 if x == 0 or y == 0 else x * y


def _monotone(fn, lo, hi):
    return fn(lo), fn(hi)


def _safe(fn):
    def call(x):
        try:
            return fn(x)
        except (OverflowError, ValueError):
            return INF if x > 0 else -INF
    return call


def _tanh(x):
    return math.tanh(x)


def _exp(x):
    return 0.0 if x == -INF else (INF if x > 709 else math.exp(x))


def _log(x):
    return -INF if x <= 0 else math.log(x)


def _sqrt(x):
    return 0.0 if x <= 0 else math.sqrt(x)


def _sigmoid(x):
    return 0.5 * (1 + math.tanh(x / 2)) if math.isfinite(x) else (1.0 if x > 0 else 0.0)


def _floor(x):
    return x if not math.isfinite(x) else math.floor(x)


def _ceil(x):
    return x if not math.isfinite(x) else math.ceil(x)


def _trunc(x):
    return x if not math.isfinite(x) else math.trunc(x)


_MONOTONE = {"tanh": _tanh, "exp": _exp, "log": _log, "sqrt": _sqrt, "sigmoid": _sigmoid, "floor": _floor,
             "ceil": _ceil, "int": _trunc}


def _compare(op, a, b):
    """(can be false, can be true) of `a op b` for intervals a, b."""
    (alo, ahi), (blo, bhi) = a, b
    if op == "lt":
        return not ahi < blo, alo < bhi
    if op == "le":
        return not ahi <= blo, alo <= bhi
    if op == "gt":
        return not alo > bhi, ahi > blo
    if op == "ge":
        return not alo >= bhi, ahi >= blo
    always = alo == ahi == blo == bhi
    never = ahi < blo or bhi < alo
    if op == "eq":
        return not always, not never
    return not never, not always   # ne


def _quotient(p: float, q: float) -> float:
    """p / q at the corners of a division whose divisor interval excludes zero: an infinite divisor takes a
    finite numerator to 0 and an infinite one to the signed limit."""
    if math.isinf(q):
        return 0.0 if math.isfinite(p) else math.copysign(INF, p) * math.copysign(1.0, q)
    return p / q


def _floordiv(a, c):
    return tuple(x if not math.isfinite(x) else x // c for x in a[:2])


def _mod(a, c):
    lo, hi = a[:2]
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo // c != hi // c:
        return 0, c - 1
    return lo % c, hi % c


def interval(expr: Expr, env: dict, aux_range: Callable | None = None, visit: Callable | None = None):
    """The interval of `expr` when each variable lies in env[name] = (lo, hi). A number's answer is a
    Range (lo, hi, nan: whether it may be NaN: 0 / 0, log of a negative, inf - inf); a condition's is
    (can be false, can be true), and a comparison with a possible NaN can be false (`!=`: true).
    `aux_range(node, index_ranges)` gives an aux read's (lo, hi) (None: unknown); `visit(node, answer)`
    is called for every node, children first (mods/checks.py reads the index and int ranges there)."""
    def walk(node):
        if isinstance(node, Const):
            value = node.value
            result = (not value, bool(value)) if node.type is Type.BOOL else Range(value, value, False)
        elif isinstance(node, Var):
            lo, hi = env.get(node.name, UNKNOWN)
            result = Range(lo, hi, False)
        elif isinstance(node, Aux):
            indices = [walk(i) for i in node.indices]
            found = aux_range(node, indices) if aux_range else None
            # an unknown float table may hold NaN; an int one never does
            result = Range(*found, False) if found else Range(-INF, INF, node.type is Type.FLOAT)
        else:
            result = _apply(node, [walk(a) for a in node.args])
        if visit is not None:
            visit(node, result)
        return result
    return walk(expr)


class Range(tuple):
    """A number's interval: (lo, hi, nan)."""

    def __new__(cls, lo, hi, nan=False):
        return super().__new__(cls, (lo, hi, bool(nan)))

    lo = property(lambda self: self[0])
    hi = property(lambda self: self[1])
    nan = property(lambda self: self[2])


def _unbounded(r: Range) -> bool:
    return not (math.isfinite(r.lo) and math.isfinite(r.hi))


def _contains_zero(r: Range) -> bool:
    return r.lo <= 0 <= r.hi


def _apply(node: Apply, a: list):
    op = node.op
    if op == "or":
        return a[0][0] and a[1][0], a[0][1] or a[1][1]
    if op == "and":
        return a[0][0] or a[1][0], a[0][1] and a[1][1]
    if op == "not":
        return a[0][1], a[0][0]
    if OPS[op].rule == "compare":
        if node.args[0].type is Type.BOOL:   # bool == bool: compared as 0 / 1
            a = [Range(0 if can_false else 1, 1 if can_true else 0) for can_false, can_true in a]
        can_false, can_true = _compare(op, a[0][:2], a[1][:2])
        if a[0].nan or a[1].nan:   # NaN compares false, and unequal
            can_false, can_true = (can_false, True) if op == "ne" else (True, can_true)
        return can_false, can_true
    if op == "where":
        can_false, can_true = a[0]
        if not can_false:
            return a[1]
        if not can_true:
            return a[2]
        if node.type is Type.BOOL:
            return a[1][0] or a[2][0], a[1][1] or a[2][1]
        return Range(min(a[1].lo, a[2].lo), max(a[1].hi, a[2].hi), a[1].nan or a[2].nan)
    x = a[0]
    nan = any(r.nan for r in a)
    if op == "neg":
        return Range(-x.hi, -x.lo, nan)
    if op == "int":   # a NaN or an infinity converts to an unknown int
        return Range(-INF, INF) if x.nan or _unbounded(x) else Range(_trunc(x.lo), _trunc(x.hi))
    if op in _MONOTONE:
        lo, hi = _monotone(_safe(_MONOTONE[op]), x.lo, x.hi)
        return Range(lo, hi, nan or (op in ("log", "sqrt") and x.lo < 0))
    if op == "abs":
        if x.lo >= 0:
            return Range(x.lo, x.hi, nan)
        if x.hi <= 0:
            return Range(-x.hi, -x.lo, nan)
        return Range(0, max(-x.lo, x.hi), nan)
    y = a[1]
    if op == "add":
        return Range(x.lo + y.lo, x.hi + y.hi, nan or (x.hi == INF and y.lo == -INF) or (x.lo == -INF and y.hi == INF))
    if op == "sub":
        return Range(x.lo - y.hi, x.hi - y.lo, nan or (x.hi == INF and y.hi == INF) or (x.lo == -INF and y.lo == -INF))
    if op == "mul":
        products = [_mul(p, q) for p in (x.lo, x.hi) for q in (y.lo, y.hi)]
        zero_times_inf = (_contains_zero(x) and _unbounded(y)) or (_contains_zero(y) and _unbounded(x))
        return Range(min(products), max(products), nan or zero_times_inf)
    if op == "div":
        if _contains_zero(y):
            return Range(-INF, INF, nan or _contains_zero(x) or _unbounded(x))
        # p / q itself, not p * (1 / q): a tiny q's reciprocal overflows where the quotient does not (a / a = 1)
        quotients = [_quotient(p, q) for p in (x.lo, x.hi) for q in (y.lo, y.hi)]
        return Range(min(quotients), max(quotients), nan or (_unbounded(x) and _unbounded(y)))
    if op == "min":
        return Range(min(x.lo, y.lo), min(x.hi, y.hi), nan)
    if op == "max":
        return Range(max(x.lo, y.lo), max(x.hi, y.hi), nan)
    divisor = node.args[1]
    if op in ("floordiv", "mod") and isinstance(divisor, Const) and divisor.value > 0:
        return Range(*(_floordiv(x, divisor.value) if op == "floordiv" else _mod(x, divisor.value)))
    return Range(-INF, INF, True)


def truth(interval_of_condition) -> str:
    """"always" | "never" | "maybe" for a condition's interval."""
    can_false, can_true = interval_of_condition
    if not can_false:
        return "always" if can_true else "never"
    return "maybe" if can_true else "never"
