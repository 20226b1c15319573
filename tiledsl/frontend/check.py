"""Syntax tree -> KernelSpec (or SpecSpace for a block with `in {...}` choices).

Two kinds of check, in this order:
  1. each written value on its own (types, ranges, names), at the value's span; a bad option
     inside `in {...}` is an error too, since no config could use it;
  2. the rules between values (family features, warps vs tile), then the kernel's layout
     (families.layout_of: the shapes its template needs, shared memory, registers, threads; the
     lowering reads the same function), run on a whole KernelSpec by `validate`. For a space they
     run per config and turn into rejections; a space with no legal config is an error.
Defaults are those of spec.Schedule, except a few that depend on the family (see `schedule_with_defaults`)."""
from __future__ import annotations

import math
import re
from typing import Any, NoReturn

from ..errors import SpecError
from ..hw import MMA_ROWS
from ..layout.decode import FP8_CONVERTS
from ..spec import (
    AUTO,
    COMPUTE_DTYPES,
    KV_DTYPES,
    KV_PAGE_SIZES,
    OUT_DTYPES,
    MAX_SPLIT_KV,
    MAX_TILE,
    MAX_WINDOW,
    PROBLEM_KEYS,
    SCALE_RANGE,
    SCHEDULE_KEYS,
    VIA_KEYS,
    Axis,
    CopyVia,
    Descale,
    DType,
    ItemOrder,
    KernelSpec,
    KvScale,
    LaunchKind,
    LoopOrder,
    Mask,
    Mma,
    Problem,
    SeqLayout,
    Span,
)
from . import check_backward, check_mods
from . import syntax as ast
from .rules import WARP_COUNTS
from .space import SpecSpace
from .words import EXAMPLES, did_you_mean

# Configs across a file (a concrete block is one, a space its size): each is checked, then maybe compiled,
# explained or ranked, so the limit counts every block's, not each space's alone.
MAX_CONFIGS = 10_000

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_AXES = {"q": Axis.Q, "kv": Axis.KV}

_ORDERS = {("q", "kv"): LoopOrder.Q_OUTER, ("kv", "q"): LoopOrder.KV_OUTER}


