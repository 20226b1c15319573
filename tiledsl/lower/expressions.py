"""A score_mod / mask_mod tree (mods/expr.py) spelled in CUDA C, with mods/numeric.py's meaning in 32 bits.

Two spellings of one tree, both pasted by templates/macros.j2's expression_functions into device functions
emitted once per kernel:

* `cuda(expr)`: the value at one (query, key). Ints are int32 (mods/checks.py refuses launches whose ints
  could leave it), floats float32. `//` floors and `%` takes the divisor's sign (Python's, not C's),
  `int()` truncates, `/` divides as floats, min / max propagate NaN (NumPy's minimum / maximum), sigmoid is
  numeric.py's 0.5 (1 + tanh(x / 2)). An aux read `name[i, j]` loads `aux.t_name[i * s0 + j * s1]` from
  the kernel's parameters (a pointer and strides per tensor, expression_parameters).
* `box(expr)`: mods/intervals.py's rules over a box of indices (b, h single values, q_idx and kv_idx
  ranges) as CUDA statements: whether the mask can be false and can be true there, for the kernel's tile
  classes (an empty tile is not loaded, a full one pays no per-element test). Only what is cheap and exact
  on ints is spelled: sums, differences, products, negation, abs, min, max, `//` and `%` by a positive
  constant, where, comparisons and the logic ops. Anything else (floats, aux reads) is "unknown", which
  makes the comparisons over it "either": a partial tile, tested per element, so the classes stay sound.
  The box is clamped into the launch's ranges, where the checks bound every int in int32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..mods.expr import ONE, OPS, Apply, Aux, Const, Expr, Type, Var, depends_on_score, derivative, reads, source
from ..mods.intervals import INT32
from ..mods.model import Modifications
from .plan import Constant, Parameter

# The C names of the variables inside the device functions (their parameters).
VARIABLE_NAMES = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx", "q_len": "q_len",
                  "kv_len": "kv_len"}
AUX_FIELD = "t_"          # ExprAux's field of tensor `name`: t_name, its strides t_name_s0, t_name_s1, ...
AUX_PARAMETER = "aux_"    # the kernel parameters: aux_name, aux_name_stride0, ...
C_TYPE = {Type.INT: "int", Type.FLOAT: "float"}


def float_literal(value: float) -> str:
    """A float32 literal of `value` (infinities and NaN by their bits: no math.h under NVRTC)."""
    if math.isnan(value):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(value):
        return "__int_as_float(0x7f800000)" if value > 0 else "(-__int_as_float(0x7f800000))"
    return f"{value!r}f" if ("e" in repr(value) or "." in repr(value)) else f"{value!r}.0f"


def int_literal(value: int) -> str:
    if not INT32[0] <= value <= INT32[1]:
        raise ValueError(f"the constant {value} does not fit in the kernel's int32")
    return f"({value})" if value < 0 else str(value)   # -2147483648 is spelled as (-2147483648): an int, not a long


def _as_float(text: str, kind: Type) -> str:
    return text if kind is Type.FLOAT else f"(float)({text})"


def cuda(expr: Expr) -> str:
    """The tree as one CUDA C expression of VARIABLE_NAMES and `aux` (an ExprAux)."""
    if isinstance(expr, Const):
        if expr.type is Type.BOOL:
            return "true" if expr.value else "false"
        return float_literal(expr.value) if expr.type is Type.FLOAT else int_literal(expr.value)
    if isinstance(expr, Var):
        return VARIABLE_NAMES[expr.name]
    if isinstance(expr, Aux):
        offset = " + ".join(f"({cuda(i)}) * aux.{AUX_FIELD}{expr.name}_s{axis}" for axis, i in enumerate(expr.indices))
        return f"__ldg(aux.{AUX_FIELD}{expr.name} + ({offset or '0'}))"
    return _apply(expr)


def _apply(expr: Apply) -> str:
    op, args, kind = expr.op, expr.args, expr.type
    text = [cuda(a) for a in args]
    kinds = [a.type for a in args]
    rule = OPS[op].rule
    if op in ("and", "or"):
        return f"({text[0]} {'&&' if op == 'and' else '||'} {text[1]})"
    if op == "not":
        return f"(!{text[0]})"
    if op == "where":
        if kind is Type.FLOAT:
            return f"({text[0]} ? {_as_float(text[1], kinds[1])} : {_as_float(text[2], kinds[2])})"
        return f"({text[0]} ? {text[1]} : {text[2]})"
    if rule == "compare":
        if Type.FLOAT in kinds:   # int against float: as floats, as NumPy compares an int64 with a float64
            text = [_as_float(t, k) for t, k in zip(text, kinds)]
        return f"({text[0]} {OPS[op].spelling} {text[1]})"
    if op == "neg":
        return f"(-{text[0]})"
    if op in ("add", "sub", "mul"):
        if kind is Type.FLOAT:
            text = [_as_float(t, k) for t, k in zip(text, kinds)]
        return f"({text[0]} {OPS[op].spelling} {text[1]})"
    if op == "div":
        return f"({_as_float(text[0], kinds[0])} / {_as_float(text[1], kinds[1])})"
    if op == "floordiv":
        return f"py_floordiv({text[0]}, {text[1]})"
    if op == "mod":
        return f"py_mod({text[0]}, {text[1]})"
    if op == "abs":
        return f"fabsf({text[0]})" if kind is Type.FLOAT else f"abs({text[0]})"
    if op in ("min", "max"):
        if kind is Type.FLOAT:
            return f"py_{op}f({_as_float(text[0], kinds[0])}, {_as_float(text[1], kinds[1])})"
        return f"{op}({text[0]}, {text[1]})"
    if op == "log":   # MUFU's lg2 (relative error 2^-22): logf's full-range path costs the consumer's registers
        return f"__logf({_as_float(text[0], kinds[0])})"
    if op in ("tanh", "exp", "sqrt", "floor", "ceil"):
        return f"{op}f({_as_float(text[0], kinds[0])})"
    if op == "sigmoid":
        return f"py_sigmoid({_as_float(text[0], kinds[0])})"
    if op == "int":   # toward zero; an int stays itself
        return f"(int)({text[0]})" if kinds[0] is Type.FLOAT else text[0]
    raise AssertionError(f"cuda: no spelling for {op}")   # every op of OPS has one above


# ---- the tile box ----------------------------------------------------------------------------------------

UNKNOWN = None   # a number whose interval is not spelled: any comparison over it is "either"


@dataclass
class Box:
    """CUDA statements that compute a tree's interval over the box (box_variables) and its answer: (lo, hi)
    strings of an int node, (can_false, can_true) strings of a condition, UNKNOWN for a number not spelled."""
    lines: list[str] = field(default_factory=list)
    count: int = 0

    def temp(self, ctype: str, value: str) -> str:
        name = f"i{self.count}"
        self.count += 1
        self.lines.append(f"const {ctype} {name} = {value};")
        return name

    def pair(self, ctype: str, lo: str, hi: str) -> tuple[str, str]:
        return self.temp(ctype, lo), self.temp(ctype, hi)


# the box's variables: (lo, hi) of each index (b, h, q_len and kv_len take one value in a work item)
BOX_VARIABLES = {"b": ("b", "b"), "h": ("h", "h"), "q_idx": ("q_lo", "q_hi"), "kv_idx": ("kv_lo", "kv_hi"),
                 "q_len": ("q_len", "q_len"), "kv_len": ("kv_len", "kv_len")}
EITHER = ("true", "true")


def box(expr: Expr) -> tuple[list[str], tuple[str, str]]:
    """(statements, (can_false, can_true)) of the condition `expr` over the box."""
    out = Box()
    answer = _box(expr, out)
    return out.lines, answer


def _box(expr: Expr, out: Box):
    if reads(expr, Aux) or expr.type is Type.FLOAT:
        return EITHER if expr.type is Type.BOOL else UNKNOWN
    if isinstance(expr, Const):
        if expr.type is Type.BOOL:
            return ("false", "true") if expr.value else ("true", "false")
        return (int_literal(expr.value),) * 2
    if isinstance(expr, Var):
        return BOX_VARIABLES[expr.name]
    op, args = expr.op, expr.args
    if expr.type is Type.BOOL:
        return _box_condition(op, args, out)
    return _box_int(op, args, out)


def _box_condition(op: str, args: tuple, out: Box):
    a = [_box(x, out) for x in args]
    if op == "or":
        return out.pair("bool", f"{a[0][0]} && {a[1][0]}", f"{a[0][1]} || {a[1][1]}")
    if op == "and":
        return out.pair("bool", f"{a[0][0]} || {a[1][0]}", f"{a[0][1]} && {a[1][1]}")
    if op == "not":
        return a[0][1], a[0][0]
    if op == "where":
        (c_false, c_true), x, y = a
        return out.pair("bool", f"{c_false} ? ({c_true} ? {x[0]} || {y[0]} : {y[0]}) : {x[0]}",
                        f"{c_false} ? ({c_true} ? {x[1]} || {y[1]} : {y[1]}) : {x[1]}")
    if args[0].type is Type.BOOL:   # bool == bool, bool != bool: compared as 0 / 1
        a = [(f"({f} ? 0 : 1)", f"({t} ? 1 : 0)") for f, t in a]
    if UNKNOWN in a:
        return EITHER
    (alo, ahi), (blo, bhi) = a
    # mods/intervals._compare, spelled
    can = {"lt": (f"!({ahi} < {blo})", f"{alo} < {bhi}"), "le": (f"!({ahi} <= {blo})", f"{alo} <= {bhi}"),
           "gt": (f"!({alo} > {bhi})", f"{ahi} > {blo}"), "ge": (f"!({alo} >= {bhi})", f"{ahi} >= {blo}")}
    if op in can:
        return out.pair("bool", *can[op])
    # a side of one value (b, h, a constant) compares with itself only in the text: its term is left out
    same = [f"{x} == {y}" for x, y in ((alo, ahi), (ahi, blo), (blo, bhi)) if x != y]
    always = out.temp("bool", " && ".join(same) or "true")
    never = out.temp("bool", f"{ahi} < {blo} || {bhi} < {alo}")
    return (f"!{always}", f"!{never}") if op == "eq" else (f"!{never}", f"!{always}")


def _box_int(op: str, args: tuple, out: Box):
    if op in ("floordiv", "mod") and not (isinstance(args[1], Const) and args[1].value > 0):
        return UNKNOWN
    a = [_box(x, out) for x in args]
    if op == "where":
        (c_false, c_true), x, y = a
        if UNKNOWN in (x, y):
            return UNKNOWN
        return out.pair("int", f"{c_false} ? ({c_true} ? min({x[0]}, {y[0]}) : {y[0]}) : {x[0]}",
                        f"{c_false} ? ({c_true} ? max({x[1]}, {y[1]}) : {y[1]}) : {x[1]}")
    if UNKNOWN in a:
        return UNKNOWN
    x = a[0]
    if op == "neg":
        return out.pair("int", f"-{x[1]}", f"-{x[0]}")
    if op == "abs":
        return out.pair("int", f"{x[0]} >= 0 ? {x[0]} : ({x[1]} <= 0 ? -{x[1]} : 0)",
                        f"max(abs({x[0]}), abs({x[1]}))")
    if op == "int":
        return x
    y = a[1]
    if op == "add":
        return out.pair("int", f"{x[0]} + {y[0]}", f"{x[1]} + {y[1]}")
    if op == "sub":
        return out.pair("int", f"{x[0]} - {y[1]}", f"{x[1]} - {y[0]}")
    if op == "mul":
        p = [out.temp("int", f"{u} * {v}") for u in x for v in y]
        return out.pair("int", f"min(min({p[0]}, {p[1]}), min({p[2]}, {p[3]}))",
                        f"max(max({p[0]}, {p[1]}), max({p[2]}, {p[3]}))")
    if op in ("min", "max"):
        return out.pair("int", f"{op}({x[0]}, {y[0]})", f"{op}({x[1]}, {y[1]})")
    c = y[0]   # floordiv / mod by the positive constant c (mods/intervals._floordiv, _mod)
    lo, hi = out.pair("int", f"py_floordiv({x[0]}, {c})", f"py_floordiv({x[1]}, {c})")
    if op == "floordiv":
        return lo, hi
    one = out.temp("bool", f"{lo} == {hi}")
    return out.pair("int", f"{one} ? py_mod({x[0]}, {c}) : 0", f"{one} ? py_mod({x[1]}, {c}) : {c} - 1")


# ---- the kernel's share -----------------------------------------------------------------------------------

def expression_aux(mods: Modifications):
    """The aux tensors the expressions read (mods/model.AuxTensor), in the kernel's parameter order."""
    names = {a.name for e in (mods.score_mod, mods.mask_mod) if e is not None for a in reads(e, Aux)}
    return tuple(a for a in mods.aux_tensors() if a.name in names)


