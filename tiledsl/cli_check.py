"""`tiledsl check SPEC... [--json]`: parse and check spec files and print what they define.

A kernel prints its generated name, family and full config; a search space prints its size, how
many configs are legal, each legal kernel and each rejection with its reason. The first spec
error stops the command (cli.py prints it and exits 2).
"""
from __future__ import annotations

import argparse
import json
from enum import Enum

from .check import SpecSpace
from .parse import parse_file
from .spec import KernelSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.tile)")
    parser.add_argument("--json", action="store_true", help="print one JSON list of every kernel and space")


def _plain(value):
    return value.value if isinstance(value, Enum) else value


def _config_text(config: dict) -> str:
    return " ".join(f"{key}={_plain(value)}" for key, value in config.items())


def _kernel_json(spec: KernelSpec) -> dict:
    return {"type": "kernel", "file": spec.source_file, "line": spec.span.line if spec.span else None,
            **spec.config()}


def _space_json(space: SpecSpace) -> dict:
    legal, rejected = space.expand()
    return {"type": "space", "file": space.source_file, "line": space.span.line if space.span else None,
            "name": space.name, "size": space.size, "legal_count": len(legal),
            "choices": {name: [_plain(o) for o in options] for name, options in space.choices},
            "legal": [spec.config() for spec in legal],
            "rejected": [{"config": {k: _plain(v) for k, v in config.items()}, "reason": reason}
                         for config, reason in rejected]}


def _print_kernel(spec: KernelSpec, indent: str = "") -> None:
    config = spec.config()
    print(f"{indent}{spec.kernel_name}  ({spec.family.value}, from '{spec.name}')")
    print(f"{indent}    problem:  {_config_text(config['problem'])}")
    print(f"{indent}    schedule: {_config_text(config['schedule'])}")


def _print_space(space: SpecSpace) -> None:
    legal, rejected = space.expand()
    print(f"  space '{space.name}': {space.size} configs, {len(legal)} legal, {len(rejected)} rejected")
    print("      choices: " + "; ".join(f"{name} in {{{', '.join(str(_plain(o)) for o in options)}}}"
                                     for name, options in space.choices))
    for spec in legal:
        print(f"      legal     {spec.kernel_name}")
    for config, reason in rejected:
        print(f"      rejected  {_config_text(config)}: {reason}")


def run(args: argparse.Namespace) -> int:
    results = []
    for path in args.specs:
        items = parse_file(path)
        if args.json:
            results += [_space_json(i) if isinstance(i, SpecSpace) else _kernel_json(i) for i in items]
            continue
        print(f"{path}: {len(items)} attention block{'s' if len(items) != 1 else ''}")
        for item in items:
            _print_space(item) if isinstance(item, SpecSpace) else _print_kernel(item, "  ")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
