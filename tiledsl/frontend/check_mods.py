"""The score and mask modifications of an attention block (mods/model.py), from its settings:

    softcap   = 30                                 a finite number > 0; `via ex2 | fma | split | tanh_approx`
                                                   says how tanh runs (mods/softcap.py)
    alibi     = geometric | slopes
    sinks     = per_head
    dropout   = 0.1                                in (0, 1)
    score_mod = score + bias[h, q_idx - kv_idx]    a number over score, b, h, q_idx, kv_idx, q_len, kv_len
    mask_mod  = kv_idx <= q_idx | kv_idx == 0      a condition over the same names, score excepted
    mask      = causal & document                  the spec's mask (none | causal | window) joined by `&`
                                                   with document | document(bounds), prefix(N),
                                                   blocks(q = N, kv = M)

frontend/check.py calls `modified_mask` (does `mask = ...` use a modification's term?) and
`problem_fields` (the Problem fields they set: `mods`, and the mask's own when it has terms). Every
error points at the text at fault: an unknown name (with the nearest known one), an operand of the
wrong type, an aux tensor read with two ranks, an expression without a gradient in a spec that has a
backward (mods/validate.py holds the rules a traced Python callable keeps too).
"""
from __future__ import annotations

import math
from typing import Any

from ..mods.expr import FUNCTIONS, OPS, VARIABLES, Aux, Const, ExprTypeError, Type, Var, apply
from ..mods.model import BUILTIN_AUX, PREFIX_ALONE, AlibiSlopes, Documents, Modifications
from ..mods.softcap import TanhVia
from ..mods.validate import ExprRuleError, validate_expression
from ..spec import Mask
from ..hw import MMA_ROWS
from . import syntax as ast
from .words import EXAMPLES, did_you_mean

MASK_TERMS = ("document", "prefix", "blocks")      # what `mask = X & ...` adds to none | causal | window


def modified_mask(value) -> bool:
    """Whether `mask = value` has a modification's term, joins terms with an operator or calls with a
    positional argument (`window(256)`: answered here, in the terms' words)."""
    if isinstance(value, (ast.Operation, ast.FunctionCall)):
        return True
    name = value.name if isinstance(value, (ast.Call, ast.FunctionCall)) else value
    # an unknown word too: its error names every term
    return isinstance(name, ast.Word) and name.text not in {m.value for m in Mask}


def problem_fields(checker, nodes: dict) -> dict:
    """The Problem fields the block's modifications set ({} when it has none): `mods`, and `mask` /
    `window_*` when `mask = ...` has a modification's term."""
    fields: dict[str, Any] = {}
    mods: dict[str, Any] = {}
    if "mask" in nodes and modified_mask(nodes["mask"].value):
        fields.update(_mask(checker, nodes["mask"].value, mods))
    if "softcap" in nodes:
        atom = checker.setting_number(nodes["softcap"])
        if not math.isfinite(atom.value) or atom.value <= 0:
            checker.fail(f"softcap must be a finite number > 0, got {atom.source()}", atom.span, EXAMPLES["softcap"])
        mods["softcap"] = float(atom.value)
        if nodes["softcap"].via is not None:
            mods["softcap_via"] = checker.word(nodes["softcap"].via, "softcap via", {v.value: v for v in TanhVia})
    if "alibi" in nodes:
        mods["alibi"] = checker.word(checker.setting_word(nodes["alibi"]), "alibi", {a.value: a for a in AlibiSlopes})
    if "sinks" in nodes:
        checker.word(checker.setting_word(nodes["sinks"]), "sinks", {"per_head": True})
        mods["sinks"] = True
    if "dropout" in nodes:
        atom = checker.setting_number(nodes["dropout"])
        if not 0 < atom.value < 1:
            checker.fail(f"dropout is a probability in (0, 1), got {atom.source()}", atom.span,
                         "leave it out for no dropout")
        mods["dropout"] = float(atom.value)
    roles: dict[str, str] = {}   # aux name -> the expression that reads it
    for role in sorted((r for r in ("score_mod", "mask_mod") if r in nodes), key=lambda r: nodes[r].span.line):
        mods[role] = _Expression(checker, role, roles).check(nodes[role].value, "backward" in nodes)
    if mods:
        fields["mods"] = Modifications(**mods)
    return fields


# ---- mask = base & term & ... -------------------------------------------------------------------

