"""Compile the kernels of tests/test_gpu_paged_prefill.py and bench/paged_prefill_bench.py into the
NVRTC disk cache with a process pool (the GPU machine's cores), so they do not compile one at a time.

    python bench/prewarm_paged_prefill.py [ARCH]
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
    from bench.paged_prefill_bench import bench_specs
    from tiledsl.serving.prefill import prefill_spec
    from tiledsl.spec import DType, Mask
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90a"
    specs = [prefill_spec(arch, DType.BF16, 128, 128, Mask.CAUSAL, page) for page in (1, 16, 64, 256)]
    specs += [prefill_spec(arch, DType.BF16, 128, 128, Mask.NONE, page) for page in (16, 64)]
    specs += [prefill_spec(arch, DType.BF16, 128, 128, Mask.WINDOW, page, (100, 20)) for page in (16, 64)]
    specs += [prefill_spec(arch, DType.FP16, 64, 64, mask, 16) for mask in (Mask.NONE, Mask.CAUSAL)]
    for _, _, paged, contiguous in bench_specs(arch):
        specs += [paged, contiguous]
    with multiprocessing.get_context("fork").Pool(min(32, multiprocessing.cpu_count())) as pool:
        names = pool.map(_one, [(s, arch) for s in dict.fromkeys(specs)], chunksize=1)
    print(f"prewarmed {len(names)} kernels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
