"""Python callables as score_mod / mask_mod: traced once on symbolic arguments into an expression tree
(mods/expr.py), the same tree the DSL text makes, so a callable and its printed spec are one kernel.

    score_mod(score, b, h, q_idx, kv_idx) -> the new score        (FlexAttention's signature)
    mask_mod(b, h, q_idx, kv_idx) -> whether the key is visible

Each argument is a `Traced` value whose operators (+ - * / // % and unary -, comparisons, & | ~) and
methods (.tanh() .exp() .log() .sqrt() .sigmoid() .abs() .floor() .ceil() .clamp(lo, hi) .long()
.int() .float()) build the tree, and so do the torch functions of the same names, torch.where,
torch.minimum / maximum and the abs() builtin (through torch's __torch_function__ protocol). Aux
tensors are read by indexing: a torch tensor the callable captures (`bias[h, q_idx - kv_idx]`) becomes
an aux tensor, named by the `aux` dict entry that holds it (or `captured0`, `captured1`, ... and added
to it); a parameter after the standard ones is the aux tensor of that name (any framework:
`lambda score, b, h, q_idx, kv_idx, bias: score + bias[h, q_idx]`).

Limits, refused with a TraceError that says so: Python control flow on a traced value (`if`, `and`,
`or`, `not`, the min() / max() builtins, math.* functions, int() / float() of one: use torch.where,
&, |, ~, torch.minimum, torch.maximum); numbers the callable captures are baked into the kernel (a
different number is a different kernel); a torch function outside the table above.
"""
from __future__ import annotations

import inspect
import numbers

from .expr import Aux, Const, Expr, ExprTypeError, Type, Var, apply, source
from .validate import ExprRuleError, validate_expression

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")


class TraceError(ValueError):
    """A callable that can't be traced into a score_mod / mask_mod (the module docstring: why)."""


class _Tracer:
    """One trace: the role (score_mod's aux reads are floats, mask_mod's ints) and the aux tensors met."""

    def __init__(self, role: str, aux: dict):
        self.role, self.aux = role, aux

    def aux_name(self, tensor) -> str:
        for name, value in self.aux.items():
            if value is tensor:
                return name
        name = f"captured{sum(n.startswith('captured') for n in self.aux)}"
        self.aux[name] = tensor
        return name

    def read(self, name: str, index) -> "Traced":
        indices = index if isinstance(index, tuple) else (index,)
        dtype = Type.FLOAT if self.role == "score_mod" else Type.INT
        return Traced(Aux(name, tuple(self.expr(i) for i in indices), dtype), self)

    def expr(self, x) -> Expr:
        if isinstance(x, Traced):
            return x.expr
        if isinstance(x, (bool, numbers.Number)):
            return _constant(x)
        if hasattr(x, "item") and getattr(x, "ndim", None) == 0:   # a 0-d tensor or array: its number
            return _constant(x.item())
        raise TraceError(f"{self.role}: can't use a {type(x).__name__} in a traced expression (numbers, the "
                         "traced arguments and indexed aux tensors only)")


def _constant(x) -> Expr:
    if isinstance(x, bool):   # the DSL has no literal for a condition: `0 == 0` is true
        return apply("eq" if x else "ne", Const(0), Const(0))
    return Const(x)


# torch function name -> (op, arity) of mods.expr.OPS
_TORCH = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul", "div": "div",
          "true_divide": "div", "floor_divide": "floordiv", "remainder": "mod", "neg": "neg", "negative": "neg",
          "abs": "abs", "tanh": "tanh", "exp": "exp", "log": "log", "sqrt": "sqrt", "sigmoid": "sigmoid",
          "floor": "floor", "ceil": "ceil", "minimum": "min", "maximum": "max", "where": "where",
          "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "less": "lt", "less_equal": "le",
          "greater": "gt", "greater_equal": "ge", "logical_and": "and", "logical_or": "or", "logical_not": "not",
          "bitwise_and": "and", "bitwise_or": "or", "bitwise_not": "not"}
_DUNDER = {"__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub", "__mul__": "mul",
           "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div", "__floordiv__": "floordiv",
           "__rfloordiv__": "floordiv", "__mod__": "mod", "__rmod__": "mod", "__lt__": "lt", "__le__": "le",
           "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne", "__and__": "and", "__rand__": "and",
           "__or__": "or", "__ror__": "or", "__neg__": "neg", "__invert__": "not", "__abs__": "abs"}


