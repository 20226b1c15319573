"""Spec text -> syntax tree (frontend/syntax.py), and the front end's entry points.

The grammar lives in grammar.lark (LALR, positions on). A Lark parse error becomes a SpecError
that says, in words, what was expected after which token (`expected '=' after 'head_dim'`),
with a caret under the offending text and, where the statement is known, an example of it.

Entry points: parse_text / parse_file (one KernelSpec or SpecSpace per attention block) and
load_specs (concrete kernels only: spaces expanded to their legal configs).
"""
from __future__ import annotations

import functools
import os
import re
import unicodedata

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import syntax as ast
from ..mods.expr import INFIX
from .words import EXAMPLES, did_you_mean
from ..spec import PROBLEM_KEYS, SCHEDULE_KEYS
from .space import SpecSpace
from .check import check_module
from ..errors import SpecError
from ..spec import BACKWARD_KEYS, KernelSpec, Span


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark.open("grammar.lark", rel_to=__file__, parser="lalr", propagate_positions=True,
                     maybe_placeholders=True)


# ---- tree -> ast --------------------------------------------------------------------------------

_INTEGER = re.compile(r"[+-]?[0-9]+")


def _number_value(text: str) -> int | float:
    try:
        return int(text) if _INTEGER.fullmatch(text) else float(text)
    except ValueError:        # more digits than Python converts: out of every range anyway
        return float("inf")


