"""The one error type for everything wrong with a spec, and its one-screen rendering.

Every stage that refuses a spec (parser, checker, legality pass, lowering) raises SpecError
with the span of the text that caused it, so the user sees file:line:col, the line, a caret
under the offending text and what would be accepted.
"""
from __future__ import annotations

from .spec import Span

EXCERPT_WIDTH = 100   # characters of a source line shown under an error (a 10 MB line stays one screen)


class SpecError(Exception):
    """A spec that cannot be built. `hint` says what would be accepted."""

    def __init__(self, message: str, span: Span | None = None, source_text: str = "", hint: str = ""):
        self.message = message
        self.span = span
        self.source_text = source_text
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        lines = [f"{where}error: {self.message}"]
        excerpt = _excerpt(self.source_text, self.span)
        if excerpt:
            lines += excerpt
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _excerpt(text: str, span: Span | None) -> list[str]:
    """The source line of `span` with carets under it (first line only if it spans several)."""
    if not text or span is None:
        return []
    source_lines = text.splitlines()
    if not 1 <= span.line <= len(source_lines):
        return []
    line = source_lines[span.line - 1].replace("\t", " ")
    start = max(span.column - 1, 0)
    end = span.end_column - 1 if span.end_line == span.line else len(line)
    width = min(max(end - start, 1), EXCERPT_WIDTH)
    if len(line) > EXCERPT_WIDTH:   # a huge line or token: show a window around the caret
        left = max(min(start - 20, len(line) - EXCERPT_WIDTH), 0)
        shown = line[left:left + EXCERPT_WIDTH]
        line = ("..." if left else "") + shown + ("..." if left + EXCERPT_WIDTH < len(line) else "")
        start = start - left + (3 if left else 0)
        width = max(min(width, len(line) - start), 1)
    gutter = f"{span.line:>5} | "
    return [gutter + line, " " * len(gutter) + " " * start + "^" * width]


class RuntimeInputError(ValueError):
    """A tensor handed to a compiled kernel that it cannot take (shape, dtype, device, strides)."""


class LaunchError(RuntimeError):
    """A kernel launch or GPU execution failure, raised with the kernel's name and config."""


class CliError(Exception):
    """A command-line mistake that is not in a spec (an option out of range, an output folder that
    can't be written): the CLI prints it as one `error: ...` line and exits 2."""
