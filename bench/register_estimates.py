"""The layout's register estimate against ptxas, on the CPU (nvcc only, no GPU): every bundled kernel of
specs/*.tile (the backward modules' main kernels included) and a seeded sample of legal configs of every
family (tests/register_sample.py), each next to ptxas's count for sm_90a and the range the layout says it
lies in (Layout.ptxas_registers: the estimate moved by the family's PTXAS_REGISTER_SPREAD, capped at the
launch bounds' ceiling; a setmaxnreg kernel's ceiling itself).

    python bench/register_estimates.py [--per-family N] [OUT.json]

Rows: kernel, family, what (bundled | the sampled family), estimate, low, high, ceiling, ptxas, diff
(ptxas - estimate), within (low <= ptxas <= high), spill_stores. The summary gives, per family, the
fewest and most registers ptxas used above the estimate (spreads): what PTXAS_REGISTER_SPREAD holds, with a
margin. Exit status 1 when a kernel falls outside its range.
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measured(kernels, workers: int) -> list[dict]:
    from tiledsl.codegen import nvcc

    def row(k):
        res = nvcc.resources(k.source, k.function)
        lay = k.layout
        low, high = lay.ptxas_registers
        return {"kernel": k.function, "family": lay.family, "what": k.what, "estimate": lay.register_estimate,
                "low": low, "high": high, "ceiling": lay.register_ceiling, "ptxas": res.registers,
                "diff": res.registers - lay.register_estimate, "within": low <= res.registers <= high,
                "spill_stores": res.spill_stores}
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(row, kernels))


def spreads(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """Per family, (fewest, most) registers ptxas used above the estimate. A kernel at its ceiling says only
    that ptxas wanted at least that many; one whose estimate is over its ceiling may still be under it.
    Setmaxnreg kernels report their ceiling, whatever the estimate: they are left out."""
    from tiledsl.layout.base import SETMAXNREG_FAMILIES
    found: dict[str, list[int]] = {}
    for r in rows:
        if r["family"] not in SETMAXNREG_FAMILIES:
            found.setdefault(r["family"], []).append(r["diff"])
    return {family: (min(diffs), max(diffs)) for family, diffs in sorted(found.items())}


def main(argv: list[str]) -> int:
    from tests.register_sample import bundled_kernels, sampled_kernels
    from tiledsl.codegen import nvcc
    from tiledsl.tune.bench import record
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="write the rows as JSON here")
    parser.add_argument("--per-family", type=int, default=12, help="sampled legal configs per family")
    args = parser.parse_args(argv)
    if nvcc.nvcc_path() is None:
        print("register_estimates: nvcc is not on PATH", file=sys.stderr)
        return 2
    rows = measured(bundled_kernels() + sampled_kernels(args.per_family), min(4, os.cpu_count() or 2))
    for r in rows:
        mark = " " if r["within"] else "!"
        print(f"{mark} {r['estimate']:4d} {r['ptxas']:4d} {r['diff']:+5d}  [{r['low']}..{r['high']} of {r['ceiling']}]"
              f"  {r['what']:<15} {r['kernel']}")
    within = sum(r["within"] for r in rows)
    print(f"{within} of {len(rows)} within their range")
    for family, (low, high) in spreads(rows).items():
        print(f"  {family:<15} ptxas - estimate: {low:+d}..{high:+d}")
    if args.out:
        record(Path(args.out), "python bench/register_estimates.py " + " ".join(argv), rows,
               nvcc=nvcc.version(), within=within, spreads=spreads(rows))
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
