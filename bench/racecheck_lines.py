"""Racecheck with source lines: runs one small case of the warp-specialized backward or of the `dynamic` tile
scheduler with every kernel compiled with -lineinfo, and writes each kernel's source beside the report, so that a
hazard's `name.cu:LINE` reads as the template's code.

    compute-sanitizer --tool racecheck --racecheck-report hazard python bench/racecheck_lines.py CASE OUTDIR

CASE: ws_ordered_d256 | ws_atomic_d128 | dynamic_scheduler. The sources go to OUTDIR/<kernel>.cu.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    case, out = argv[1], Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TILEDSL_CACHE_DIR"] = tempfile.mkdtemp()   # no cubin compiled without line info is reused
    os.environ["TILEDSL_LINEINFO"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tiledsl.runtime import compile as compiling
    original = compiling.cached_cubin

    def keeping_source(source, name, arch):
        (out / f"{name}.cu").write_text(source)
        return original(source, name, arch)
    from tiledsl.runtime import kernel
    compiling.cached_cubin = kernel.cached_cubin = keeping_source   # backward.py imports it at each first compile
    from tests.test_gpu_backward import check, run
    if case == "ws_ordered_d256":
        check(run("bf16", 256, q_len=145, kv_len=77, window=(30, 5), warp_specialized=True, deterministic=True)[0])
    elif case == "ws_atomic_d128":
        from tests.test_gpu_backward_ws import variant
        check(run("bf16", 128, q_len=200, kv_len=130, causal=True, kernel=variant(128, "atomic"))[0])
    elif case == "dynamic_scheduler":
        from tests.gpu_support import run_case
        from tiledsl.dispatch.tuned import hopper_schedule
        from tiledsl.spec import DType, KernelSpec, LaunchKind, Mask, Problem
        sched = hopper_schedule(128, 64, 2, intra=True, launch=LaunchKind.DYNAMIC)
        spec = KernelSpec("m", Problem(128, 128, DType.BF16, Mask.CAUSAL, 0, 0), sched)
        err = run_case(spec, batch=4, heads=16, q_len=300, kv_len=333, kv_lens=[150, 0, 333, 17])
        assert err[0] < 1e-2 and err[1] < 1e-3, err
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
