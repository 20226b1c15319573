"""`tiledsl explain SPEC... [--seqlen N] [--seqlen-kv N] [--batch B] [--heads H] [--name NAME] [--summary]
[--json] [--all] [--dot FILE] [--html FILE]`: print each kernel's loop nest, ops, on-chip budget and HBM traffic
(`--summary`: its headline numbers; FP8 kernels: their quantization too; `--json`: one JSON list of every
explained kernel's sizes, traffic per tensor and quantization), and optionally write the scheduler graphs as
Graphviz DOT, one digraph per file, and a page that steps through every kernel (cli/html.py).

A search space prints a summary by default: its counts, the rejections grouped by reason, the model's
best few configs for the shape, and the explanation of the best one; `--all` explains every legal
config. A kernel that is refused gets its error on stderr, the others are still explained, and the exit
status is 2."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import COUNT, MODEL_SEQLEN, check_kv_heads, concrete_specs, read_items
from ..errors import CliError, SpecError
from ..frontend.space import SpecSpace
from ..schedule.traffic import model_too_big, tile_pairs

BEST_SHOWN = 3   # a space's configs ranked by the model in its summary
RANKING_TILE_PAIRS = 1 << 24   # tile-table cells the ranking of a space's configs may walk, all configs together


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help=".tile files")
    parser.add_argument("--seqlen", type=MODEL_SEQLEN, default=None,
                        help="queries per sequence (default 4096; for decode: the kv cache length)")
    parser.add_argument("--seqlen-kv", type=MODEL_SEQLEN, default=None, help="keys per sequence (default: --seqlen)")
    parser.add_argument("--batch", type=COUNT, default=1)
    parser.add_argument("--heads", type=COUNT, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=COUNT, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--name", help="only the attention block with this name")
    parser.add_argument("--summary", action="store_true", help="each kernel's headline numbers only")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON list: each explained kernel's sizes, HBM traffic per tensor (bytes, "
                             "element sizes; FP8: beside bf16's) and FP8 quantization, or its error")
    parser.add_argument("--all", action="store_true", help="a search space: explain every legal config")
    parser.add_argument("--dot", metavar="FILE", default=None,
                        help="write the scheduler graphs as Graphviz DOT: FILE for one graph, FILE's stem plus the "
                             "kernel's name for several (a backward graph too)")
    parser.add_argument("--html", metavar="FILE", default=None,
                        help="write a self-contained page that steps through each kernel (a space: its configs' "
                             "budgets and the tune model's ranking, then the model's pick)")
    parser.add_argument("--html-seqlen", type=MODEL_SEQLEN, default=None, metavar="N",
                        help="the page's step-through sequence length (default: two and a half of the largest tile)")


def output_target(option: str, path: str, example: str, make_folders: bool = False) -> Path:
    """--dot's or --html's file, checked before anything is explained: a folder or a path whose folder
    can't take it fails here, not after pages of output (`make_folders`: missing folders are made later)."""
    target = Path(path)
    if target.is_dir():
        raise CliError(f"{option} {path}: is a folder; give a file name, e.g. {target / example}")
    if make_folders:
        return target
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise CliError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CliError(f"{option} {path}: cannot write there (permission denied)")
    return target


def dot_paths(target: Path, names: list[str]) -> list[Path]:
    """One file per graph: `target` itself for one, else `<stem>.<graph>.dot` beside it (`dot -Tpng`
    reads one digraph per file)."""
    if len(names) == 1:
        return [target]
    return [target.with_name(f"{target.stem}.{name}{target.suffix or '.dot'}") for name in names]


def _explain_args(spec, args) -> dict:
    decode = spec.problem.queries_per_seq is not None   # --seqlen is then the kv cache length
    return dict(batch=args.batch, heads=args.heads, seqlen_q=None if decode else args.seqlen,
                seqlen_kv=args.seqlen_kv or (args.seqlen if decode else None), kv_heads=args.kv_heads)


def kernel_json(spec, batch: int, heads: int, seqlen_q: int | None, seqlen_kv: int | None,
                kv_heads: int | None) -> dict:
    """--json's record of one kernel at one shape (SpecError when it is illegal): what the text's budget, traffic
    and quantization sections say, as numbers."""
    from ..device_limits import H200
    from .quantization import quantization, quantization_dict, tensor_rows
    from .report import explained
    graph, plan, no_plan, t, (nq, nk) = explained(spec, batch, heads, seqlen_q, seqlen_kv, kv_heads, H200)
    p, s, lay = spec.problem, spec.schedule, graph.layout
    fp8 = quantization(spec, lay, batch, heads, kv_heads or heads, nq, nk)
    return {"name": spec.name, "kernel": spec.kernel_name, "family": spec.family.value, "dtype": p.dtype.value,
            "out_dtype": p.output_dtype.value, "head_dim": p.head_dim_qk, "head_dim_v": p.head_dim_v,
            "mask": p.mask.value, "layout": p.seq_layout.value, "tile_q": s.tile_q, "tile_kv": s.tile_kv,
            "shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads or heads, "seqlen_q": nq, "seqlen_kv": nk},
            "smem_bytes": lay.smem_bytes, "threads": lay.threads, "register_estimate": lay.register_estimate,
            "template": plan.template if plan is not None else None, "no_template": no_plan,
            "hbm": {"read_bytes": t.read_bytes, "write_bytes": t.write_bytes, "bytes": t.bytes,
                    "standard_bytes": t.standard_bytes, "flops": t.flops, "flops_executed": t.flops_executed,
                    "tensors": tensor_rows(t, p)},
            "quantization": quantization_dict(fp8) if fp8 else None}


