"""The spec language's syntax tree: frozen dataclasses, each with the Span it was parsed from.

The tree keeps what was written, not what it means: `tile q = 128` is a Tile with one Dim, and
whether `q` is an axis or 128 a legal size is the checker's business (frontend/check.py). Spans take no
part in equality, so two parses of the same text compare equal wherever they came from, and
`source()` writes a node back as spec text (parse(source(tree)) == tree: the round-trip tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from ..mods.expr import OPS
from ..spec import Span


def _span():
    # Optional so that tools (and tests) can build nodes without a source; never compared.
    return field(default=None, compare=False, repr=False)


# ---- values ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Number:
    value: int | float          # int when written without '.' or exponent
    text: str = field(compare=False)
    span: Span | None = _span()

    def source(self) -> str:
        return self.text


@dataclass(frozen=True)
class Word:
    text: str                   # a name, e.g. `bf16`, `q`, `cp.async`, `auto`
    span: Span | None = _span()

    def source(self) -> str:
        return self.text


@dataclass(frozen=True)
class Pair:
    """Two axes in loop order, `q, kv`."""
    first: Word
    second: Word
    span: Span | None = _span()

    def source(self) -> str:
        return f"{self.first.text}, {self.second.text}"


Atom = Union[Number, Word]


@dataclass(frozen=True)
class Choice:
    """A search space, `in {64, 128}`: the tuner tries each option."""
    options: tuple                # of Atom, or of Pair for `order in {(q, kv), (kv, q)}`
    span: Span | None = _span()

    def source(self) -> str:
        items = (f"({o.source()})" if isinstance(o, Pair) else o.source() for o in self.options)
        return "in {" + ", ".join(items) + "}"


Slot = Union[Number, Word, Choice]     # a schedule value: one atom or a choice of atoms


@dataclass(frozen=True)
class Arg:
    """A named argument, `left = 256` in `window(left = 256, right = 0)`."""
    name: Word
    value: Atom
    span: Span | None = _span()

    def source(self) -> str:
        return f"{self.name.text} = {self.value.source()}"


@dataclass(frozen=True)
class Call:
    name: Word
    args: tuple[Arg, ...]
    span: Span | None = _span()

    def source(self) -> str:
        return f"{self.name.text}({', '.join(a.source() for a in self.args)})"


# ---- expressions (score_mod, mask_mod, `mask = causal & document`) -------------------------------

def _operand(node, parent: int) -> str:
    """An operand's source, parenthesized where it binds looser than its operator (mods.expr.OPS)."""
    text = node.source()
    if isinstance(node, Operation) and OPS[node.op].precedence < parent:
        return f"({text})"
    if isinstance(node, Number) and text.startswith("-") and parent >= OPS["neg"].precedence:
        return f"({text})"
    return text


@dataclass(frozen=True)
class Operation:
    """`a + b`, `-a`, `~m`, `a <= b`: op is a key of mods.expr.OPS (add, neg, not, le, ...)."""
    op: str
    operands: tuple
    span: Span | None = _span()

    def source(self) -> str:
        info = OPS[self.op]
        if info.prefix:   # `~(a < b)`: the parentheses `~` doesn't need are kept for the reader
            space = " " if isinstance(self.operands[0], Number) else ""   # `- 1` negates 1; `-1` is a number
            return info.spelling + space + _operand(self.operands[0], info.precedence if self.op == "neg" else 99)
        left = info.precedence + (1 if info.rule == "compare" else 0)   # comparisons don't chain
        return f"{_operand(self.operands[0], left)} {info.spelling} {_operand(self.operands[1], info.precedence + 1)}"


@dataclass(frozen=True)
class Subscript:
    """`bias[h, q_idx - kv_idx]`: a read of an aux tensor."""
    tensor: Word
    indices: tuple
    span: Span | None = _span()

    def source(self) -> str:
        return f"{self.tensor.text}[{', '.join(i.source() for i in self.indices)}]"


@dataclass(frozen=True)
class FunctionCall:
    """`tanh(score / 30)`, `prefix(256)`: a call with a positional argument (args may also hold Args,
    which the checker refuses where a function takes none)."""
    name: Word
    args: tuple
    span: Span | None = _span()

    def source(self) -> str:
        return f"{self.name.text}({', '.join(a.source() for a in self.args)})"


Expression = Union[Number, Word, Call, Operation, Subscript, FunctionCall]


# ---- problem settings ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """`key = value` in an attention block: head_dim, dtype, mask, ..."""
    key: Word
    value: Expression              # a Number, Word or Call, or an expression (score_mod, `causal & document`)
    span: Span | None = _span()
    via: Word | None = None        # `softcap = 30 via ex2`: how the setting runs

    def source(self) -> str:
        return f"{self.key.text} = {self.value.source()}" + (f" via {self.via.text}" if self.via else "")


# ---- schedule statements: each keeps its keyword as `key` (a Word with the keyword's span) -----

def _slot(slot) -> str:
    return slot.source()


@dataclass(frozen=True)
class Dim:
    """`q = 128` or `kv in {32, 64}` in `tile` and `split`."""
    axis: Word
    value: Slot
    span: Span | None = _span()

    def source(self) -> str:
        sep = " " if isinstance(self.value, Choice) else " = "
        return f"{self.axis.text}{sep}{_slot(self.value)}"