def _terms(checker, value) -> list:
    if isinstance(value, ast.Operation):
        if value.op != "and":
            checker.fail(f"a mask joins its terms with `&`, not `{OPS[value.op].spelling}`", value.span,
                         "a condition of your own is mask_mod: " + EXAMPLES["mask_mod"])
        return _terms(checker, value.operands[0]) + _terms(checker, value.operands[1])
    return [value]


def _mask(checker, value, mods: dict) -> dict:
    fields: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    for term in _terms(checker, value):
        name = term.name if isinstance(term, (ast.Call, ast.FunctionCall)) else term
        if not isinstance(name, ast.Word):
            checker.fail(f"a mask term is a name, got {term.source()!r}", term.span, EXAMPLES["mask"])
        kind = name.text if name.text in MASK_TERMS else "base"
        if kind == "base" and name.text not in {m.value for m in Mask}:
            known = tuple(m.value for m in Mask) + MASK_TERMS
            checker.fail(f"unknown mask {name.text!r}{did_you_mean(name.text, known)}", name.span,
                         "mask is one of: " + ", ".join(known) + ", joined by &")
        if kind in seen:
            checker.fail(f"mask {'base ' if kind == 'base' else ''}term {name.text!r} given twice in one mask "
                         f"(with {seen[kind].source()!r})", term.span, "write each term once")
        seen[kind] = term
        if kind == "base":
            if isinstance(term, ast.FunctionCall):
                checker.fail(f"mask '{name.text}' takes named sizes", term.span, EXAMPLES["mask"])
            fields.update(checker.mask(term))
            if fields["mask"] is Mask.NONE:
                checker.fail("`none` adds nothing to a mask joined by &", term.span, "remove `none &`")
        elif kind == "document":
            mods["document"] = _document(checker, term)
        elif kind == "prefix":
            mods["prefix"] = _one_integer(checker, term, "prefix", "length", lambda v: v >= 1, "an integer >= 1",
                                          "mask = prefix(256)   (the first 256 keys are visible to every query)")
        else:
            mods["blocks"] = _blocks(checker, term)
    if "prefix" in seen and fields.get("mask", Mask.NONE) is not Mask.NONE:
        checker.fail(PREFIX_ALONE, seen["base"].span, "write `mask = prefix(N)` (causal included)")
    return fields


def _arguments(checker, term, what: str) -> tuple[list, dict]:
    """(positional, named) arguments of a term's call."""
    if not isinstance(term, (ast.Call, ast.FunctionCall)):
        return [], {}
    positional, named = [], {}
    for arg in term.args:
        if isinstance(arg, ast.Arg):
            if arg.name.text in named:
                checker.fail(f"{what} argument '{arg.name.text}' given twice", arg.name.span, EXAMPLES["mask"])
            named[arg.name.text] = arg
        else:
            positional.append(arg)
    return positional, named


def _document(checker, term) -> Documents:
    positional, named = _arguments(checker, term, "document")
    if named or len(positional) > 1:
        checker.fail("document takes one word: document(ids) or document(bounds)", term.span,
                     "write `mask = document` (document_ids) or `mask = document(bounds)` (document_bounds)")
    if not positional:
        return Documents.IDS
    return checker.word(positional[0], "document source", {d.value: d for d in Documents})


def _one_integer(checker, term, what: str, name: str, ok, rule: str, example: str) -> int:
    positional, named = _arguments(checker, term, what)
    if set(named) - {name} or len(positional) + len(named) != 1:
        checker.fail(f"{what} takes one size: {what}(N) or {what}({name} = N)", term.span, example)
    atom = positional[0] if positional else named[name].value
    return _integer(checker, atom, what, ok, rule, example)


def _integer(checker, atom, what: str, ok, rule: str, example: str) -> int:
    if not isinstance(atom, ast.Number) or not isinstance(atom.value, int) or not ok(atom.value):
        checker.fail(f"{what} must be {rule}, got {atom.source()}", atom.span, example)
    return atom.value


def _blocks(checker, term) -> tuple[int, int]:
    positional, named = _arguments(checker, term, "blocks")
    example = "mask = blocks(q = 128, kv = 128)   (block_mask[b, h, q block, kv block] != 0 is computed)"
    if set(named) - {"q", "kv"} or (positional and named) or len(positional) > 1 or not (positional or named):
        checker.fail("blocks takes its block sizes: blocks(q = N, kv = M), or blocks(N) for both", term.span, example)

    def size(atom):
        return _integer(checker, atom, "a block size", lambda v: v > 0 and v % MMA_ROWS == 0,
                        f"a positive multiple of {MMA_ROWS}", example)
    if positional:
        return size(positional[0]), size(positional[0])
    if set(named) != {"q", "kv"}:
        checker.fail("blocks needs both sizes, q and kv", term.span, example)
    return size(named["q"].value), size(named["kv"].value)