class _Checker:
    def __init__(self, text: str):
        self.text = text
        self.configs = 0   # configs of the blocks checked so far (MAX_CONFIGS)

    def fail(self, message: str, span: Span | None, hint: str = "") -> NoReturn:
        raise SpecError(message, span, self.text, hint)

    # -- single values --
    def options(self, slot) -> tuple:
        """The atoms of a slot: one, or each option of a choice (repeats are an error)."""
        if not isinstance(slot, ast.Choice):
            return (slot,)
        seen: dict = {}
        for option in slot.options:
            if option in seen:
                self.fail(f"{option.source()!r} appears twice in this choice", option.span,
                          f"first at column {seen[option].column}")
            seen[option] = option.span
        return slot.options

    def integer(self, atom, what: str, ok, rule: str) -> int:
        if not isinstance(atom, ast.Number) or not isinstance(atom.value, int) or not ok(atom.value):
            first = what.split()[0]   # "tile q" -> tile: the statement whose example helps
            key = {"window": "mask", "producer": "warpgroups", "consumer": "warpgroups"}.get(first, first)
            self.fail(f"{what} must be {rule}, got {atom.source()}", atom.span, f"e.g. {EXAMPLES.get(key)}")
        return atom.value

    def word(self, atom, what: str, table: dict):
        names = ", ".join(table)
        if not isinstance(atom, ast.Word) or atom.text not in table:
            suggestion = did_you_mean(atom.text, table) if isinstance(atom, ast.Word) else ""
            self.fail(f"unknown {what} {atom.source()!r}{suggestion}", atom.span, f"{what} is one of: {names}")
        return table[atom.text]

    def values(self, slot, convert) -> tuple[tuple, bool]:
        return tuple(convert(a) for a in self.options(slot)), isinstance(slot, ast.Choice)

    # -- blocks --
    def attention(self, att: ast.Attention, file: str) -> KernelSpec | SpecSpace:
        if not _IDENTIFIER.fullmatch(att.name.text):
            self.fail(f"kernel name {att.name.text!r} is not an identifier", att.name.span,
                      "use letters, digits and '_' (it names files and CUDA symbols)")
        entries: list[tuple[str, Any]] = []       # (key, node) for every setting and statement
        seen: dict[str, Span] = {}

        def add(key: str, key_span: Span, node) -> None:
            if key in seen:
                inner = key.startswith(check_backward.PREFIX)
                shown = f"'{key.removeprefix(check_backward.PREFIX)}'" + (" in backward" if inner else "")
                self.fail(f"duplicate key {shown} (first set on line {seen[key].line})", key_span,
                          "write each key once per attention block")
            seen[key] = key_span
            entries.append((key, node))

        for item in att.items:
            if isinstance(item, ast.ScheduleBlock):
                start = item.span   # the duplicate-block error underlines the word `schedule`
                add("schedule", Span(start.file, start.line, start.column, start.line, start.column + 8), item)
                for statement in item.statements:
                    if isinstance(statement, ast.UnknownStatement):
                        self.unknown(statement.key, in_schedule=True)
                    add(statement.key.text, statement.key.span, statement)
            elif isinstance(item, ast.BackwardBlock):
                start = item.span
                add("backward", Span(start.file, start.line, start.column, start.line, start.column + 8), item)
                for statement in item.statements:
                    if isinstance(statement,
                                  ast.UnknownStatement) or statement.key.text not in check_backward.BACKWARD_KEYS:
                        check_backward.unknown_statement(self, statement.key, PROBLEM_KEYS, did_you_mean)
                    add(check_backward.PREFIX + statement.key.text, statement.key.span, statement)
            else:
                if item.key.text not in PROBLEM_KEYS:
                    self.unknown(item.key, in_schedule=False)
                if item.via is not None and item.key.text not in VIA_KEYS:
                    self.fail(f"'{item.key.text}' takes no `via`; only {', '.join(VIA_KEYS)} says how it runs",
                              item.via.span, f"write `{item.key.text} = {item.value.source()}`")
                add(item.key.text, item.key.span, item)
        nodes = dict(entries)
        if "head_dim" not in nodes:
            self.fail(f"kernel '{att.name.text}' has no head_dim", att.name.span, "add e.g. `head_dim = 128`")
        problem = self.problem(nodes)
        fixed, choices = {}, {}
        for key in SCHEDULE_KEYS:
            if key in nodes:
                for name, (vals, is_choice) in getattr(self, key)(nodes[key]).items():
                    if is_choice:
                        choices[name] = vals
                    else:
                        fixed[name] = vals[0]
        for key, node in entries:
            if key.startswith(check_backward.PREFIX):
                for name, (vals, is_choice) in check_backward.statement_fields(self, node).items():
                    (choices if is_choice else fixed)[check_backward.PREFIX + name] = vals if is_choice else vals[0]
        spans = tuple((key, node.span) for key, node in entries if key != "schedule")
        space = SpecSpace(att.name.text, problem, tuple(fixed.items()), tuple(choices.items()), file, self.text,
                          spans, att.span, "backward" in nodes)
        if not choices:
            self.configs += 1
            return space.spec({})
        if space.size > MAX_CONFIGS - self.configs:   # refused before expanding: 10^6 configs took minutes
            sizes = " x ".join(f"{len(options)} {name}" for name, options in space.choices)
            before = f" after the file's {self.configs:,} before it" if self.configs else ""
            self.fail(f"the space '{att.name.text}' has {space.size:,} configs ({sizes}){before}; at most "
                      f"{MAX_CONFIGS:,} are accepted in a file", att.name.span,
                      "drop options from the `in {...}` choices, or split the file")
        self.configs += space.size
        legal, rejected = space.expand()
        if not legal:
            self.no_legal_config(space, rejected)
        return space

    def unknown(self, key: ast.Word, in_schedule: bool) -> NoReturn:
        word = key.text
        if in_schedule and word in PROBLEM_KEYS:
            self.fail(f"'{word}' is a problem setting; write it before `schedule {{`", key.span, EXAMPLES[word])
        if word == "dq":
            self.fail("'dq' is a backward statement; put it inside `backward { ... }`", key.span,
                      EXAMPLES["dq"])
        if not in_schedule and word in SCHEDULE_KEYS:
            self.fail(f"'{word}' is a schedule statement; put it inside `schedule {{ ... }}`", key.span,
                      EXAMPLES[word])
        keys = SCHEDULE_KEYS if in_schedule else PROBLEM_KEYS
        where = "schedule statements" if in_schedule else "settings"
        self.fail(f"unknown key '{word}'{did_you_mean(word, keys)}", key.span, f"{where}: " + ", ".join(keys))

    def no_legal_config(self, space: SpecSpace, rejected) -> NoReturn:
        reasons = list(dict.fromkeys(reason for _, reason in rejected))
        if len(reasons) == 1:
            try:
                space.spec(rejected[0][0])
            except SpecError as err:   # one reason for all: show it where it was written
                raise SpecError(f"{err.message} (in all {space.size} configs of space '{space.name}')",
                                err.span, self.text, err.hint) from None
        self.fail(f"none of the {space.size} configs of space '{space.name}' is legal", space.span,
                  "reasons: " + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))

    # -- problem settings: each returns its Problem fields --
    def problem(self, nodes: dict) -> Problem:
        def head_dim(key: str) -> int:
            return self.integer(self.setting_number(nodes[key]), key, lambda v: 8 <= v <= 256 and v % 8 == 0,
                                "a multiple of 8 in 8..256")
        fields: dict[str, Any] = {"head_dim_qk": head_dim("head_dim")}
        fields["head_dim_v"] = head_dim("head_dim_v") if "head_dim_v" in nodes else fields["head_dim_qk"]
        if "dtype" in nodes:
            fields["dtype"] = self.word(self.setting_word(nodes["dtype"]), "dtype",
                                        {d.value: d for d in COMPUTE_DTYPES})
        if "mask" in nodes and not check_mods.modified_mask(nodes["mask"].value):
            fields.update(self.mask(nodes["mask"].value))
        if "scale" in nodes:
            atom = self.setting_number(nodes["scale"])
            low, high = SCALE_RANGE
            try:
                value = float(atom.value)
            except OverflowError:   # an integer of more digits than a float holds
                value = math.inf
            if not math.isfinite(value) or value <= 0:
                self.fail(f"scale must be a finite number > 0, got {atom.source()}", atom.span,
                          "leave it out for the default 1/sqrt(head_dim)")
            if not low <= value <= high:
                self.fail(f"scale must lie in {low:g}..{high:g} (the kernel holds it as a float), got "
                          f"{atom.source()}", atom.span, "leave it out for the default 1/sqrt(head_dim)")
            fields["softmax_scale"] = value
        if "queries" in nodes:
            fields["queries_per_seq"] = self.integer(self.setting_number(nodes["queries"]), "queries",
                                                     lambda v: 1 <= v <= 16, "an integer in 1..16")
        if "kv_cache" in nodes:
            fields["kv_page_size"] = self.kv_cache(nodes["kv_cache"].value)
        if "layout" in nodes:
            fields["seq_layout"] = self.word(self.setting_word(nodes["layout"]), "layout",
                                             {layout.value: layout for layout in SeqLayout})
        fields.update(self.kv_storage(nodes, fields.get("dtype", DType.BF16)))
        fields.update(self.fp8_inputs(nodes, fields.get("dtype", DType.BF16)))
        fields.update(check_mods.problem_fields(self, nodes))   # score and mask modifications
        return Problem(**fields)

    def kv_storage(self, nodes: dict, dtype: DType) -> dict:
        """`kv_dtype = e4m3` (FP8 K/V, dequantized on chip) and `kv_scale = per_head | per_tensor`.
        Spelling the spec's own dtype is the default: no field is set, so the name and hash stay."""
        fields: dict[str, Any] = {}
        if "kv_dtype" in nodes:
            word = self.setting_word(nodes["kv_dtype"])
            kv = self.word(word, "kv_dtype", {d.value: d for d in (dtype,) + KV_DTYPES})
            if kv is not dtype:
                fields["kv_dtype"] = kv
        if "kv_scale" in nodes:
            word = self.setting_word(nodes["kv_scale"])
            scale = self.word(word, "kv_scale", {k.value: k for k in KvScale})
            if "kv_dtype" not in fields:
                self.fail("kv_scale scales an FP8 KV cache; this spec stores K/V in its dtype", word.span,
                          "add `kv_dtype = e4m3`, or remove `kv_scale`")
            fields["kv_scale"] = scale
        elif "kv_dtype" in fields:
            fields["kv_scale"] = KvScale.PER_HEAD
        return fields

    def fp8_inputs(self, nodes: dict, dtype: DType) -> dict:
        """`out_dtype = bf16 | fp16` and `descale = per_tensor | per_head | per_block`, the output and the scales
        of FP8 attention (dtype = e4m3). The defaults (bf16, per_head) set no field: name and hash stay."""
        fields: dict[str, Any] = {}
        for key, table, default in (("out_dtype", {d.value: d for d in OUT_DTYPES}, DType.BF16),
                                    ("descale", {d.value: d for d in Descale}, Descale.PER_HEAD)):
            if key not in nodes:
                continue
            word = self.setting_word(nodes[key])
            value = self.word(word, key, table)
            if dtype is not DType.E4M3:
                what = "the output type" if key == "out_dtype" else "the descales' granularity"
                self.fail(f"{key} is {what} of FP8 attention; this spec's inputs are {dtype.value}", word.span,
                          f"add `dtype = e4m3` (the hopper family), or remove `{key}`")
            if value is not default:
                fields[key] = value
        return fields

    def setting_number(self, setting: ast.Setting) -> ast.Number:
        if not isinstance(setting.value, ast.Number):
            self.fail(f"{setting.key.text} takes a number, got {setting.value.source()!r}", setting.value.span,
                      EXAMPLES[setting.key.text])
        return setting.value

    def setting_word(self, setting: ast.Setting) -> ast.Word:
        if not isinstance(setting.value, ast.Word):
            self.fail(f"{setting.key.text} takes a name, got {setting.value.source()!r}", setting.value.span,
                      EXAMPLES[setting.key.text])
        return setting.value

    def mask(self, value) -> dict:
        masks = {m.value: m for m in Mask}
        if isinstance(value, ast.Number):
            self.fail(f"mask takes a name, got {value.source()}", value.span, EXAMPLES["mask"])
        name = value.name if isinstance(value, ast.Call) else value
        mask = self.word(name, "mask", masks)
        if mask is not Mask.WINDOW:
            if isinstance(value, ast.Call):
                self.fail(f"mask '{name.text}' takes no arguments; only window(...) has sizes", value.span,
                          f"write `mask = {name.text}`, or `mask = window(left = 256, right = 0)`")
            return {"mask": mask}
        if not isinstance(value, ast.Call) or not value.args:
            self.fail("a window mask needs its sizes", value.span, "write e.g. `mask = window(left = 256, right = 0)`")
        sizes: dict[str, int] = {}
        for arg in value.args:
            side = self.word(arg.name, "window size", {"left": "left", "right": "right"})
            if side in sizes:
                self.fail(f"window size '{side}' given twice", arg.name.span, "write left and right once each")
            sizes[side] = self.integer(arg.value, f"window {side}", lambda v: 0 <= v <= MAX_WINDOW,
                                       f"an integer in 0..{MAX_WINDOW:,} (2^30)")
        return {"mask": mask, "window_left": sizes.get("left", 0), "window_right": sizes.get("right", 0)}

    def kv_cache(self, value) -> int | None:
        """`contiguous` (None) or `paged(page = N)`: N keys per page, a power of two in 1..256, so a
        key's page and slot are a shift and a mask, and a kv tile (a multiple of 16 keys) holds
        whole pages or lies inside one."""
        if isinstance(value, ast.Number):
            self.fail(f"kv_cache takes a name, got {value.source()}", value.span, EXAMPLES["kv_cache"])
        name = value.name if isinstance(value, ast.Call) else value
        kind = self.word(name, "kv_cache", {"contiguous": "contiguous", "paged": "paged"})
        if kind == "contiguous":
            if isinstance(value, ast.Call):
                self.fail("kv_cache 'contiguous' takes no arguments; only paged(...) has a page size", value.span,
                          "write `kv_cache = contiguous`, or `kv_cache = paged(page = 16)`")
            return None
        if not isinstance(value, ast.Call) or not value.args:
            self.fail("a paged kv_cache needs its page size", value.span, "write e.g. `kv_cache = paged(page = 16)`")
        if len(value.args) > 1:
            self.fail("paged(...) takes one argument, page", value.args[1].span,
                      "write e.g. `kv_cache = paged(page = 16)`")
        self.word(value.args[0].name, "paged argument", {"page": "page"})
        return self.integer(value.args[0].value, "kv_cache page size",
                            lambda v: v in KV_PAGE_SIZES, "a power of two in 1..256")

    # -- schedule statements: each returns {Schedule field: (values, is_choice)} --
    def order(self, node: ast.Order) -> dict:
        def loop_order(pair: ast.Pair) -> LoopOrder:
            key = (pair.first.text, pair.second.text)
            if key not in _ORDERS:
                self.fail(f"order must be `q, kv` (FA2) or `kv, q` (FA1), got `{pair.source()}`", pair.span,
                          "the outer loop comes first")
            return _ORDERS[key]
        return {"order": self.values(node.value, loop_order)}

    def tile(self, node: ast.Tile) -> dict:
        out: dict = {}
        for dim in node.dims:
            axis = self.word(dim.axis, "tile axis", _AXES)
            name = f"tile_{axis.value}"
            if name in out:
                self.fail(f"tile {axis.value} given twice", dim.axis.span, EXAMPLES["tile"])
            out[name] = self.values(dim.value, lambda a, d=dim: self.integer(
                a, f"tile {d.axis.text}", lambda v: 0 < v <= MAX_TILE and v % MMA_ROWS == 0,
                f"a positive multiple of {MMA_ROWS} up to {MAX_TILE}"))
        return out

    def warps(self, node: ast.Warps) -> dict:
        out = {"warps": self.values(node.count, lambda a: self.integer(
            a, "warps", lambda v: v in WARP_COUNTS, "one of 1, 2, 4, 8, 16"))}
        if node.axis is not None:
            out["warp_axis"] = self.values(node.axis, lambda a: self.word(a, "warp axis", _AXES))
        return out

    def pipeline(self, node: ast.Pipeline) -> dict:
        out = {"stages": self.values(node.stages, lambda a: self.integer(
            a, "pipeline stages", lambda v: 1 <= v <= 4, "an integer in 1..4"))}
        if node.copy is not None:
            out["copy"] = self.values(node.copy, lambda a: self.word(a, "copy", {c.value: c for c in CopyVia}))
        return out

    def mma(self, node: ast.MmaStatement) -> dict:
        return {"mma": self.values(node.instruction,
                                   lambda a: self.word(a, "mma instruction", {m.value: m for m in Mma}))}

    def warpgroups(self, node: ast.Warpgroups) -> dict:
        limits = {"producer": (lambda v: v == 1, "1"), "consumer": (lambda v: 1 <= v <= 3, "1, 2 or 3")}
        out: dict = {}
        for role in node.roles:
            name = self.word(role.name, "warpgroup role", {"producer": "producer", "consumer": "consumer"})
            if f"{name}_warpgroups" in out:
                self.fail(f"warpgroup role '{name}' given twice", role.name.span, EXAMPLES["warpgroups"])
            ok, rule = limits[name]
            out[f"{name}_warpgroups"] = self.values(role.count, lambda a, n=name: self.integer(
                a, f"{n} warpgroups", ok, rule))
            if role.regs is not None:
                out[f"{name}_regs"] = self.values(role.regs, lambda a, n=name: self.integer(
                    a, f"{n} regs", lambda v: 24 <= v <= 256 and v % 8 == 0, "a multiple of 8 in 24..256 (setmaxnreg)"))
        return out

    def overlap(self, node: ast.Overlap) -> dict:
        flags = {"pingpong": "pingpong", "intra": "intra_overlap"}
        out: dict = {}
        for flag, choice in zip(node.flags, node.choices or (None,) * len(node.flags)):
            name = self.word(flag, "overlap", flags)
            if name in out:
                self.fail(f"overlap '{flag.text}' given twice", flag.span, EXAMPLES["overlap"])
            # `intra in {on, off}`: a search space tries both
            out[name] = self.values(choice, lambda a: self.word(a, "overlap switch", {"on": True, "off": False})) \
                if choice is not None else ((True,), False)
        return out

    def dequant(self, node: ast.Dequant) -> dict:
        return {"fp8_convert": self.values(node.where, lambda a: self.word(a, "dequant", {c: c for c in FP8_CONVERTS}))}

    def launch(self, node: ast.LaunchStatement) -> dict:
        out = {"launch": self.values(node.kind, lambda a: self.word(a, "launch", {k.value: k for k in LaunchKind}))}
        if node.order is not None:
            out["item_order"] = self.values(node.order, lambda a: self.word(a, "launch order",
                                                                             {o.value: o for o in ItemOrder}))
        return out

    def split(self, node: ast.Split) -> dict:
        if node.dim.axis.text != "kv":
            self.fail(f"split-KV splits the kv axis, got '{node.dim.axis.text}'", node.dim.axis.span, EXAMPLES["split"])

        def count(atom):
            if isinstance(atom, ast.Word) and atom.text == AUTO:
                return AUTO
            return self.integer(atom, "split kv", lambda v: 1 <= v <= MAX_SPLIT_KV,
                                f"an integer in 1..{MAX_SPLIT_KV} or auto")
        return {"split_kv": self.values(node.dim.value, count)}


def check_module(module: ast.Module, text: str) -> list[KernelSpec | SpecSpace]:
    """One KernelSpec or SpecSpace per attention block, in source order."""
    checker, first_line, out = _Checker(text), {}, []
    for att in module.attentions:
        name = att.name.text
        if name in first_line:
            checker.fail(f"duplicate kernel name '{name}' (first defined on line {first_line[name]})", att.name.span,
                         "give each attention block its own name")
        first_line[name] = att.name.span.line
        out.append(checker.attention(att, module.file))
    return out