@v_args(meta=True)
class _ToAst(Transformer):
    """Builds ast nodes; `file` goes into every Span."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _span(self, meta) -> Span:
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, tok: Token) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column)

    def _word(self, tok: Token) -> ast.Word:
        return ast.Word(str(tok), self._tok(tok))

    def _key(self, meta, keyword: str) -> ast.Word:
        # The keyword itself is filtered out of the tree; it starts the statement.
        return ast.Word(keyword, Span(self.file, meta.line, meta.column, meta.line, meta.column + len(keyword)))

    def number(self, meta, children):
        tok = children[0]
        return ast.Number(_number_value(str(tok)), str(tok), self._tok(tok))

    def word(self, meta, children):
        return self._word(children[0])

    def choice(self, meta, children):
        return ast.Choice(tuple(children), self._span(meta))

    pair_choice = choice

    def pair(self, meta, children):
        return ast.Pair(self._word(children[0]), self._word(children[1]), self._span(meta))

    def arg(self, meta, children):
        return ast.Arg(self._word(children[0]), children[1], self._span(meta))

    def call(self, meta, children):
        args = tuple(a for a in children[1:] if a is not None)
        if all(isinstance(a, ast.Arg) for a in args):   # `window(left = 256)`: a setting's call
            return ast.Call(self._word(children[0]), args, self._span(meta))
        return ast.FunctionCall(self._word(children[0]), args, self._span(meta))

    # -- expressions
    def _operation(self, op: str, meta, operands) -> ast.Operation:
        return ast.Operation(op, tuple(operands), self._span(meta))

    def or_(self, meta, children):
        return self._operation("or", meta, children)

    def and_(self, meta, children):
        return self._operation("and", meta, children)

    def not_(self, meta, children):
        return self._operation("not", meta, children)

    def neg(self, meta, children):
        return self._operation("neg", meta, children)

    def compare(self, meta, children):
        left, op, right = children
        return self._operation(INFIX[str(op)], meta, (left, right))

    def add(self, meta, children):
        return self._operation("add", meta, children)

    def sub(self, meta, children):
        return self._operation("sub", meta, children)

    def mul(self, meta, children):
        return self._operation("mul", meta, children)

    def div(self, meta, children):
        return self._operation("div", meta, children)

    def floordiv(self, meta, children):
        return self._operation("floordiv", meta, children)

    def mod(self, meta, children):
        return self._operation("mod", meta, children)

    def index(self, meta, children):
        return ast.Subscript(self._word(children[0]), tuple(children[1:]), self._span(meta))

    def setting(self, meta, children):
        via = None if len(children) < 3 or children[2] is None else self._word(children[2])
        return ast.Setting(self._word(children[0]), children[1], self._span(meta), via)

    def dim(self, meta, children):
        return ast.Dim(self._word(children[0]), children[1], self._span(meta))

    def role(self, meta, children):
        return ast.Role(self._word(children[0]), children[1], children[2], self._span(meta))

    def order(self, meta, children):
        return ast.Order(self._key(meta, "order"), children[0], self._span(meta))

    def tile(self, meta, children):
        return ast.Tile(self._key(meta, "tile"), tuple(children), self._span(meta))

    def warps(self, meta, children):
        return ast.Warps(self._key(meta, "warps"), children[0], children[1], self._span(meta))

    def pipeline(self, meta, children):
        return ast.Pipeline(self._key(meta, "pipeline"), children[0], children[1], self._span(meta))

    def mma(self, meta, children):
        return ast.MmaStatement(self._key(meta, "mma"), children[0], self._span(meta))

    def warpgroups(self, meta, children):
        return ast.Warpgroups(self._key(meta, "warpgroups"), tuple(children), self._span(meta))

    def overlap(self, meta, children):
        return ast.Overlap(self._key(meta, "overlap"), tuple(flag for flag, _ in children), self._span(meta),
                           tuple(choice for _, choice in children))

    def overlap_flag(self, meta, children):
        return self._word(children[0]), children[1]

    def split(self, meta, children):
        return ast.Split(self._key(meta, "split"), children[0], self._span(meta))

    def dequant(self, meta, children):
        return ast.Dequant(self._key(meta, "dequant"), children[0], self._span(meta))

    def launch(self, meta, children):
        return ast.LaunchStatement(self._key(meta, "launch"), children[0], children[1], self._span(meta))

    def dq(self, meta, children):
        return ast.Dq(self._key(meta, "dq"), children[0], self._span(meta))

    def backward(self, meta, children):
        return ast.BackwardBlock(tuple(children), self._span(meta))

    def unknown_statement(self, meta, children):
        return ast.UnknownStatement(self._word(children[0]), self._span(meta))

    def schedule(self, meta, children):
        return ast.ScheduleBlock(tuple(children), self._span(meta))

    def attention(self, meta, children):
        return ast.Attention(self._word(children[0]), tuple(children[1:]), self._span(meta))

    def start(self, meta, children):
        return ast.Module(tuple(children), self.file, None if meta.empty else self._span(meta))


# ---- parse errors in words ------------------------------------------------------------------------

# How each terminal reads in a message; keywords and punctuation read as themselves, quoted.
_TERMINAL_WORDS = {"NAME": "a name", "NUMBER": "a number", "_NL": "a new line", "$END": "the end of the file",
                   "COMPARE": "a comparison"}
# Terminal sets that mean "a statement goes here": named as a whole rather than listed.
_STATEMENT_STARTS = [
    ({"DQ", "ORDER"}, "a backward statement (" + ", ".join(BACKWARD_KEYS) + ") or '}'"),
    ({"ORDER", "TILE", "WARPS"}, "a schedule statement (" + ", ".join(SCHEDULE_KEYS) + ") or '}'"),
    ({"SCHEDULE"}, "a setting `key = value`, `schedule {`, `backward {` or '}'"),
    ({"ATTENTION"}, "`attention NAME {`"),
]


def _terminal_word(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    for term in _parser().terminals:
        if term.name == name and term.pattern.type == "str":
            return repr(term.pattern.value)
    return name.lower()


# Terminals that continue an expression, and those that may start one besides a name or a number: left
# out of a message that also expects the end of the line or a plain value, so it stays about those.
_CONTINUE_EXPRESSION = {"VBAR", "AMPERSAND", "PLUS", "MINUS", "STAR", "SLASH", "_FLOORDIV", "PERCENT", "COMPARE",
                        "LSQB", "LPAR"}
_START_EXPRESSION = {"LPAR", "MINUS", "TILDE"}
# `via` may end a setting (`softcap = 30 via ex2`) or a pipeline statement: left out beside the end of the line.
_OPTIONAL_TAIL = {"VIA"}


def _expected_words(expected: set[str]) -> str:
    if "_NL" in expected:
        expected = expected - _CONTINUE_EXPRESSION - _OPTIONAL_TAIL
    if expected & {"NAME", "NUMBER"}:
        expected = expected - _START_EXPRESSION
    for marker, words in _STATEMENT_STARTS:
        if marker <= expected:
            return words
    words = sorted({_terminal_word(t) for t in expected if t != "IN"}, key=lambda w: (w[0] != "'", w))
    if "IN" in expected:
        words.append("'in {...}'")
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _found(tok: Token) -> str:
    if tok.type == "_NL":
        return "the end of the line"
    if tok.type == "$END":
        return "the end of the file"
    return _clip(str(tok))


def _clip(text: str, width: int = 40) -> str:
    """repr of a token for a message, shortened: a 10 MB token must not make a 10 MB message."""
    return repr(text) if len(text) <= width else repr(text[:width]) + f"... ({len(text)} characters)"


def _unicode_hint(char: str) -> str:
    name = unicodedata.name(char, "")
    return f"specs are ASCII outside comments; found U+{ord(char):04X} {name}".rstrip()


_TOKEN = re.compile(r"#[^\n]*|[A-Za-z_][A-Za-z0-9_.]*|[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|\S")


def _previous_token(text: str, pos: int, file: str) -> tuple[str, Span] | None:
    """The last token before offset `pos` (comments skipped), with its span. Lark's own token
    history is not kept on every error path, so the text is scanned again."""
    last = None
    for match in _TOKEN.finditer(text, 0, max(pos, 0)):
        if not match.group().startswith("#"):
            last = match
    if last is None:
        return None
    line = text.count("\n", 0, last.start()) + 1
    column = last.start() - (text.rfind("\n", 0, last.start()) + 1) + 1
    return last.group(), Span(file, line, column, line, column + len(last.group()))


def _context_hint(text: str, line: int, prev: tuple[str, Span] | None, expected: set[str], at_end: bool):
    """(message or None, hint, span or None) from the statement's first word: a message and span
    that replace the generic ones where the first word explains the error better."""
    lines = text.split("\n")
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", lines[line - 1]) if 1 <= line <= len(lines) else []
    first = words[0] if words else ""
    if at_end:
        return None, "a '}' is missing: close every `{` with `}`" if "RBRACE" in expected else "", None
    if "ATTENTION" in expected and lines[line - 1].strip().startswith("}"):
        return None, "this '}' closes no block: remove it (each `attention NAME {` is closed by one '}')", None
    if first in ("schedule", "backward") and words[1:2] == [] and not {"ORDER", "TILE"} <= expected:
        # `schedule {` inside a schedule block parses as an unknown statement until its `{`
        return (f"`{first} {{` is not a statement: blocks do not nest inside a schedule or backward block",
                "close the enclosing block with '}' first; an attention block holds one `schedule { }` and one "
                "`backward { }` beside its settings", None)
    if prev is not None and prev[0] == first and expected == {"EQUAL"}:
        # A word that started a setting in an attention block but wasn't followed by '='.
        if first in SCHEDULE_KEYS:
            return (f"'{first}' is a schedule statement; put it inside `schedule {{ ... }}`",
                    f"schedule {{ {EXAMPLES[first]} }}", prev[1])
        if first not in PROBLEM_KEYS and first != "attention":
            suggestion = did_you_mean(first, PROBLEM_KEYS + ("schedule",))
            return (f"unknown key '{first}'{suggestion}",
                    "settings: " + ", ".join(PROBLEM_KEYS) + "; and `schedule { ... }`", prev[1])
    if first in EXAMPLES:
        return None, f"write it like: {EXAMPLES[first]}", None
    return None, "", None


def _syntax_error(err: UnexpectedInput, text: str, file: str) -> SpecError:
    expected = set(getattr(err, "allowed", None) or getattr(err, "expected", None) or ())
    if getattr(err, "interactive_parser", None) is not None:
        try:   # LALR's own set can hold terminals only valid after a default reduction
            expected = set(err.interactive_parser.accepts()) or expected
        except Exception:   # a best-effort refinement: fall back to Lark's own set
            pass
    tok = err.token if isinstance(err, UnexpectedToken) else Token("$END", "")
    at_end = isinstance(err, (UnexpectedToken, UnexpectedEOF)) and (tok.type == "$END" or tok.line is None)
    if isinstance(err, UnexpectedCharacters):
        line, column, width = err.line, err.column, 1
        char = text[err.pos_in_stream] if 0 <= err.pos_in_stream < len(text) else ""
        found = repr(char) if char else "a character"
    elif at_end:
        line = max(text.count("\n") + (0 if text.endswith("\n") else 1), 1)
        line, column, width = line, len(text.split("\n")[line - 1]) + 1, 1
        found = _found(Token("$END", ""))
    else:
        line, column, found = tok.line, tok.column, _found(tok)
        width = 1 if tok.type == "_NL" else max(len(str(tok)), 1)
    span = Span(file, line, column, line, column + width)
    position = err.pos_in_stream if isinstance(err, UnexpectedCharacters) else (
        len(text) if at_end else tok.start_pos)
    prev = _previous_token(text, position if isinstance(position, int) else len(text), file)
    message, hint, at = _context_hint(text, line, prev, expected, at_end)
    span = at or span
    if isinstance(err, UnexpectedCharacters) and char and not char.isascii():
        hint = _unicode_hint(char)
    if message is None:
        after = f" after {_clip(prev[0])}" if prev is not None else ""
        message = f"expected {_expected_words(expected)}{after}, found {found}"
        if "ATTENTION" in expected and tok.type == "NAME":   # a misspelt `attention` where a block must start
            message += did_you_mean(str(tok), ("attention",))
            hint = hint or "a spec file holds blocks `attention NAME { ... }` (and comments)"
    return SpecError(message, span, text, hint)


def parse_ast(text: str, filename: str = "<string>") -> ast.Module:
    """Parse spec text into its syntax tree; a syntax error is a SpecError."""
    try:
        tree = _parser().parse(text)
    except (UnexpectedCharacters, UnexpectedToken, UnexpectedEOF) as err:
        raise _syntax_error(err, text, filename) from None
    return _ToAst(filename).transform(tree)


# ---- entry points ---------------------------------------------------------------------------------

# Bounds on what one spec may hold, checked before parsing so that a huge input is refused in
# well under a second instead of taking minutes and gigabytes (bundled specs are under 1 KiB).
MAX_SPEC_BYTES = 1 << 20
MAX_BLOCKS = 100          # blocks however they are written (several on one line count too): explain prints each
MAX_TOKEN = 128
_BLOCK_START = re.compile(r"(?<![\w.])attention(?![\w.])")
_LONG_TOKEN = re.compile(r"[^\s#{}(),=]{%d,}" % (MAX_TOKEN + 1))


def _check_bounds(text: str, filename: str) -> None:
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"the spec is {len(text):,} characters; at most {MAX_SPEC_BYTES:,} are accepted",
                        Span(filename, 1, 1, 1, 2), hint="split it into several files")
    starts = 0
    for line_no, line in enumerate(text.split("\n"), 1):
        for match in _BLOCK_START.finditer(line.split("#", 1)[0]):   # comments may say "attention"
            starts += 1
            if starts > MAX_BLOCKS:
                raise SpecError(f"more than {MAX_BLOCKS} attention blocks in one spec",
                                Span(filename, line_no, match.start() + 1, line_no, match.end() + 1), text,
                                "split it into several files")
    for line_no, line in enumerate(text.split("\n"), 1):
        code = line.split("#", 1)[0]   # comments may be long
        match = _LONG_TOKEN.search(code)
        if match:
            raise SpecError(f"a token of {len(match.group()):,} characters; at most {MAX_TOKEN} are accepted",
                            Span(filename, line_no, match.start() + 1, line_no, match.end() + 1), text,
                            f"names and numbers are at most {MAX_TOKEN} characters (a kernel name becomes file "
                            "names and CUDA symbols); shorten it")


def parse_text(text: str, filename: str = "<string>") -> list[KernelSpec | SpecSpace]:
    """One KernelSpec per attention block, or a SpecSpace for a block with `in {...}` choices. `text`
    is a str; UTF-8 bytes are decoded as parse_file decodes a file."""
    if isinstance(text, (bytes, bytearray)):
        return _parse_bytes(bytes(text), filename)
    if not isinstance(text, str):
        raise TypeError(f"parse_text takes the spec's text (a str, or UTF-8 bytes), got {type(text).__name__}; "
                        "for a file use parse_file(path)")
    text = text.removeprefix("\ufeff")   # a UTF-8 byte order mark, as some editors write
    _check_bounds(text, filename)
    return check_module(parse_ast(text, filename), text)


def parse_file(path: str | os.PathLike) -> list[KernelSpec | SpecSpace]:
    """parse_text of a file. A missing or unreadable path raises the OSError (the CLI names the
    path); a file too big or not UTF-8 is a SpecError."""
    with open(path, "rb") as f:
        data = f.read(4 * MAX_SPEC_BYTES + 1)   # UTF-8 takes up to 4 bytes a character
    if len(data) > 4 * MAX_SPEC_BYTES:
        raise SpecError(f"the file is over {4 * MAX_SPEC_BYTES:,} bytes; at most {MAX_SPEC_BYTES:,} characters "
                        "are accepted", Span(str(path), 1, 1, 1, 2), hint="split it into several files")
    return _parse_bytes(data, str(path))


def _parse_bytes(data: bytes, filename: str) -> list[KernelSpec | SpecSpace]:
    """parse_text of UTF-8 bytes; bytes that are not UTF-8 are a SpecError at the first bad byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        line_start = data.rfind(b"\n", 0, err.start) + 1
        column = len(data[line_start:err.start].decode("utf-8", "replace")) + 1
        raise SpecError(f"the file is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}",
                        Span(filename, line, column, line, column + 1), data.decode("utf-8", "replace"),
                        "save the file as UTF-8") from None
    return parse_text(text, filename)


