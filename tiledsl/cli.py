"""The `tiledsl` command. Each subcommand lives in its own module (cli_<name>.py) exposing
`add_arguments(parser)` and `run(args) -> int`; this file only wires them together and turns a
SpecError into its one-screen message and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import LaunchError, RuntimeInputError, SpecError

# (name, module, one-line help), in the order a user meets them.
SUBCOMMANDS = [
    ("check", "cli_check", "parse and check specs; print each kernel's name and config"),
    ("explain", "cli_explain", "print the loop nest, graph, on-chip budget and HBM traffic"),
    ("compile", "cli_compile", "emit CUDA (and PTX, cubin, ptxas resources, SASS) for specs"),
    ("run", "cli_run", "run a spec on the GPU and validate it against the float64 reference"),
    ("bench", "cli_bench", "time specs on the GPU next to PyTorch SDPA"),
    ("tune", "cli_tune", "search a spec's schedule space on the GPU"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiledsl", description="A tile DSL compiler for attention kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name, help_text in SUBCOMMANDS:
        try:
            module = importlib.import_module(f".{module_name}", __package__)
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.{module_name}":
                raise
            continue   # a subcommand not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except SpecError as err:
        print(err.render(), file=sys.stderr)
        return 2
    except (RuntimeInputError, LaunchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"error: {err.filename}: no such file", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