@dataclass(frozen=True)
class Role:
    """`producer 1 regs 24` in `warpgroups`."""
    name: Word
    count: Slot
    regs: Slot | None
    span: Span | None = _span()

    def source(self) -> str:
        regs = f" regs {_slot(self.regs)}" if self.regs is not None else ""
        return f"{self.name.text} {_slot(self.count)}{regs}"


@dataclass(frozen=True)
class Order:
    key: Word
    value: Pair | Choice
    span: Span | None = _span()

    def source(self) -> str:
        return f"order {self.value.source()}"


@dataclass(frozen=True)
class Tile:
    key: Word
    dims: tuple[Dim, ...]
    span: Span | None = _span()

    def source(self) -> str:
        return "tile " + ", ".join(d.source() for d in self.dims)


@dataclass(frozen=True)
class Warps:
    key: Word
    count: Slot
    axis: Slot | None
    span: Span | None = _span()

    def source(self) -> str:
        along = f" along {_slot(self.axis)}" if self.axis is not None else ""
        return f"warps {_slot(self.count)}{along}"


@dataclass(frozen=True)
class Pipeline:
    key: Word
    stages: Slot
    copy: Slot | None
    span: Span | None = _span()

    def source(self) -> str:
        via = f" via {_slot(self.copy)}" if self.copy is not None else ""
        return f"pipeline {_slot(self.stages)} stages{via}"


@dataclass(frozen=True)
class MmaStatement:
    key: Word
    instruction: Slot
    span: Span | None = _span()

    def source(self) -> str:
        return f"mma {_slot(self.instruction)}"


@dataclass(frozen=True)
class Dequant:
    key: Word
    where: Slot
    span: Span | None = _span()

    def source(self) -> str:
        return f"dequant {_slot(self.where)}"


@dataclass(frozen=True)
class LaunchStatement:
    """`launch dynamic [order longest_first]`: how a hopper kernel's blocks take their work items."""
    key: Word
    kind: Slot
    order: Slot | None
    span: Span | None = _span()

    def source(self) -> str:
        order = f" order {_slot(self.order)}" if self.order is not None else ""
        return f"launch {_slot(self.kind)}{order}"


@dataclass(frozen=True)
class Warpgroups:
    key: Word
    roles: tuple[Role, ...]
    span: Span | None = _span()

    def source(self) -> str:
        return "warpgroups " + ", ".join(r.source() for r in self.roles)


@dataclass(frozen=True)
class Overlap:
    key: Word
    flags: tuple[Word, ...]
    span: Span | None = _span()
    choices: tuple = ()          # per flag: None, or the Choice of `on` / `off` (search spaces)

    def source(self) -> str:
        choices = self.choices or (None,) * len(self.flags)
        return "overlap " + ", ".join(f.text + (" " + c.source() if c is not None else "") for f,
                                      c in zip(self.flags, choices))


@dataclass(frozen=True)
class Split:
    key: Word
    dim: Dim
    span: Span | None = _span()

    def source(self) -> str:
        return f"split {self.dim.source()}"


@dataclass(frozen=True)
class Dq:
    """`dq accumulate atomic` in `backward { }`."""
    key: Word
    mode: Slot
    span: Span | None = _span()

    def source(self) -> str:
        return f"dq accumulate {_slot(self.mode)}"


@dataclass(frozen=True)
class UnknownStatement:
    """A schedule statement whose first word is no keyword; the checker names the nearest one.
    Only the key is kept: nothing after it can be trusted."""
    key: Word
    span: Span | None = _span()

    def source(self) -> str:
        return self.key.text


Statement = Union[Order, Tile, Warps, Pipeline, MmaStatement, Warpgroups, Overlap, Split, Dequant, LaunchStatement, Dq,
                  UnknownStatement]


# ---- blocks -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScheduleBlock:
    statements: tuple            # of Statement, in source order
    span: Span | None = _span()

    def source(self, indent: str = "    ") -> str:
        body = "".join(f"{indent}    {s.source()}\n" for s in self.statements)
        return f"schedule {{\n{body}{indent}}}"


@dataclass(frozen=True)
class BackwardBlock:
    """`backward { ... }`: the backward pass's schedule, beside the forward's."""
    statements: tuple            # of Statement, in source order
    span: Span | None = _span()

    def source(self, indent: str = "    ") -> str:
        body = "".join(f"{indent}    {s.source()}\n" for s in self.statements)
        return f"backward {{\n{body}{indent}}}"


@dataclass(frozen=True)
class Attention:
    name: Word
    items: tuple                 # Setting, ScheduleBlock and BackwardBlock, in source order
    span: Span | None = _span()

    def source(self) -> str:
        body = "".join(f"    {item.source()}\n" for item in self.items)
        return f"attention {self.name.text} {{\n{body}}}\n"


@dataclass(frozen=True)
class Module:
    """One spec file: its attention blocks in source order."""
    attentions: tuple[Attention, ...]
    file: str = field(default="<string>", compare=False)
    span: Span | None = _span()   # None for a file with no blocks

    def source(self) -> str:
        return "\n".join(a.source() for a in self.attentions)
