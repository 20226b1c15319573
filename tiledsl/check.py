"""Syntax tree -> KernelSpec (or SpecSpace for a block with `in {...}` choices).

Two kinds of check, in this order:
  1. each written value on its own (types, ranges, names), at the value's span; a bad option
     inside `in {...}` is an error too, since no config could use it;
  2. the rules between values (family features, warps vs tile), then the kernel's layout
     (layout.layout_of: the shapes its template needs, shared memory, registers, threads; the
     lowering calls the same function), run on a whole KernelSpec by `validate`. For a space they run per config and turn into rejections; a space
     with no legal config is an error.
Defaults are those of spec.Schedule, except a few that depend on the family (see `_schedule`).
"""
from __future__ import annotations

import difflib
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from . import ast
from . import check_backward
from .errors import SpecError
from .layout import FP8_CONVERTS, backward_has_template, backward_layout, layout_of
from .spec import (AUTO, COMPUTE_DTYPES, KV_DTYPES, KV_PAGE_SIZES, PROBLEM_KEYS, SCHEDULE_KEYS, Axis, CopyVia, DType, Family,
                   KernelSpec, KvScale, LoopOrder, Mask, Mma, Problem, Schedule, SeqLayout, Span)

EXAMPLES = {
    "head_dim": "head_dim = 128", "head_dim_v": "head_dim_v = 64", "dtype": "dtype = bf16",
    "mask": "mask = causal   (none | causal | window(left = 256, right = 0))",
    "scale": "scale = 0.125", "queries": "queries = 1",
    "kv_cache": "kv_cache = paged(page = 16)   (or: contiguous, the default)",
    "layout": "layout = varlen   (or: batched, the default)",
    "kv_dtype": "kv_dtype = e4m3   (FP8 KV cache, decode only; default: the spec's dtype)",
    "kv_scale": "kv_scale = per_head   (or: per_tensor; with kv_dtype = e4m3)",
    "order": "order q, kv   (or: kv, q)", "tile": "tile q = 128, kv = 64", "warps": "warps 4 along q",
    "pipeline": "pipeline 2 stages via cp.async", "warpgroups": "warpgroups producer 1 regs 24, consumer 2 regs 240",
    "overlap": "overlap pingpong, intra", "split": "split kv = 8   (or: kv = auto)",
    "mma": "mma wgmma   (or: mma.sync, the default)",
    "dequant": "dequant fragments   (or: shared, the default; with kv_dtype = e4m3)",
    "schedule": "schedule {", "attention": "attention NAME {",
    "backward": "backward {", "dq": "dq accumulate atomic   (or: separate, ordered)",
}
WARP_COUNTS = (1, 2, 4, 8, 16)
MMA_ROWS = 16                   # mma.sync m16n8k16: a warp's share of a tile is a multiple of 16 rows
MAX_SPACE_CONFIGS = 10_000      # a search space's size limit (each config is checked, then maybe compiled)
WGMMA_ROWS = 64                 # each Hopper consumer warpgroup's wgmma covers 64 rows of Q
SM_REGISTERS = 65536
WARPGROUP_THREADS = 128
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_AXES = {"q": Axis.Q, "kv": Axis.KV}
_ORDERS = {("q", "kv"): LoopOrder.Q_OUTER, ("kv", "q"): LoopOrder.KV_OUTER}


