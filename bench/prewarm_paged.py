"""Compile the paged / decode-sweep kernels of tests/test_gpu_paged.py into the NVRTC disk cache
with a process pool (the GPU machine's cores), so the tests do not compile one at a time.

    python bench/prewarm_paged.py [ARCH]
"""
from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _one(args):
    spec, arch = args
    from tiledsl.families import lower
    from tiledsl.codegen.render import render
    from tiledsl.runtime.compile import compile_cubin
    plan = lower(spec)
    compile_cubin(render(plan), plan.kernel_name, arch)
    return plan.kernel_name


def main() -> int:
    from dataclasses import replace
    from tests.test_gpu_paged import sweep_specs
    from tiledsl.serving.paged import paged_spec
    from tiledsl.spec import DType, Mask
    from tiledsl.frontend.parse import load_specs
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90a"
    specs = sweep_specs()
    for dtype in (DType.BF16, DType.FP16):
        for page in (1, 16, 64, 256):
            for q_len in (1, 4, 16):
                specs.append(paged_spec(dtype, 128, 128, Mask.CAUSAL if q_len > 1 else Mask.NONE, page, q_len))
    specs += [paged_spec(DType.BF16, 64, 64, Mask.WINDOW, page, 4, window=(300, 0)) for page in (16, 256)]
    specs += [paged_spec(DType.BF16, 128, 128, Mask.CAUSAL, 16, 4), paged_spec(DType.BF16, 64, 64, Mask.NONE, 16, 1)]
    bundled = load_specs(str(ROOT / "specs" / "decode_d128.tile"))[0]
    specs.append(replace(bundled, problem=replace(bundled.problem, kv_page_size=16)))
    with multiprocessing.get_context("fork").Pool(min(32, multiprocessing.cpu_count())) as pool:
        names = pool.map(_one, [(s, arch) for s in dict.fromkeys(specs)], chunksize=1)
    print(f"prewarmed {len(names)} kernels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
