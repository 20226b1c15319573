"""The layout's register estimate against ptxas, on the CPU (nvcc only, no GPU): every bundled kernel of
specs/*.tile (backward kernels included), its estimate (layout_of(spec).register_estimate, what check
prints and the Q-in-registers / launch-bounds choices read) next to ptxas's count for sm_90a.

    python bench/register_estimates.py [OUT.json]

Rows: kernel, family, estimate, ptxas, diff (ptxas - estimate), spill_stores. The warp-specialized
families (hopper, the WS backward) report the launch-bound register count (65536 / threads, in steps of
8), not the consumers' setmaxnreg budget, so their rows compare the estimate with that cap.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from tests.test_codegen import generable_specs
    from tiledsl.codegen import nvcc
    from tiledsl.codegen.render import render
    from tiledsl.families import layout_of, lower
    from tiledsl.tune.bench import record
    if nvcc.nvcc_path() is None:
        print("register_estimates: nvcc is not on PATH", file=sys.stderr)
        return 2

    def row(spec):
        plan = lower(spec)
        res = nvcc.resources(render(plan), spec.kernel_name)
        estimate = layout_of(spec).register_estimate
        return {"kernel": spec.kernel_name, "family": spec.kernel_name.split("_")[0], "estimate": estimate,
                "ptxas": res.registers, "diff": res.registers - estimate, "spill_stores": res.spill_stores}
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(row, generable_specs()))
    for r in rows:
        print(f"{r['estimate']:4d} {r['ptxas']:4d} {r['diff']:+5d}  {r['kernel']}")
    within = sum(abs(r["diff"]) <= 8 for r in rows)
    print(f"{within} of {len(rows)} within 8 registers of ptxas; largest gap {max(abs(r['diff']) for r in rows)}")
    if argv:
        record(Path(argv[0]), "python bench/register_estimates.py " + " ".join(argv), rows,
               nvcc=nvcc.version(), within_8=within)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