def looks_like_path(path_or_text) -> bool:
    """A path, not spec text: a PathLike, or a str with no brace or new line that is a file or does not
    start like spec text (`attention k` is text with its `{` missing, not a file name)."""
    if isinstance(path_or_text, os.PathLike):
        return True
    if "{" in path_or_text or "\n" in path_or_text:
        return False
    return os.path.exists(path_or_text) or not path_or_text.lstrip().startswith(("attention ", "#"))


def load_specs(path_or_text: str | os.PathLike) -> list[KernelSpec]:
    """Concrete kernels from a file path or spec text: spaces become their legal configs."""
    if not isinstance(path_or_text, (str, os.PathLike)):
        raise TypeError(f"load_specs takes a .tile path or spec text, got {type(path_or_text).__name__}")
    if isinstance(path_or_text, str) and not path_or_text.strip():
        raise SpecError("load_specs got an empty string", hint="pass a .tile path or spec text")
    if looks_like_path(path_or_text):
        items = parse_file(path_or_text)
    else:
        items = parse_text(path_or_text)
    specs: list[KernelSpec] = []
    for item in items:
        specs.extend(item.expand()[0] if isinstance(item, SpecSpace) else [item])
    return specs


def load_spec(path_or_text: str | os.PathLike) -> KernelSpec:
    """The one concrete kernel in a file or text; more than one (or a space) is a SpecError."""
    specs = load_specs(path_or_text)
    if len(specs) != 1:
        where = str(path_or_text) if looks_like_path(path_or_text) else "the spec text"
        raise SpecError(f"{where} holds {len(specs)} kernels; expected exactly one",
                        hint="pick one with load_specs(...)[i], or keep one attention block per file")
    return specs[0]
