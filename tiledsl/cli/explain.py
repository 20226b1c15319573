"""`tiledsl explain SPEC... [--seqlen N] [--seqlen-kv N] [--batch B] [--heads H] [--dot FILE] [--html FILE]`:
print each kernel's loop nest, ops, on-chip budget and HBM traffic; optionally write the graphs
as Graphviz DOT (several kernels: one digraph each, in one file) and a page that steps through
every kernel (cli/html.py). A search space lists its refused
configs (as `tiledsl check` does) and explains the legal ones. A kernel that is refused gets its
error on stderr, the others are still explained, and the exit status is 2."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import COUNT, MODEL_SEQLEN, check_kv_heads, concrete_specs
from ..errors import CliError, SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".tile files")
    parser.add_argument("--seqlen", type=MODEL_SEQLEN, default=None,
                        help="queries per sequence (default 4096; for decode: the kv cache length)")
    parser.add_argument("--seqlen-kv", type=MODEL_SEQLEN, default=None, help="keys per sequence (default: --seqlen)")
    parser.add_argument("--batch", type=COUNT, default=1)
    parser.add_argument("--heads", type=COUNT, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=COUNT, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--dot", metavar="FILE", default=None, help="write the scheduler graphs as Graphviz DOT")
    parser.add_argument("--html", metavar="FILE", default=None,
                        help="write a self-contained page that steps through each kernel (a space: its configs' "
                             "budgets and the tune model's ranking, then the model's pick)")
    parser.add_argument("--html-seqlen", type=MODEL_SEQLEN, default=None, metavar="N",
                        help="the page's step-through sequence length (default: two and a half of the largest tile)")


def run(args: argparse.Namespace) -> int:
    from .report import explain, to_dot
    from ..schedule.passes import run_passes

    check_kv_heads(args.heads, args.kv_heads)
    for option, path, example in (("--dot", args.dot, "graphs.dot"), ("--html", args.html, "explain.html")):
        if path and Path(path).is_dir():
            raise CliError(f"{option} {path}: is a folder; give a file name, e.g. {Path(path) / example}")
    dots, refused, first, notes = [], 0, True, []
    specs = concrete_specs(args.specs, expand_spaces=True, notes=notes)
    for note in notes:   # a space's refused configs, as `tiledsl check` lists them
        print(note)
    for spec in specs:
        if not first:
            print("=" * 100)
        first = False
        decode = spec.problem.queries_per_seq is not None   # --seqlen is then the kv cache length
        try:
            print(explain(spec, batch=args.batch, heads=args.heads, seqlen_q=None if decode else args.seqlen,
                          seqlen_kv=args.seqlen_kv or (args.seqlen if decode else None),
                          kv_heads=args.kv_heads), end="")
        except SpecError as err:
            # one refused config of a search space should not hide the others
            print(f"{spec.kernel_name}: refused (see stderr)")
            print(err.render(), file=sys.stderr)
            refused += 1
            continue
        if args.dot:
            dots.append(to_dot(run_passes(spec)))
    if args.dot:
        try:
            with open(args.dot, "w") as f:
                f.write("".join(dots))
        except OSError as err:
            raise CliError(f"--dot {args.dot}: cannot write it ({err.strerror or err})") from None
    if args.html:
        from .html import RealShape, write_page
        print(write_page(args.html, args.specs, RealShape(args.batch, args.heads, args.kv_heads, args.seqlen,
                                                          args.seqlen_kv), args.html_seqlen))
    return 2 if refused else 0
