"""`tiledsl explain SPEC... [--seqlen N] [--seqlen-kv N] [--batch B] [--heads H] [--dot FILE]`:
print each kernel's loop nest, ops, on-chip budget and HBM traffic; optionally write the graphs
as Graphviz DOT (several kernels: one digraph each, in one file). A search space lists its refused
configs (as `tiledsl check` does) and explains the legal ones. A kernel that is refused gets its
error on stderr, the others are still explained, and the exit status is 2."""
from __future__ import annotations

import argparse
import sys

from .check import SpecSpace
from .errors import SpecError
from .explain import explain, to_dot
from .passes import run_passes
from .spec import KernelSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".tile files")
    parser.add_argument("--seqlen", type=int, default=None,
                        help="queries per sequence (default 4096; for decode: the kv cache length)")
    parser.add_argument("--seqlen-kv", type=int, default=None, help="keys per sequence (default: --seqlen)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--dot", metavar="FILE", default=None, help="write the scheduler graphs as Graphviz DOT")


def _kernels(path: str) -> list[KernelSpec]:
    """The file's kernels; a search space's legal configs, after a list of the refused ones (the
    same rejections `tiledsl check` prints)."""
    from .parse import parse_file   # lazily: the front end is only needed when the command runs
    specs: list[KernelSpec] = []
    for item in parse_file(path):
        if not isinstance(item, SpecSpace):
            specs.append(item)
            continue
        legal, rejected = item.expand()
        print(f"space '{item.name}': {item.size} configs, {len(legal)} legal, {len(rejected)} rejected")
        for config, reason in rejected:
            print("    rejected  " + " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in config.items()) + f": {reason}")
        print("=" * 100)
        specs += legal
    return specs


def run(args: argparse.Namespace) -> int:
    dots, refused, first = [], 0, True
    for path in args.specs:
        for spec in _kernels(path):
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
        with open(args.dot, "w") as f:
            f.write("".join(dots))
    return 2 if refused else 0
