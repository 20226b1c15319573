"""A search space: an attention block with `in {...}` choices, expanded into the legal KernelSpecs of its
cartesian product and the rejected configs with their reasons."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import SpecError
from ..spec import KernelSpec, Problem, Span
from . import check_backward
from .rules import schedule_with_defaults, validate


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

    def spec(self, config: dict, hints: bool = True) -> KernelSpec:
        """The KernelSpec of one config; a SpecError when the config is illegal (with `hints`, the
        schedule edits that would make it legal: costly across a whole space)."""
        forward, backward = check_backward.split_config({**dict(self.fixed), **config})
        spec = KernelSpec(self.name, self.problem, schedule_with_defaults(self.problem, forward),
                          self.source_file, self.source_text, self.spans, self.span,
                          check_backward.backward_schedule(backward) if self.backward else None)
        validate(spec, hints)
        return spec

    def expand(self) -> tuple[list[KernelSpec], list[tuple[dict, str]]]:
        """(legal specs, [(config, reason)] for the illegal ones), in product order."""
        legal, rejected = [], []
        for config in self.configs():
            try:
                legal.append(self.spec(config, hints=False))
            except SpecError as err:
                rejected.append((config, err.message))
        return legal, rejected