def space_lines(space: SpecSpace, args) -> tuple[list[str], list]:
    """(a space's summary lines, the specs to explain: the model's best, or every legal one with --all)."""
    from .check import space_summary
    from ..schedule.cost import Shape
    legal, rejected = space.expand()
    lines = space_summary(space, legal, rejected, verbose=False)[:-1]
    if args.all or not legal:
        return lines, legal
    decode = space.problem.queries_per_seq
    nq = decode or args.seqlen or 4096
    nk = args.seqlen_kv or args.seqlen or 4096
    # Every config's model walks its own tile table: rank at a shorter sequence when all of them together
    # would be more than a few seconds' work.
    scale = 1
    while sum(tile_pairs(s.schedule.tile_q, s.schedule.tile_kv, nq // scale or 1, nk // scale or 1)
              for s in legal) > RANKING_TILE_PAIRS:
        scale *= 2
    ranked = sorted(((predicted(s, Shape(args.batch, args.heads, max(nq // scale, 1), max(nk // scale, 1))), s)
                     for s in legal), key=lambda item: (item[0].time_ms, item[1].kernel_name))
    ranked = [(p, s) for p, s in ranked if p.hopeless is None] or ranked
    shape = f"seqlen {max(nq // scale, 1)}" + (f", kv {max(nk // scale, 1)}" if nk != nq else "")
    lines.append(f"    the model's best for batch {args.batch}, heads {args.heads}, {shape}"
                 + (f" (--seqlen {nq if not decode else nk} scaled down: {len(legal)} configs' tile tables)"
                    if scale > 1 else "") + " (register estimates, no ptxas):")
    lines += [f"      {i}. {s.kernel_name}: {p.tflops:.0f} TFLOP/s predicted, {p.bound}-bound"
              for i, (p, s) in enumerate(ranked[:BEST_SHOWN], 1)]
    lines.append(f"    explained below: the best; --all explains all {len(legal)} legal configs, `tiledsl tune "
                 f"{space.source_file} --seqlen {nq if not decode else nk} --dry-run` ranks them with ptxas")
    return lines, [ranked[0][1]]


def predicted(spec, shape):
    """The tuner's model on the layout's numbers alone (no lowering, no ptxas): cheap enough for every
    config of a space."""
    from ..families import layout_of
    from ..schedule.cost import Resources, predict
    lay = layout_of(spec)
    return predict(spec, shape, Resources(lay.register_estimate, smem_bytes=lay.smem_bytes, threads=lay.threads,
                                          q_in_registers=lay.q_in_registers))


def model_size(spec, args) -> None:
    """A CliError, before anything is printed, when the shape is more than the models walk in a few seconds."""
    from .report import explained_shape
    nq, nk = explained_shape(spec, **{k: v for k, v in _explain_args(spec, args).items() if k.startswith("seqlen")})
    too_big = model_too_big(spec.schedule.tile_q, spec.schedule.tile_kv, nq, nk)
    if too_big:
        raise CliError(f"explain {spec.name}: {too_big}; give a shorter --seqlen")


def run(args: argparse.Namespace) -> int:
    from .report import explain, to_dot
    from ..schedule.backward import build_backward_graph
    from ..schedule.passes import run_passes

    check_kv_heads(args.heads, args.kv_heads)
    target = output_target("--dot", args.dot, "graphs.dot") if args.dot else None
    if args.html:
        output_target("--html", args.html, "explain.html", make_folders=True)   # the page writer makes them
    items = {path: read_items(path) for path in dict.fromkeys(args.specs)}
    concrete_specs(list(items), args.name, items=items)   # two blocks defining one kernel; --name matching none
    graphs, refused, first, records = [], 0, True, []
    for path, blocks in items.items():
        for item in blocks:
            if args.name is not None and item.name != args.name:
                continue
            specs = [item]
            if isinstance(item, SpecSpace):
                lines, specs = space_lines(item, args)
                if not args.json:
                    print(f"{path}:")
                    print("\n".join(lines))
            for spec in specs:
                model_size(spec, args)
                if not first and not args.json:
                    print("=" * 100)
                first = False
                try:
                    if args.json:
                        records.append(kernel_json(spec, **_explain_args(spec, args)))
                    else:
                        print(explain(spec, summary=args.summary, **_explain_args(spec, args)), end="")
                except SpecError as err:
                    # one refused config of a search space should not hide the others
                    if args.json:
                        records.append({"name": spec.name, "kernel": spec.kernel_name, "error": err.message})
                    else:
                        print(f"{spec.kernel_name}: refused (see stderr)")
                    print(err.render(), file=sys.stderr)
                    refused += 1
                    continue
                if target is not None:
                    graphs.append((spec.kernel_name, to_dot(run_passes(spec))))
                    if spec.backward is not None:
                        graphs.append((f"{spec.kernel_name}_backward", to_dot(build_backward_graph(spec))))
    if target is not None and graphs:
        for path, (_, text) in zip(dot_paths(target, [name for name, _ in graphs]), graphs):
            try:
                path.write_text(text)
            except OSError as err:
                raise CliError(f"--dot {path}: cannot write it ({err.strerror or err})") from None
            print(f"DOT: {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(records, indent=1))
    if args.html:
        from .html import RealShape, write_page
        print(write_page(args.html, args.specs, RealShape(args.batch, args.heads, args.kv_heads, args.seqlen,
                                                          args.seqlen_kv), args.html_seqlen),
              file=sys.stderr if args.json else sys.stdout)   # --json keeps stdout one JSON document
    return 2 if refused else 0