class Traced:
    """A symbolic value: an expression tree, with Python's operators and torch's functions building more."""

    __slots__ = ("expr", "tracer")

    def __init__(self, expr: Expr, tracer: _Tracer):
        self.expr, self.tracer = expr, tracer

    def _op(self, op: str, *others, reverse: bool = False) -> "Traced":
        args = [self.expr] + [self.tracer.expr(o) for o in others]
        if reverse:
            args.reverse()
        try:
            return Traced(apply(op, *args), self.tracer)
        except ExprTypeError as err:
            raise TraceError(f"{self.tracer.role}: {err} (in {source(err.node)})") from None

    # arithmetic and comparisons
    def __add__(self, o): return self._op("add", o)
    def __radd__(self, o): return self._op("add", o, reverse=True)
    def __sub__(self, o): return self._op("sub", o)
    def __rsub__(self, o): return self._op("sub", o, reverse=True)
    def __mul__(self, o): return self._op("mul", o)
    def __rmul__(self, o): return self._op("mul", o, reverse=True)
    def __truediv__(self, o): return self._op("div", o)
    def __rtruediv__(self, o): return self._op("div", o, reverse=True)
    def __floordiv__(self, o): return self._op("floordiv", o)
    def __rfloordiv__(self, o): return self._op("floordiv", o, reverse=True)
    def __mod__(self, o): return self._op("mod", o)
    def __rmod__(self, o): return self._op("mod", o, reverse=True)
    def __neg__(self): return self._op("neg")
    def __abs__(self): return self._op("abs")
    def __lt__(self, o): return self._op("lt", o)
    def __le__(self, o): return self._op("le", o)
    def __gt__(self, o): return self._op("gt", o)
    def __ge__(self, o): return self._op("ge", o)
    def __eq__(self, o): return self._op("eq", o)   # noqa: the comparison is traced, not decided
    def __ne__(self, o): return self._op("ne", o)
    def __and__(self, o): return self._op("and", o)
    def __rand__(self, o): return self._op("and", o, reverse=True)
    def __or__(self, o): return self._op("or", o)
    def __ror__(self, o): return self._op("or", o, reverse=True)
    def __invert__(self): return self._op("not")
    __hash__ = None

    # methods of torch tensors a callable may use on its arguments
    def tanh(self): return self._op("tanh")
    def exp(self): return self._op("exp")
    def log(self): return self._op("log")
    def sqrt(self): return self._op("sqrt")
    def sigmoid(self): return self._op("sigmoid")
    def abs(self): return self._op("abs")
    def floor(self): return self._op("floor")
    def ceil(self): return self._op("ceil")
    def long(self): return self._op("int") if self.expr.type is Type.FLOAT else self
    int = long

    def float(self):
        return self if self.expr.type is Type.FLOAT else self._op("add", 0.0)

    def clamp(self, min=None, max=None):   # noqa: A002 - torch's names
        out = self
        if min is not None:
            out = out._op("max", min)
        if max is not None:
            out = out._op("min", max)
        return out

    def __bool__(self):
        raise TraceError(f"{self.tracer.role}: a Python `if`, `and`, `or`, `not`, min() or max() needs the value of "
                         f"{source(self.expr)}, which is only known per score on the GPU: write torch.where(c, a, b), "
                         "&, |, ~, torch.minimum or torch.maximum")

    def __index__(self):
        raise TraceError(f"{self.tracer.role}: {source(self.expr)} indexes an array the tracer can't see: index a "
                         "captured torch tensor, or take the tensor as a parameter named like its aux entry")

    def __float__(self):
        raise TraceError(f"{self.tracer.role}: float() / math.* of a traced value ({source(self.expr)}): use the "
                         "tensor methods or torch functions (.tanh(), torch.exp(...))")

    __int__ = __float__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = next(a.tracer for a in _flat(args) if isinstance(a, Traced))
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":   # a captured tensor indexed by traced values
            tensor, index = args
            return tracer.read(tracer.aux_name(tensor), index)
        if name in ("clamp", "clip"):
            lo, hi = (list(args[1:]) + [kwargs.get("min"), kwargs.get("max")])[:2]
            return Traced(tracer.expr(args[0]), tracer).clamp(lo, hi)
        op = _DUNDER.get(name) or _TORCH.get(name)
        if op is None:
            raise TraceError(f"{tracer.role}: torch.{name} is not one of the traced functions (see tiledsl.mods.trace)")
        operands = list(args)
        if name.startswith("__r") and name not in ("__rshift__",):
            operands.reverse()
        try:
            return Traced(apply(op, *(tracer.expr(a) for a in operands)), tracer)
        except ExprTypeError as err:
            raise TraceError(f"{tracer.role}: {err} (in {source(err.node)})") from None


def _flat(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        else:
            yield a


class _AuxArgument:
    """An aux tensor taken as a parameter: indexing it reads the aux tensor of that name."""

    def __init__(self, name: str, tracer: _Tracer):
        self.name, self.tracer = name, tracer

    def __getitem__(self, index):
        return self.tracer.read(self.name, index)


def trace(fn, role: str, aux: dict | None = None, differentiable: bool = False) -> tuple[Expr, dict]:
    """(the expression tree of `fn` as the spec's `role` ("score_mod" | "mask_mod"), the aux dict with any
    captured tensors added). The tree keeps mods/validate.py's rules (`differentiable`: a gradient in
    score); a TraceError otherwise, naming the callable and showing the tree as DSL text."""
    aux = dict(aux or {})
    tracer = _Tracer(role, aux)
    standard = SCORE_ARGS if role == "score_mod" else MASK_ARGS
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if len(params) < len(standard):
        raise TraceError(f"{role}: {_name(fn)} takes {len(params)} positional arguments; a {role} takes "
                         f"({', '.join(standard)}) and then aux tensors by name")
    extra = [p.name for p in params[len(standard):]]
    for name in extra:
        if name not in aux:
            raise TraceError(f"{role}: {_name(fn)}'s parameter {name!r} names no aux tensor; pass aux={{{name!r}: "
                             "tensor}")
    args = [Traced(Var(n), tracer) for n in standard] + [_AuxArgument(n, tracer) for n in extra]
    result = fn(*args)
    expr = tracer.expr(result)
    try:
        validate_expression(expr, role, differentiable)
    except ExprRuleError as err:
        raise TraceError(f"{role} {_name(fn)} traces to `{source(expr)}`: {err}") from None
    return expr, aux


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
