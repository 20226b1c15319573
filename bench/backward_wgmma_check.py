"""Quick GPU check of the wgmma backward variants before the long runs: dQ/dK/dV relative errors
against float64 autograd (tests/test_gpu_backward.reference) on a few shapes, and one timing at 4k
next to the mma.sync kernel. Exit status 1 when any error is over the tests' tolerance.

    python bench/backward_wgmma_check.py
"""
from __future__ import annotations

import sys


def main() -> int:
    import torch
    from tests.gpu_support import TOLERANCE_O
    from tests.test_gpu_backward import rel, reference
    from tiledsl.runtime.backward import BackwardKernel
    from tiledsl.lower.backward import lower_backward
    from tiledsl.spec import DType, Mask
    from tiledsl.dispatch.backward import backward_spec
    from tiledsl.tune.backward import backward_flops, time_backward_ms
    from tiledsl.schedule.cost import Shape
    sys.path.insert(0, "bench")
    from backward_ab import variant_spec
    # run 1 (bench/results/2026-12-01-backward-wgmma-check-1.log) had d64 q64 (dQ split by keys) and d128 s1 too
    variants = [(64, (128, 128, 8, 2)), (64, (64, 128, 8, 2)), (128, (64, 128, 8, 2))]
    bad = 0
    for d, tile in variants:
        for causal in (False, True):
            base = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE)
            kern = BackwardKernel(variant_spec(base, tile, "wgmma"), lower_backward(variant_spec(base, tile, "wgmma"), 4))
            for n in (1, 77, 256, 1000):
                torch.manual_seed(n)
                q, k, v, do = (torch.randn(2, 2, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse, *ref = reference(q, k, v, do, causal)
                out = kern(q, k, v, o.to(torch.bfloat16), lse.float(), do)
                torch.cuda.synchronize()
                errors = [rel(x, r) for x, r in zip(out, ref)]
                ok = all(e < TOLERANCE_O for e in errors)
                bad += not ok
                print(f"d{d} q{tile[0]} s{tile[3]} causal={causal} n={n}: {'ok ' if ok else 'BAD'} "
                      + " ".join(f"{e:.2e}" for e in errors), flush=True)
            shape = Shape(4, 2048 // d, 4096, 4096)
            ms = time_backward_ms(kern, shape)
            sync = BackwardKernel(base, lower_backward(base))
            ms_sync = time_backward_ms(sync, shape)
            flops = backward_flops(base, shape)
            print(f"  4k: wgmma {flops / ms / 1e9:.0f} TFLOP/s, mma.sync {flops / ms_sync / 1e9:.0f}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
