"""The `tiledsl` command. Each subcommand lives in its own module (cli/<name>.py) exposing
`add_arguments(parser)` and `run(args) -> int`; this file only wires them together and turns
every expected failure (a SpecError, a bad option, a path that can't be read or written, a
missing optional dependency) into its message and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import CliError, LaunchError, RuntimeInputError, SpecError
from ..version import __version__

# (name, module, one-line help), in the order a user meets them.
SUBCOMMANDS = [
    ("check", "check", "parse and check specs; print each kernel's name and config"),
    ("explain", "explain", "print the loop nest, graph, on-chip budget and HBM traffic"),
    ("explain-ring", "explain_ring", "price a context-parallel ring: per-rank work, bytes per step, compute vs link"),
    ("compile", "compile", "emit CUDA (and PTX, cubin, ptxas resources, SASS) for specs"),
    ("run", "run", "run a spec on the GPU and validate it against the float64 reference"),
    ("bench", "bench", "time specs on the GPU next to PyTorch SDPA"),
    ("tune", "tune", "search a spec's schedule space on the GPU"),
    ("warmup", "warmup", "compile the tuned kernels for this GPU into the disk cache"),
]


# Optional dependencies a command may need: module -> (what it is for, the extra that installs it).
OPTIONAL = {"cupy": ("CuPy, to run kernels on a GPU", "gpu"), "cupy_backends": ("CuPy, to run kernels on a GPU", "gpu"),
            "torch": ("PyTorch, to time the SDPA peers", "bench"), "matplotlib": ("matplotlib, for --plot", "plot")}


class _Parser(argparse.ArgumentParser):
    """A bad option is one line (`tiledsl explain: error: argument --seqlen: ...`) and exit 2,
    not the usage block: the line already names the option and what it accepts."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `tiledsl` parser; `parser.subcommands` maps each subcommand to its own parser."""
    parser = _Parser(prog="tiledsl", description="A tile DSL compiler for attention kernels.")
    parser.subcommands = {}
    parser.add_argument("--version", action="version", version=f"tiledsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, module_name, help_text in SUBCOMMANDS:
        try:
            module = importlib.import_module(f".{module_name}", __package__)
        except ModuleNotFoundError as err:
            if err.name != f"{__package__}.{module_name}":
                raise
            continue   # a subcommand not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        parser.subcommands[name] = p
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # name the subcommand whose options they are not (the top parser would say "tiledsl")
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args) or 0
    except BrokenPipeError:   # `tiledsl check ... | head`: the reader left; stop quietly
        sys.stdout = None
        return 1
    except (SpecError, RuntimeInputError, LaunchError, CliError, OSError) as err:
        print(error_text(err), file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top not in OPTIONAL:
            raise
        what, extra = OPTIONAL[top]
        print(f"error: tiledsl {args.command} needs {what}, which is not installed: "
              f"pip install 'tiledsl[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def error_text(err: BaseException) -> str | None:
    """The message an expected failure prints (a SpecError's file:line:col screen, one `error: ...`
    line for the others, an OSError naming its path), or None for an unexpected one (a bug: let it
    raise)."""
    if isinstance(err, SpecError):
        return err.render()
    if isinstance(err, (RuntimeInputError, LaunchError, CliError)):
        return f"error: {err}"
    if isinstance(err, OSError):   # a spec path, -o, --dot, --record: name the path and what went wrong
        return f"error: {err.filename or ''}: {_os_reason(err)}{_relative_to(err)}"
    return None


def _relative_to(err: OSError) -> str:
    """A relative path that is not there was looked up from the current folder: say which one, or that it is
    gone (a shell left in a folder that was deleted and made again finds no relative path, every absolute one)."""
    if not isinstance(err, FileNotFoundError) or not err.filename or os.path.isabs(err.filename):
        return ""
    try:
        return f" (looked up from the current folder {os.getcwd()})"
    except FileNotFoundError:
        return (" (the current folder no longer exists: it was deleted, or deleted and made again, after this shell "
                "entered it; cd into it again or give an absolute path)")


def _os_reason(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return "no such file or directory"
    if isinstance(err, IsADirectoryError):
        return "is a directory; expected a file"
    if isinstance(err, NotADirectoryError):
        return "a parent of this path is a file, not a directory"
    if isinstance(err, PermissionError):
        return "permission denied"
    return err.strerror or str(err)


if __name__ == "__main__":
    sys.exit(main())
