"""Print a results JSON (bench/results/*.json) as the markdown table the README shows:
the best kernel per shape next to the peers measured in the same run, and, when the run timed
both tensor-core instructions, the best mma.sync kernel's TFLOP/s beside the winner.

Usage: python bench/table.py bench/results/FILE.json"""
from __future__ import annotations

import json
import sys


def best_rows(rows, keep=lambda row: True) -> dict:
    best: dict = {}
    for row in rows:
        if "tflops" not in row or not row.get("valid", True) or not keep(row):
            continue
        key = (row["head_dim"], row["causal"], row["seqlen"])
        if key not in best or row["tflops"] > best[key]["tflops"]:
            best[key] = row
    return best


def main(path: str) -> None:
    result = json.load(open(path))
    best = best_rows(result["rows"])
    sync = best_rows(result["rows"], lambda row: not row["kernel"].endswith("_wgmma"))
    both = sync and any(row["kernel"].endswith("_wgmma") for row in result["rows"])
    print(f"Measured {result['date'][:10]} on {result['gpu']}, commit {result['commit'][:10]}, `{result['command']}`.\n")
    extra = (" best mma.sync |", "---|") if both else ("", "")
    print(f"| head dim | seqlen | causal | tiledsl kernel | TFLOP/s |{extra[0]} SDPA flash | SDPA cuDNN | vs flash | vs cuDNN |")
    print(f"|---|---|---|---|---|{extra[1]}---|---|---|---|")
    for key, row in sorted(best.items()):
        d, causal, n = key
        flash, cudnn = row["peers"].get("sdpa_flash"), row["peers"].get("sdpa_cudnn")
        column = f" {sync[key]['tflops']:.0f} |" if both and key in sync else (" - |" if both else "")
        print(f"| {d} | {n} | {'yes' if causal else 'no'} | `{row['kernel']}` | {row['tflops']:.0f} |{column} "
              f"{flash:.0f} | {cudnn:.0f} | {row['tflops'] / flash:.2f}× | {row['tflops'] / cudnn:.2f}× |")


if __name__ == "__main__":
    main(sys.argv[1])
