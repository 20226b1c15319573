"""`tiledsl tune SPACE.tile --seqlen N [--batch B] [--heads H] [--causal | --no-causal] ...`

Searches the space of the (one) attention block in SPACE.tile with `in {...}` choices for the
problem shape, on the GPU in hand, and writes the winner as a concrete spec (`-o`, default
`<space file stem>_tuned.tile` in the current directory). The mask is the space's own unless
--causal (mask = causal) or --no-causal (mask = none) overrides it. --dry-run stops after the
model (no GPU): it prints the predicted ranking and what would be timed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..tune.bench import prefill_shape
from ..frontend.space import SpecSpace
from .common import COUNT, MODEL_SEQLEN
from ..errors import SpecError
from ..frontend.parse import parse_file

if TYPE_CHECKING:
    from ..tune.search import Candidate
    from ..schedule.cost import Shape


class _MaskFlag(argparse.BooleanOptionalAction):
    """--causal / --no-causal, remembering each one given (argparse alone keeps the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.mask_flags = (*namespace.mask_flags, option_string)
        super().__call__(parser, namespace, values, option_string)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("space", help="a .tile file with one attention block holding `in {...}` choices")
    parser.add_argument("--seqlen", type=MODEL_SEQLEN, required=True, help="sequence length (queries = keys)")
    parser.add_argument("--batch", type=COUNT, help="batch (default: 16k tokens in total, as in the papers)")
    parser.add_argument("--heads", type=COUNT, help="heads (default: hidden 2048 / head_dim)")
    parser.add_argument("--causal", action=_MaskFlag, default=None,
                        help="override the space's mask: --causal -> causal, --no-causal -> none")
    parser.set_defaults(mask_flags=())
    parser.add_argument("--budget", type=COUNT, help="configs to time (default: 30%% of the legal ones)")
    parser.add_argument("--exhaustive", action="store_true", help="time every legal config (no model pruning)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="plot TFLOP/s per config (needs matplotlib)")
    parser.add_argument("-o", "--output", metavar="WINNER.tile", help="where to write the winning spec")
    parser.add_argument("--store", metavar="PATH", help="results store (default: $TILEDSL_TUNE_STORE or "
                        "~/.cache/tiledsl/tune.json)")
    parser.add_argument("--fresh", action="store_true", help="time again even where the store has a result")
    parser.add_argument("--dry-run", action="store_true", help="model only, no GPU: print the ranking and stop")


def load_space(path: str, causal: bool | None) -> SpecSpace:
    items = parse_file(path)
    spaces = [item for item in items if isinstance(item, SpecSpace)]
    if len(items) != 1 or not spaces:
        what = "no search space (no `in {...}`)" if not spaces else f"{len(items)} attention blocks"
        raise SpecError(f"{path} holds {what}; tiledsl tune needs exactly one block with `in {{...}}` choices",
                        hint="e.g. `tile q in {64, 128}, kv in {32, 64, 128}`")
    from ..tune.search import with_mask
    return with_mask(spaces[0], causal)


def shape_of(args, space: SpecSpace) -> Shape:
    """The shape tuned for: --seqlen queries and keys, or for a decode space (`queries = N`) N queries
    over --seqlen keys."""
    from ..schedule.cost import Shape
    batch, heads = prefill_shape(args.seqlen, space.problem.head_dim_qk)   # the options are >= 1 (argparse)
    queries = space.problem.queries_per_seq or args.seqlen
    return Shape(args.batch or batch, args.heads or heads, queries, args.seqlen)


def check_options(args) -> None:
    """Options that contradict each other, or that a dry run would ignore, are refused (argparse
    alone keeps the last of --causal / --no-causal and ignores the rest)."""
    from ..errors import CliError
    if len(set(args.mask_flags)) > 1:
        raise CliError("--causal and --no-causal contradict each other: give one (or neither: the space's mask)")
    if args.exhaustive and args.budget is not None:
        raise CliError(f"--budget {args.budget} and --exhaustive contradict each other: --exhaustive times every "
                       "legal config")
    if args.dry_run:
        ignored = [flag for flag, value in (("--plot", args.plot), ("-o", args.output), ("--store", args.store),
                                            ("--fresh", args.fresh)) if value]
        if ignored:
            raise CliError(f"--dry-run times nothing and writes nothing: {', '.join(ignored)} would be ignored")


def short(c: Candidate) -> str:
    s = c.spec.schedule
    if c.spec.family.value == "hopper":   # its warps follow from the warpgroups; the switches tell configs apart
        flags = "".join(f" {flag}" for flag, on in (("pingpong", s.pingpong), ("intra", s.intra_overlap)) if on)
        flags += f" {s.launch.value}" if s.launch else ""
        flags += f" {s.item_order.value}" if s.item_order else ""
        return (f"hopper q{s.tile_q} kv{s.tile_kv} c{s.consumer_warpgroups} p{s.producer_regs}/c{s.consumer_regs} "
                f"s{s.stages}{flags}")
    return (f"{c.spec.family.value} q{s.tile_q} kv{s.tile_kv} w{s.warps} s{s.stages}"
            + (" wgmma" if s.mma.value == "wgmma" else "") + (f" split{s.split_kv}" if s.split_kv != 1 else ""))


def rows_of(candidates: list[Candidate], label=short) -> list[dict]:
    """One dict per config: measured ones by speed, then the rest by model rank."""
    def order(c):
        measured = c.tflops is not None and c.status in ("timed", "stored")
        return (not measured, -(c.tflops or 0), c.model_rank or 10**9, c.name)
    rows = []
    for c in sorted(candidates, key=order):
        p, r = c.prediction, c.resources
        rows.append({"kernel": c.name, "config": label(c), "status": c.status, "reason": c.reason,
                     "ms": c.ms, "tflops": c.tflops, "model_rank": c.model_rank,
                     "predicted_ms": p.time_ms if p else None, "predicted_tflops": p.tflops if p else None,
                     "registers": r.registers if r else None, "spills": r.spill_stores if r else None,
                     "resources_from": r.source if r else None, "blocks_per_sm": p.blocks_per_sm if p else None,
                     "bound": p.bound if p else None, "errors": c.errors})
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    """The rows as a table whose columns line up whatever the labels' lengths; registers read from
    the plan's estimate (no nvcc) are marked ~ and the table says so."""
    width = max([len("config")] + [len(r["config"]) for r in rows])
    head = f"{'#':>3} {'config':<{width}} {'ms':>8} {'TFLOP/s':>8} | {'model#':>6} {'pred ms':>8} {'pred TF':>8} " \
           f"{'regs':>4} {'spill B':>7} {'blk/SM':>6}  status"
    lines = [head, "-" * len(head)]
    place = 0
    for r in rows:
        measured = r["tflops"] is not None and r["status"] in ("timed", "stored")
        place += measured
        status = r["status"] + (f": {r['reason']}" if r["reason"] and r["status"] != "stored" else "")
        registers = _fmt(r["registers"], "d")
        if r["resources_from"] == "estimate":
            registers = "~" + registers
        lines.append(f"{(place if measured else ''):>3} {r['config']:<{width}} {_fmt(r['ms'], '.3f'):>8} "
                     f"{_fmt(r['tflops'], '.1f'):>8} | {_fmt(r['model_rank'], 'd'):>6} "
                     f"{_fmt(r['predicted_ms'], '.3f'):>8} "
                     f"{_fmt(r['predicted_tflops'], '.1f'):>8} {registers:>4} "
                     f"{_fmt(r['spills'], 'd'):>7} "
                     f"{_fmt(r['blocks_per_sm'], 'd'):>6}  {status}")
    if any(r["resources_from"] == "estimate" for r in rows):
        lines.append("~ registers: the plan's estimate, not ptxas's count (no nvcc here; spills unknown)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--plot needs matplotlib", hint="pip install 'tiledsl[plot]' (or leave out --plot)") from None
    shown = [r for r in rows if r["predicted_tflops"] is not None or r["tflops"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(shown)), 4.5))
    xs = range(len(shown))
    measured = [r["tflops"] if r["status"] in ("timed", "stored") else 0 for r in shown]
    ax.bar(xs, measured, color="tab:blue", label="measured")
    ax.scatter(xs, [r["predicted_tflops"] or 0 for r in shown], color="tab:orange", marker="_", s=200, zorder=3,
               label="model")
    for x, r in zip(xs, shown):
        if r["status"] in ("pruned", "hopeless", "failed"):
            ax.annotate({"pruned": "pruned", "hopeless": "hopeless", "failed": "FAILED"}[r["status"]], (x, 2),
                        rotation=90, ha="center", va="bottom", fontsize=7, color="gray")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["config"] for r in shown], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    from ..tune.search import plan_candidates, spec_to_dsl, tune
    from ..tune import backward as tune_backward
    check_options(args)
    space = load_space(args.space, args.causal)
    shape = shape_of(args, space)
    from ..schedule.traffic import model_too_big
    from ..errors import CliError
    for spec in space.expand()[0]:   # the model walks each config's tile table: refuse before any work
        too_big = model_too_big(spec.schedule.tile_q, spec.schedule.tile_kv, shape.seqlen_q, shape.seqlen_kv)
        if too_big:
            raise CliError(f"tune {spec.kernel_name}: {too_big}; give a shorter --seqlen")
    backward = tune_backward.is_backward_space(space)   # choices inside `backward { }`: search the backward module
    plan_candidates = tune_backward.plan_backward_candidates if backward else plan_candidates
    tune = tune_backward.tune_backward if backward else tune
    label = tune_backward.label if backward else short
    title = (f"{space.name} {space.problem.mask.value} d{space.problem.head_dim_qk} {space.problem.dtype.value}"
             f"{' backward' if backward else ''}: batch {shape.batch}, heads {shape.heads}, seqlen {shape.seqlen_q}"
             + (f" queries over {shape.seqlen_kv} keys" if shape.seqlen_kv != shape.seqlen_q else ""))
    if args.dry_run:
        candidates, rejected, budget = plan_candidates(space, shape, budget=args.budget, exhaustive=args.exhaustive,
                                                       progress=not args.json)
        rows = rows_of(candidates, label)
        if args.json:
            print(json.dumps({"space": space.name, "shape": shape.key(), "configs": len(candidates) + len(rejected),
                              "legal": len(candidates), "budget": budget, "rows": rows}, indent=1))
        else:
            would = sum(c.status == "pending" for c in candidates)
            print(f"{title}\n{len(candidates) + len(rejected)} configs, {len(rejected)} rejected by the checker, "
                  f"{len(candidates)} legal; would time {would} (budget {budget}); dry run: nothing timed\n")
            print(table(rows))
        return 0
    from .common import gpu_ready
    from ..spec import DType
    gpu_ready("tune", [], torch_for="" if space.problem.dtype is DType.FP16 else
              f"tiledsl tune of {space.problem.dtype.value} kernels (CuPy has no bfloat16 inputs)")
    from ..tune.store import TuneStore
    store = TuneStore(args.store)
    result = tune(space, shape, budget=args.budget, exhaustive=args.exhaustive, store=store,
                  progress=not args.json, fresh=args.fresh)
    rows = rows_of(result.candidates, label)
    winner = result.winner
    output = Path(args.output or f"{Path(args.space).stem}_tuned.tile")
    if winner is not None:
        note = (f"Tuned by `tiledsl tune` on {result.gpu} for batch {shape.batch}, heads {shape.heads}, seqlen "
                f"{shape.seqlen_q}" + (f" (keys {shape.seqlen_kv})" if shape.seqlen_kv != shape.seqlen_q else "")
                + f":\n{winner.tflops:.1f} TFLOP/s ({winner.ms:.3f} ms); timed "
                f"{result.timed + result.from_store}"
                f" of {len(result.candidates)} legal configs of {args.space}.")
        output.write_text(spec_to_dsl(winner.spec, f"{space.name}_tuned", note))
    if args.plot:
        plot(rows, args.plot, title)
    if args.json:
        print(json.dumps({"space": space.name, "shape": shape.key(), "gpu": result.gpu, "toolchain": result.toolchain,
                          "configs": result.configs, "legal": len(result.candidates), "budget": result.budget,
                          "timed": result.timed, "from_store": result.from_store, "seconds": result.seconds,
                          "winner": winner.name if winner else None, "winner_tflops": winner.tflops if winner else None,
                          "output": str(output) if winner else None, "rows": rows}, indent=1))
    else:
        print(f"\n{title}\n{result.configs} configs, {len(result.rejected)} rejected by the checker, "
              f"{len(result.candidates)} legal; budget {result.budget}; timed {result.timed}, "
              f"{result.from_store} answered from the store {store.path}"
              + (" (no timing: use --fresh to time again)" if result.timed == 0 and result.from_store else "")
              + f"; {result.seconds:.1f} s\n")
        print(table(rows))
        if winner:
            print(f"\nwinner: {winner.name} {winner.tflops:.1f} TFLOP/s -> {output}")
    if winner is None:
        print("error: no config passed its correctness check; nothing written", file=sys.stderr)
        return 1
    return 0
