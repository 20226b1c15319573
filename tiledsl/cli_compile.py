"""`tiledsl compile`: emit the CUDA of each kernel, and on request PTX, cubin, the ptxas resource
report and SASS through nvcc."""
from __future__ import annotations

import sys
from pathlib import Path

from . import nvcc
from .check import SpecSpace
from .cli_common import add_spec_arguments, concrete_specs
from .errors import SpecError
from .lower import LOWERINGS, lower
from .parse import parse_file
from .render import render, write_if_changed

EMITS = ("cuda", "ptx", "cubin", "resources", "sass")


def add_arguments(parser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("-o", "--output", default="generated", help="output folder (default: generated)")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="note and skip kernels whose family has no template yet, instead of failing")
    parser.add_argument("--emit", default="cuda", help=f"comma-separated, from {', '.join(EMITS)} (default: cuda)")


def run(args) -> int:
    emits = [e.strip() for e in args.emit.split(",") if e.strip()]
    unknown = [e for e in emits if e not in EMITS]
    if unknown:
        print(f"error: --emit: unknown {', '.join(unknown)}; choose from {', '.join(EMITS)}", file=sys.stderr)
        return 2
    out = Path(args.output)
    status = 0
    _list_spaces(args.specs)
    for spec in concrete_specs(args.specs, args.name):
        if args.skip_unsupported and spec.family not in LOWERINGS:
            print(f"{spec.kernel_name}: skipped (the {spec.family.value} family has no CUDA template yet)")
            continue
        try:
            source = render(lower(spec))
        except SpecError as err:
            print(err.render(), file=sys.stderr)
            status = 2
            continue
        name = spec.kernel_name
        changed = write_if_changed(out / f"{name}.cu", source) if "cuda" in emits else False
        line = [f"{name}: {out / (name + '.cu')}" + (" (updated)" if changed else "")]
        try:
            status = max(status, _emit_nvcc(source, name, emits, out, line))
        except FileNotFoundError as err:
            print(f"error: {name}: --emit {','.join(emits)} needs {err.args[0]}, which is not on PATH", file=sys.stderr)
            return 2
        except RuntimeError as err:   # nvcc refused the source: a tiledsl bug, reported without a traceback
            print(f"error: {err}", file=sys.stderr)
            status = 2
            continue
        print("  ".join(line))
    return status


def _list_spaces(paths) -> None:
    """A search space is not compiled here (`tiledsl tune` compiles its configs); say so, with the
    configs `tiledsl check` rejects."""
    for path in paths:
        for item in parse_file(path):
            if isinstance(item, SpecSpace):
                legal, rejected = item.expand()
                print(f"space '{item.name}': {item.size} configs, {len(legal)} legal, {len(rejected)} rejected "
                      "(not compiled: `tiledsl tune` compiles a space's configs)")
                for config, reason in rejected:
                    print("    rejected  " + " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in config.items())
                          + f": {reason}")


def _emit_nvcc(source: str, name: str, emits: list[str], out: Path, line: list[str]) -> int:
    if "ptx" in emits:
        nvcc.compile_to(source, name, "ptx", out)
        line.append(f"ptx: {out / (name + '.ptx')}")
    if {"cubin", "resources", "sass"} & set(emits):
        cubin, report = nvcc.compile_to(source, name, "cubin", out)
        res = nvcc.parse_resources(report)
        if "resources" in emits:
            (out / f"{name}.resources.txt").write_text(report)
            line.append(f"registers {res.registers}, spills {res.spill_store_bytes} B, stack {res.stack_bytes} B")
        if "sass" in emits:
            (out / f"{name}.sass").write_text(nvcc.sass(cubin))
            line.append(f"sass: {out / (name + '.sass')}")
        if "cubin" not in emits:
            cubin.unlink()
    return 0
