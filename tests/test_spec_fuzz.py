"""Fuzz the front end: mutate the bundled specs token by token and check that parse + check
either succeed or raise a SpecError with a location; nothing else may escape (no traceback)."""
from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiledsl.frontend.space import SpecSpace
from tiledsl.frontend.rules import validate
from tiledsl.errors import SpecError
from tiledsl.frontend.parse import parse_ast, parse_text

# Not imported from conftest: tests/ may or may not be a package.
SPEC_FILES = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.tile"))

TEXTS = [path.read_text() for path in SPEC_FILES]
# Pieces that join back into the text: whitespace, comments, words, numbers, any other character.
_PIECE = re.compile(r"\s+|#[^\n]*|[A-Za-z_][\w.]*|[+-]?\d+(?:\.\d*)?|.", re.S)
POOL = sorted({piece for text in TEXTS for piece in _PIECE.findall(text) if piece.strip()})
JUNK = st.one_of(st.text(max_size=6), st.sampled_from(["{", "}", "(", ")", "in {", "=", ",", "\n", "\r", "\t",
                                                       "-1", "1e999", "9" * 5000, "0.0", "auto", "window("]))


@st.composite
def mutated_spec(draw) -> str:
    pieces = _PIECE.findall(draw(st.sampled_from(TEXTS)))
    for _ in range(draw(st.integers(1, 4))):
        if not pieces:
            break
        i = draw(st.integers(0, len(pieces) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "replace", "junk", "swap_lines"]))
        if op == "delete":
            del pieces[i]
        elif op == "duplicate":
            pieces.insert(i, pieces[i])
        elif op == "replace":
            pieces[i] = draw(st.sampled_from(POOL))
        elif op == "junk":
            pieces[i] = draw(JUNK)
        else:
            lines = "".join(pieces).split("\n")
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            pieces = _PIECE.findall("\n".join(lines))
    return "".join(pieces)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_spec())
def test_front_end_raises_only_spec_errors(text):
    try:
        items = parse_text(text, "fuzz.tile")
    except SpecError as err:
        rendered = err.render()
        assert err.span is not None and rendered.startswith("fuzz.tile:"), rendered
        return
    for item in items:
        specs = item.expand()[0] if isinstance(item, SpecSpace) else [item]
        for spec in specs:
            validate(spec)   # what the checker returns is legal
            assert spec.kernel_name and spec.config()
    tree = parse_ast(text)
    assert parse_ast(tree.source()) == tree
