"""How good is the tuner's pruning? One GPU call: for each bundled FA2 space (d64 fp16, d128
bf16), seqlen 4096 and 16384, causal and not, a pruned `tune` run and an exhaustive one.

Usage (on the GPU machine, from the repository root):
    python bench/tune_bench.py OUT.json [--quick]

The pruned run goes first, from an empty store, and its seconds are real (ptxas reports,
compiles, checks and timing of its budget). The exhaustive run then shares its store and its
compiled kernels, so it times only the configs the pruned run skipped: each config is timed once
per shape. Rows: space, head_dim, seqlen, causal, configs, timed, winner, winner_tflops,
exhaustive_best_tflops, seconds (+ exhaustive winner, gap). Targets: timed <= 30% of configs,
winner within 3% of the exhaustive best, each pruned run < 3 min. At the end it prints the
dispatch/tuned.py TUNED entries the exhaustive winners suggest (seqlen 16384), to paste after review.
--quick: seqlen 4096 only.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import record
from tiledsl.cli.tune import load_space
from tiledsl.tune.search import Workbench, tune
from tiledsl.schedule.cost import Shape
from tiledsl.tune.bench import prefill_shape
from tiledsl.tune.store import TuneStore

SPACES = ["specs/fa2_space_d64.tile", "specs/fa2_space_d128.tile"]
SEQLENS = [4096, 16384]


def main() -> int:
    out_path = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "tune_bench.json"
    seqlens = SEQLENS[:1] if "--quick" in sys.argv else SEQLENS
    started = time.time()
    bench = Workbench()
    rows, suggestions = [], {}
    with tempfile.TemporaryDirectory(prefix="tiledsl-tune-bench-") as tmp:
        for path in SPACES:
            for causal in (False, True):
                space = load_space(str(ROOT / path), causal)
                for seqlen in seqlens:
                    batch, heads = prefill_shape(seqlen, space.problem.head_dim_qk)
                    shape = Shape(batch, heads, seqlen, seqlen)
                    store = TuneStore(Path(tmp) / f"{space.name}-{causal}-{seqlen}.json")
                    pruned = tune(space, shape, store=store, bench=bench, progress=True)
                    full = tune(space, shape, exhaustive=True, store=store, bench=bench, progress=True)
                    win, best = pruned.winner, full.winner
                    gap = (1 - win.tflops / best.tflops) if win and best else None
                    row = {"space": space.name, "head_dim": space.problem.head_dim_qk, "dtype": space.problem.dtype.value,
                           "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal,
                           "configs": pruned.configs, "legal": len(pruned.candidates), "timed": pruned.timed,
                           "timed_fraction": pruned.timed / pruned.configs,
                           "winner": win.name if win else None, "winner_tflops": win.tflops if win else None,
                           "exhaustive_best": best.name if best else None,
                           "exhaustive_best_tflops": best.tflops if best else None, "gap": gap,
                           "winner_model_rank": win.model_rank if win else None,
                           "best_model_rank": best.model_rank if best else None,
                           "failed": sorted(c.name for c in full.candidates if c.status == "failed"),
                           "seconds": pruned.seconds, "exhaustive_seconds": full.seconds,
                           "all": {c.name: c.tflops for c in full.candidates if c.tflops}}
                    rows.append(row)
                    print(f"{space.name} causal={causal} N={seqlen}: timed {pruned.timed}/{pruned.configs}, "
                          f"winner {row['winner']} {row['winner_tflops'] or 0:.1f} TFLOP/s vs exhaustive "
                          f"{row['exhaustive_best']} {row['exhaustive_best_tflops'] or 0:.1f} "
                          f"(gap {100 * (gap or 0):.1f}%), {pruned.seconds:.0f} s pruned", flush=True)
                    if best and seqlen == seqlens[-1]:
                        s = best.spec.schedule
                        suggestions[(space.problem.dtype.value, space.problem.head_dim_qk, "causal" if causal else "none")] = \
                            f"q{s.tile_q}/kv{s.tile_kv}/{s.warps} warps/{s.stages} stages"
    ok = all(r["timed_fraction"] <= 0.30 and r["gap"] is not None and r["gap"] <= 0.03 and r["seconds"] < 180 for r in rows)
    record(Path(out_path), "python bench/tune_bench.py " + " ".join(sys.argv[1:]), rows,
           seconds=time.time() - started, targets_met=ok, suggested_tuned=[f"{k}: {v}" for k, v in suggestions.items()])
    print("\nsuggested TUNED entries (sm_90, from the exhaustive winners):")
    for key, value in sorted(suggestions.items()):
        print(f"  {key}: {value}")
    print(f"\ntargets {'met' if ok else 'NOT met'}; {time.time() - started:.0f} s in all; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
