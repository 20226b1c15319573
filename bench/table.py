"""Print a results JSON (bench/results/*.json) as the markdown table the README shows:
the best kernel per shape next to the peers measured in the same run.

Usage: python bench/table.py bench/results/FILE.json"""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    result = json.load(open(path))
    best: dict = {}
    for row in result["rows"]:
        if "tflops" not in row or not row.get("valid", True):
            continue
        key = (row["head_dim"], row["causal"], row["seqlen"])
        if key not in best or row["tflops"] > best[key]["tflops"]:
            best[key] = row
    print(f"Measured {result['date'][:10]} on {result['gpu']}, commit {result['commit'][:10]}, `{result['command']}`.\n")
    print("| head dim | seqlen | causal | tiledsl kernel | TFLOP/s | SDPA flash | SDPA cuDNN | vs flash | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (d, causal, n), row in sorted(best.items()):
        flash, cudnn = row["peers"].get("sdpa_flash"), row["peers"].get("sdpa_cudnn")
        print(f"| {d} | {n} | {'yes' if causal else 'no'} | `{row['kernel']}` | {row['tflops']:.0f} | "
              f"{flash:.0f} | {cudnn:.0f} | {row['tflops'] / flash:.2f}× | {row['tflops'] / cudnn:.2f}× |")


if __name__ == "__main__":
    main(sys.argv[1])