def expression_parameters(mods: Modifications) -> tuple[Parameter, ...]:
    """Per aux tensor an expression reads: its pointer (float32 or int32) and its strides in elements."""
    out = []
    for a in expression_aux(mods):
        out.append(Parameter(AUX_PARAMETER + a.name, f"const {C_TYPE[a.dtype]}* __restrict__"))
        out += [Parameter(f"{AUX_PARAMETER}{a.name}_stride{axis}", "int") for axis in range(a.rank)]
    return tuple(out)


def expression_constants(p) -> list[Constant]:
    """INV_SCALE (score_mod's result back into the raw units the softmax scales) and EXPR_CLAMP (whether
    the indices of a partial tile's elements outside the sequences are clamped into them: an aux read
    there would leave its tensor)."""
    mods = p.mods
    if mods.score_mod is None and mods.mask_mod is None:
        return []
    return [Constant("INV_SCALE", "float", 1.0 / p.scale, "score_mod: 1 / scale, its score back in raw units"),
            Constant("EXPR_CLAMP", "bool", bool(expression_aux(mods)),
                     "expressions read aux tensors: an element past q_len or kv_len reads at the last index")]


def expression_fields(mods: Modifications, gradient: bool = False) -> dict:
    """KernelPlan's expression fields: what macros.j2's expression_functions pastes and the hooks branch on;
    `gradient`: a backward's, with score_mod's derivative (_gradient_fields)."""
    if mods.score_mod is None and mods.mask_mod is None:
        return {}
    aux = expression_aux(mods)
    fields = [f"const {C_TYPE[a.dtype]}* __restrict__ {AUX_FIELD}{a.name}; "
              + " ".join(f"int {AUX_FIELD}{a.name}_s{axis};" for axis in range(a.rank)) for a in aux]
    values = [name.name for name in expression_parameters(mods)]
    lines, (can_false, can_true) = box(mods.mask_mod) if mods.mask_mod is not None else ([], ("false", "true"))
    return dict(expressions=True, expr_aux_fields=tuple(fields), expr_aux_value="{" + ", ".join(values) + "}",
                score_expression=cuda(mods.score_mod) if mods.score_mod is not None else "",
                score_expression_text=source(mods.score_mod) if mods.score_mod is not None else "",
                mask_expression=cuda(mods.mask_mod) if mods.mask_mod is not None else "",
                mask_expression_text=source(mods.mask_mod) if mods.mask_mod is not None else "",
                mask_box_lines=tuple(lines), mask_box_answer=(can_false, can_true),
                **(_gradient_fields(mods) if gradient else NO_GRADIENT))


NO_GRADIENT = dict(score_grad_expression="", score_grad_expression_text="", score_grad_reads_score=False)


def _gradient_fields(mods: Modifications) -> dict:
    """A backward's score_mod derivative fields (KernelPlan's score_grad_*): d score_mod / d score spelled by
    `cuda`, whether it reads the score (the kernel then keeps the scores from before score_mod); none where it is
    constant 1 (a pure bias: folded here, so dS takes no multiply). NotDifferentiable where it has none."""
    if mods.score_mod is None:
        return NO_GRADIENT
    grad = derivative(mods.score_mod)
    if grad == ONE:
        return NO_GRADIENT
    return dict(score_grad_expression=cuda(grad), score_grad_expression_text=source(grad),
                score_grad_reads_score=depends_on_score(grad))
