"""`tiledsl compile`: emit the CUDA of each kernel, and on request PTX, cubin, the ptxas resource
report and SASS through nvcc (SASS where cuobjdump exists; a note otherwise). A search space
compiles each of its legal configs, after a line saying how many the checker rejected."""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

from ..codegen import nvcc
from .common import add_spec_arguments, concrete_specs, writable_folder
from ..errors import CliError, SpecError

EMITS = ("cuda", "ptx", "cubin", "resources", "sass")
_ADVISED_IN = re.compile(r" in function '\w+'")   # the kernel's name is already at the start of its line


def add_arguments(parser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("-o", "--output", default="generated", help="output folder (default: generated)")
    parser.add_argument("--skip-unsupported", action="store_true",
                        help="note and skip kernels whose family has no template yet, instead of failing")
    parser.add_argument("--emit", action="append", metavar="KINDS",
                        help=f"comma-separated, from {', '.join(EMITS)}; may be repeated (default: cuda)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="a line per kernel (and every rejected config of a space) even for many kernels")


def run(args) -> int:
    from ..families import lower, missing_template
    from ..codegen.render import render, write_if_changed

    emits = list(dict.fromkeys(e.strip() for given in (args.emit or ["cuda"]) for e in given.split(",") if e.strip()))
    unknown = [e for e in emits if e not in EMITS]
    if unknown or not emits:
        raise CliError(f"--emit: unknown {', '.join(unknown) or '(nothing)'}; choose from {', '.join(EMITS)}")
    if set(emits) - {"cuda"} and nvcc.nvcc_path() is None:
        raise CliError(f"--emit {','.join(emits)} needs nvcc, which is not on PATH (--emit cuda does not)")
    notes: list[str] = []
    specs = concrete_specs(args.specs, args.name, expand_spaces=True, notes=notes, verbose=args.verbose)
    for note in notes:
        print(note)
    if not specs:
        raise CliError("no legal kernels to compile in " + ", ".join(args.specs))
    out = writable_folder("-o", args.output)
    # A line per kernel where it says more than where the file went (nvcc's outputs) or when asked;
    # many CUDA files are a count: the demo's 190 kernels were 190 lines.
    each = args.verbose or len(specs) == 1 or set(emits) != {"cuda"}
    status, no_sass, written = 0, False, Counter()
    for spec in specs:
        if args.skip_unsupported and missing_template(spec):
            print(f"{spec.kernel_name}: skipped ({missing_template(spec)})")
            continue
        try:
            source = render(lower(spec))
        except SpecError as err:
            print(err.render(), file=sys.stderr)
            status = 2
            continue
        name = spec.kernel_name
        line = []
        if "cuda" in emits:
            changed = write_if_changed(out / f"{name}.cu", source)
            written["updated" if changed else "unchanged"] += 1
            line.append(f"{out / (name + '.cu')}" + (" (updated)" if changed else ""))
        notes: list[str] = []
        try:
            no_sass = _emit_nvcc(source, name, emits, out, line, notes) or no_sass
        except RuntimeError as err:   # nvcc refused the generated source: a bug, but one line per kernel
            print(f"error: {err}", file=sys.stderr)
            status = 2
            continue
        if each:
            print("\n".join([f"{name}: " + "  ".join(line)] + notes))
        if spec.backward is not None:
            status, no_sass = _emit_backward(spec, emits, out, status, no_sass, written, each)
    if not each:
        print(f"{sum(written.values())} CUDA files in {out}: {written['updated']} updated, {written['unchanged']} "
              "unchanged (--verbose names each)")
    if no_sass:
        print("note: --emit sass: cuobjdump is not on PATH; no SASS written (the other outputs were)", file=sys.stderr)
    return status


def _emit_backward(spec, emits: list[str], out: Path, status: int, no_sass: bool, written: Counter,
                   each: bool) -> tuple[int, bool]:
    """The backward module of a spec with a `backward { }` block (tiledsl/lower/backward.py), beside its
    forward kernel; a backward the template does not build yet is noted, not an error."""
    from ..layout.backward import backward_has_template
    from ..lower.backward import backward_kernel_name, lower_backward
    from ..codegen.render import render, write_if_changed
    name = backward_kernel_name(spec)
    why = backward_has_template(spec)
    if why:
        print(f"{name}: skipped ({why})")
        return status, no_sass
    try:
        plan = lower_backward(spec)
    except SpecError as err:
        print(err.render(), file=sys.stderr)
        return 2, no_sass
    source, line, notes = render(plan), [], []
    if "cuda" in emits:
        changed = write_if_changed(out / f"{name}.cu", source)
        written["updated" if changed else "unchanged"] += 1
        line.append(f"{out / (name + '.cu')}" + (" (updated)" if changed else ""))
    try:
        no_sass = _emit_nvcc(source, name, emits, out, line, notes, plan.kernel_names["main"]) or no_sass
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2, no_sass
    if each:
        print("\n".join([f"{name}: " + "  ".join(line)] + notes))
    return status, no_sass


def _emit_nvcc(source: str, name: str, emits: list[str], out: Path, line: list[str], notes: list[str],
               function: str = "") -> bool:
    """Runs nvcc for the requested outputs, adding what it wrote to `line` and ptxas's advisories to
    `notes`; True when SASS was asked for but cuobjdump is absent."""
    no_sass = False
    if "ptx" in emits:
        nvcc.compile_to(source, name, "ptx", out)
        line.append(f"ptx: {out / (name + '.ptx')}")
    if {"cubin", "resources", "sass"} & set(emits):
        cubin, report = nvcc.compile_to(source, name, "cubin", out)
        res = nvcc.parse_ptxas(report).get(function or name, nvcc.Resources(0, report=report))
        if "cubin" in emits:
            line.append(f"cubin: {cubin}")
        if "resources" in emits:
            (out / f"{name}.resources.txt").write_text(report)
            line.append(f"registers {res.registers}, spills {res.spill_stores} B, stack {res.stack_bytes} B")
            # where ptxas changed the schedule the source asked for (e.g. a wgmma wait it had to add)
            notes += [f"    ptxas {_ADVISED_IN.sub('', advisory)}" for advisory in res.advisories]
        if "sass" in emits:
            try:
                (out / f"{name}.sass").write_text(nvcc.sass(cubin))
                line.append(f"sass: {out / (name + '.sass')}")
            except FileNotFoundError:
                no_sass = True
        if "cubin" not in emits:
            cubin.unlink()
    return no_sass