def did_you_mean(word: str, candidates) -> str:
    """"; did you mean 'tile'?" for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


# ---- spaces -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecSpace:
    """An attention block with `in {...}` choices: the cartesian product of its options.

    `fixed` holds the schedule fields written with one value, `choices` each chosen field's
    options (values as in spec.Schedule: ints, enums, AUTO). A config is a dict from the chosen
    field names to one option each."""
    name: str
    problem: Problem
    fixed: tuple[tuple[str, Any], ...]
    choices: tuple[tuple[str, tuple], ...]
    source_file: str = field(default="<string>", compare=False)
    source_text: str = field(default="", compare=False, repr=False)
    spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)
    span: Span | None = field(default=None, compare=False, repr=False)
    backward: bool = False        # the block has `backward { }` (its fields: "backward.<field>")

    @property
    def size(self) -> int:
        return math.prod(len(options) for _, options in self.choices)

    def configs(self) -> list[dict]:
        names = [name for name, _ in self.choices]
        return [dict(zip(names, combo)) for combo in itertools.product(*(o for _, o in self.choices))]

    def spec(self, config: dict) -> KernelSpec:
        """The KernelSpec of one config; a SpecError when the config is illegal."""
        forward, backward = check_backward.split_config({**dict(self.fixed), **config})
        spec = KernelSpec(self.name, self.problem, _schedule(self.problem, forward),
                          self.source_file, self.source_text, self.spans, self.span,
                          check_backward.backward_schedule(backward) if self.backward else None)
        validate(spec)
        return spec

    def expand(self) -> tuple[list[KernelSpec], list[tuple[dict, str]]]:
        """(legal specs, [(config, reason)] for the illegal ones), in product order."""
        legal, rejected = [], []
        for config in self.configs():
            try:
                legal.append(self.spec(config))
            except SpecError as err:
                rejected.append((config, err.message))
        return legal, rejected


# ---- the checker --------------------------------------------------------------------------------

class _Checker:
    def __init__(self, text: str):
        self.text = text

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
                    if isinstance(statement, ast.UnknownStatement) or statement.key.text not in check_backward.BACKWARD_KEYS:
                        check_backward.unknown_statement(self, statement.key, PROBLEM_KEYS, did_you_mean)
                    add(check_backward.PREFIX + statement.key.text, statement.key.span, statement)
            else:
                if item.key.text not in PROBLEM_KEYS:
                    self.unknown(item.key, in_schedule=False)
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
            return space.spec({})
        if space.size > MAX_SPACE_CONFIGS:   # refused before expanding: 10^6 configs took minutes
            sizes = " x ".join(f"{len(options)} {name}" for name, options in space.choices)
            self.fail(f"the space '{att.name.text}' has {space.size:,} configs ({sizes}); at most "
                      f"{MAX_SPACE_CONFIGS:,} are accepted", att.name.span, "drop options from the `in {...}` choices")
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
            fields["dtype"] = self.word(self.setting_word(nodes["dtype"]), "dtype", {d.value: d for d in COMPUTE_DTYPES})
        if "mask" in nodes:
            fields.update(self.mask(nodes["mask"].value))
        if "scale" in nodes:
            atom = self.setting_number(nodes["scale"])
            if not isinstance(atom.value, (int, float)) or not math.isfinite(atom.value) or atom.value <= 0:
                self.fail(f"scale must be a finite number > 0, got {atom.source()}", atom.span,
                          "leave it out for the default 1/sqrt(head_dim)")
            fields["softmax_scale"] = float(atom.value)
        if "queries" in nodes:
            fields["queries_per_seq"] = self.integer(self.setting_number(nodes["queries"]), "queries",
                                                     lambda v: 1 <= v <= 16, "an integer in 1..16")
        if "kv_cache" in nodes:
            fields["kv_page_size"] = self.kv_cache(nodes["kv_cache"].value)
        if "layout" in nodes:
            fields["seq_layout"] = self.word(self.setting_word(nodes["layout"]), "layout",
                                             {layout.value: layout for layout in SeqLayout})
        fields.update(self.kv_storage(nodes, fields.get("dtype", DType.BF16)))
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
            sizes[side] = self.integer(arg.value, f"window {side}", lambda v: v >= 0, "an integer >= 0")
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
            self.fail("paged(...) takes one argument, page", value.args[1].span, "write e.g. `kv_cache = paged(page = 16)`")
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
                a, f"tile {d.axis.text}", lambda v: v > 0 and v % MMA_ROWS == 0, "a positive multiple of 16"))
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
        return {"mma": self.values(node.instruction, lambda a: self.word(a, "mma instruction", {m.value: m for m in Mma}))}

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

    def split(self, node: ast.Split) -> dict:
        if node.dim.axis.text != "kv":
            self.fail(f"split-KV splits the kv axis, got '{node.dim.axis.text}'", node.dim.axis.span, EXAMPLES["split"])

        def count(atom):
            if isinstance(atom, ast.Word) and atom.text == AUTO:
                return AUTO
            return self.integer(atom, "split kv", lambda v: v >= 1, "an integer >= 1 or auto")
        return {"split_kv": self.values(node.dim.value, count)}


# ---- defaults that depend on the family ----------------------------------------------------------

def _schedule(problem: Problem, written: dict) -> Schedule:
    """The Schedule of written values plus defaults. spec.Schedule's defaults hold, except:
    decode splits warps along kv and tiles q by 16 (its few query rows fill one MMA tile); hopper
    copies with TMA, has warps = 4 per warpgroup, producer 1 regs 24, consumer 2 with the most regs
    that fit the register file."""
    values = dict(written)
    if "producer_warpgroups" in values or "consumer_warpgroups" in values:
        producers = values.setdefault("producer_warpgroups", 1)
        consumers = values.setdefault("consumer_warpgroups", 2)
        producer_regs = values.setdefault("producer_regs", 24)
        fit = (SM_REGISTERS // WARPGROUP_THREADS - producer_regs * producers) // consumers // 8 * 8
        values.setdefault("consumer_regs", min(256, fit))
        values.setdefault("copy", CopyVia.TMA)
        values.setdefault("mma", Mma.WGMMA)   # the family's only instruction
        values.setdefault("warps", 4 * (producers + consumers))
    elif problem.queries_per_seq is not None:
        values.setdefault("warp_axis", Axis.KV)
        values.setdefault("tile_q", MMA_ROWS)
    return Schedule(**values)


# ---- rules between values: each returns (key, message, hint) for a spec that breaks it ------------

def _rule_family_features(spec: KernelSpec, written: set):
    s, p, fam = spec.schedule, spec.problem, spec.family
    if fam is Family.HOPPER and p.queries_per_seq is not None:
        return ("queries", "queries (decode) and warpgroups (hopper) exclude each other: the hopper family has no "
                "decode path", "remove `warpgroups` for a decode kernel, or `queries` for a hopper kernel")
    if p.seq_layout is SeqLayout.VARLEN and fam is Family.DECODE:
        return ("layout", "layout = varlen packs sequences of any length; `queries = N` (decode) fixes every "
                "sequence's queries", "remove `queries` for varlen prefill, or `layout` for decode")
    if p.kv_dtype is not None and fam is not Family.DECODE:
        return ("kv_dtype", f"kv_dtype = {p.kv_dtype.value} (an FP8 KV cache) is only for the decode family; this "
                f"kernel is {fam.value}", "add `queries = N` (decode), or remove `kv_dtype`")
    if s.fp8_convert is not None and p.kv_dtype is None:
        return ("dequant", "`dequant` says where an FP8 KV cache becomes 16-bit; this kernel reads a "
                f"{p.dtype.value} cache", "add `kv_dtype = e4m3` (decode), or remove `dequant`")
    if p.kv_dtype is not None and p.dtype not in (DType.FP16, DType.BF16):
        return ("kv_dtype", f"an FP8 KV cache is dequantized to fp16 or bf16 on chip; dtype is {p.dtype.value}",
                "write `dtype = bf16` or `dtype = fp16`")
    if s.split_kv != 1 and fam is not Family.DECODE:
        return ("split", f"split kv = {s.split_kv} is only for the decode family; this kernel is {fam.value}",
                "split-KV needs `queries = N` (decode); for prefill remove `split`")
    if s.order is LoopOrder.KV_OUTER and fam in (Family.HOPPER, Family.DECODE):
        return ("order", f"the {fam.value} family runs q outer; `order kv, q` is FA1", "write `order q, kv`")
    if fam is Family.FA2 and s.warp_axis is Axis.KV:
        return ("warps", "q-outer (FA2) splits warps along q; warps along kv is FA1's split-K: write `order kv, q`",
                "or write `warps N along q`")
    if fam is Family.DECODE and s.warp_axis is Axis.Q:
        return ("warps", "the decode family splits warps along kv: its few query rows can't be shared out",
                "write `warps N along kv` (the default for decode)")
    if s.copy is CopyVia.TMA and fam is not Family.HOPPER:
        return ("pipeline", f"TMA copies need the hopper family; {fam.value} copies with cp.async",
                "write `via cp.async`, or add `warpgroups producer 1, consumer 2` for a Hopper kernel")
    if s.copy is not CopyVia.TMA and fam is Family.HOPPER:
        return ("pipeline", f"the hopper family copies with TMA, not {s.copy.value}", "write `via tma`")
    if s.mma is Mma.WGMMA and fam not in (Family.FA2, Family.HOPPER):
        return ("mma", f"`mma wgmma` is built for the fa2 and hopper families; this kernel is {fam.value}",
                "remove `mma` (fa1 and decode use mma.sync)")
    if s.mma is not Mma.WGMMA and fam is Family.HOPPER:
        return ("mma", f"the hopper family runs on wgmma, not {s.mma.value}", "remove `mma` or write `mma wgmma`")
    if (s.pingpong or s.intra_overlap) and fam is not Family.HOPPER:
        return ("overlap", f"overlap needs warp specialization (the hopper family); {fam.value} has no warpgroups",
                "add `warpgroups producer 1, consumer 2`, or remove `overlap`")
    return None


def _rule_hopper(spec: KernelSpec, written: set):
    s = spec.schedule
    if spec.family is not Family.HOPPER:
        return None
    if "warps" in written:
        return ("warps", "the hopper family gets its warps from `warpgroups` (4 warps each)", "remove `warps`")
    if s.producer_warpgroups != 1 or not 1 <= s.consumer_warpgroups <= 3:
        return ("warpgroups", "hopper needs producer 1 and consumer 1..3 warpgroups", EXAMPLES["warpgroups"])
    total = (s.producer_regs * s.producer_warpgroups + s.consumer_regs * s.consumer_warpgroups) * WARPGROUP_THREADS
    if total > SM_REGISTERS:
        fit = (SM_REGISTERS // WARPGROUP_THREADS - s.producer_regs) // s.consumer_warpgroups // 8 * 8
        return ("warpgroups", f"warpgroups need ({s.producer_regs} + {s.consumer_warpgroups} x {s.consumer_regs}) x "
                f"{WARPGROUP_THREADS} = {total} registers; an SM has {SM_REGISTERS}", f"use consumer regs <= {fit}")
    rows = WGMMA_ROWS * s.consumer_warpgroups
    if s.tile_q % rows:   # point at what was written: the tile, else the warpgroups that need it
        return ("tile" if "tile" in written else "warpgroups",
                f"tile q = {s.tile_q} is not a multiple of {WGMMA_ROWS} x {s.consumer_warpgroups} consumer "
                f"warpgroups = {rows} (each consumer's wgmma covers {WGMMA_ROWS} rows)", f"use tile q = {rows}")
    if s.pingpong and s.consumer_warpgroups < 2:
        return ("overlap", "pingpong alternates two consumer warpgroups; this kernel has 1",
                "use `consumer 2`, or drop pingpong")
    return None


def _rule_wgmma(spec: KernelSpec, written: set):
    """fa2 on wgmma: whole warpgroups of 4 warps, 64 query rows each; 64-column panels."""
    s, p = spec.schedule, spec.problem
    if spec.family is not Family.FA2 or s.mma is not Mma.WGMMA:
        return None
    if s.warps % 4 or s.tile_q != s.warps // 4 * WGMMA_ROWS:
        fit = max(4, s.tile_q // WGMMA_ROWS * 4)
        return ("warps" if "warps" in written else "tile" if "tile" in written else "mma",
                f"wgmma runs whole warpgroups (4 warps), each owning {WGMMA_ROWS} query rows: {s.warps} warps and "
                f"tile q = {s.tile_q} do not match", f"use warps {fit} with tile q = {fit // 4 * WGMMA_ROWS}")
    if p.head_dim_qk % 64 or p.head_dim_v % 64:
        return ("head_dim" if p.head_dim_qk % 64 else "head_dim_v", f"wgmma reads 64-column panels: head dims must be multiples of 64, got "
                f"{p.head_dim_qk}/{p.head_dim_v}", "use mma.sync for other head dims")
    if s.tile_kv > 256:
        return ("tile", f"wgmma's n is at most 256: tile kv = {s.tile_kv}", "use tile kv <= 256")
    threads, chunks = s.warps * 32, max(p.head_dim_qk, p.head_dim_v) // 8
    if threads % chunks or (threads // chunks) % 8:
        return ("head_dim", f"{threads} threads copy whole groups of 8 rows of a {chunks * 8}-wide tile per pass only "
                f"for head dims 64 and 128 (4 warps) or 64, 128 and 256 (8+ warps)", "use mma.sync for this head dim")
    return None


def _rule_warps_fit(spec: KernelSpec, written: set):
    s = spec.schedule
    if spec.family is Family.HOPPER:
        return None
    tile = s.tile_q if s.warp_axis is Axis.Q else s.tile_kv
    if tile % (MMA_ROWS * s.warps):
        default = "" if "warps" in written else " (the default)"
        fits = [w for w in WARP_COUNTS if tile % (MMA_ROWS * w) == 0]
        return ("warps" if "warps" in written else "tile",
                f"{s.warps} warps{default} along {s.warp_axis.value} give each warp {tile / s.warps:g} of "
                f"tile {s.warp_axis.value} = {tile}'s rows; a warp needs a multiple of {MMA_ROWS}",
                f"use warps {fits[-1]}, or tile {s.warp_axis.value} = {MMA_ROWS * s.warps}")
    return None


_RULES = (_rule_family_features, _rule_hopper, _rule_wgmma, _rule_warps_fit, check_backward.rule_backward)


def validate(spec: KernelSpec) -> None:
    """Raise SpecError for the first rule between values that `spec` breaks, then for what its
    kernel's layout refuses (shapes and resources: the same function lowering calls)."""
    written = {key for key, _ in spec.spans}
    for rule in _RULES:
        broken = rule(spec, written)
        if broken:
            key, message, hint = broken
            raise SpecError(message, spec.span_of(key), spec.source_text, hint)
    layout_of(spec)
    if spec.backward is not None and not backward_has_template(spec):   # what the backward template can't fit
        backward_layout(spec)


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