# ---- score_mod / mask_mod --------------------------------------------------------------------------

class _Expression:
    """Syntax tree -> mods.expr tree, with the span of each node for the errors of later rules."""

    def __init__(self, checker, role: str, roles: dict):
        self.checker, self.role, self.roles = checker, role, roles
        self.spans: dict[int, Any] = {}
        self.keep: list = []          # the nodes whose ids key `spans` stay alive while it is read
        self.ranks: dict[str, tuple[int, Any]] = {}

    def fail(self, message: str, span, hint: str = ""):
        self.checker.fail(message, span, hint or EXAMPLES[self.role])

    def check(self, node, differentiable: bool):
        expr = self.convert(node)
        try:
            validate_expression(expr, self.role, differentiable)
        except ExprRuleError as err:
            self.fail(str(err), self.spans.get(id(err.node), node.span))
        return expr

    def made(self, expr, node):
        self.spans.setdefault(id(expr), node.span)
        self.keep.append(expr)
        return expr

    def apply(self, op: str, args: list, node):
        try:
            return self.made(apply(op, *args), node)
        except ExprTypeError as err:
            self.fail(str(err), self.spans.get(id(err.node), node.span))

    def convert(self, node):
        if isinstance(node, ast.Number):
            if not math.isfinite(node.value):
                self.fail(f"{node.source()} is not a finite number", node.span)
            return self.made(Const(node.value), node)
        if isinstance(node, ast.Word):
            return self.made(self.name(node), node)
        if isinstance(node, ast.Operation):
            return self.apply(node.op, [self.convert(x) for x in node.operands], node)
        if isinstance(node, ast.Subscript):
            return self.subscript(node)
        if isinstance(node, (ast.FunctionCall, ast.Call)):
            return self.call(node)
        self.fail(f"{node.source()!r} is not an expression", node.span)

    def name(self, word: ast.Word):
        if word.text in VARIABLES:
            return Var(word.text)
        if word.text in FUNCTIONS:
            self.fail(f"'{word.text}' is a function: write {word.text}(...)", word.span)
        names = ", ".join(n for n in VARIABLES if self.role == "score_mod" or n != "score")
        self.fail(f"unknown name {word.text!r}{did_you_mean(word.text, VARIABLES)}", word.span,
                  f"names: {names}; an aux tensor is read with indices, {word.text}[...]")

    def subscript(self, node: ast.Subscript):
        name = node.tensor.text
        if name in VARIABLES or name in FUNCTIONS:
            self.fail(f"'{name}' is not a tensor: only aux tensors are read with [...]", node.tensor.span)
        if name in BUILTIN_AUX:
            self.fail(f"'{name}' is the tensor of a built-in modification; name your aux tensor otherwise",
                      node.tensor.span)
        first = self.roles.setdefault(name, self.role)
        if first != self.role:
            self.fail(f"aux tensor '{name}' is read by {first} (as {_element(first)}) and {self.role} (as "
                      f"{_element(self.role)}); a tensor serves one of them", node.tensor.span)
        rank, span = self.ranks.setdefault(name, (len(node.indices), node.span))
        if rank != len(node.indices):
            self.fail(f"'{name}' is read with {len(node.indices)} indices here and {rank} at column {span.column}",
                      node.span, "an aux tensor has one number of dimensions")
        indices = tuple(self.convert(i) for i in node.indices)
        return self.made(Aux(name, indices, Type.FLOAT if self.role == "score_mod" else Type.INT), node)

    def call(self, node):
        name = node.name.text
        if name not in FUNCTIONS:
            self.fail(f"unknown function {name!r}{did_you_mean(name, FUNCTIONS)}", node.name.span,
                      "functions: " + ", ".join(FUNCTIONS))
        for arg in node.args:
            if isinstance(arg, ast.Arg):
                self.fail(f"{name}(...) takes positional arguments, got {arg.source()!r}", arg.span)
        op = FUNCTIONS[name]
        if len(node.args) != OPS[op].arity:
            self.fail(f"{name} takes {OPS[op].arity} argument{'s' if OPS[op].arity > 1 else ''}, got "
                      f"{len(node.args)}", node.span)
        return self.apply(op, [self.convert(a) for a in node.args], node)


def _element(role: str) -> str:
    return "floats" if role == "score_mod" else "ints"

