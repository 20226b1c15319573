"""Backward TFLOP/s on the GPU: tiledsl.dispatch.backward (a few tile variants) against torch SDPA's flash
backward, measured in the same process. Backward FLOPs = 2.5 x forward (4 B H Nq Nk d), causal halved.

    python bench/backward_variants.py OUT.json [--seqlen 4096]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys


def timed(fn, warmup=3, reps=10):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tiledsl.runtime.backward import BackwardKernel
    from tiledsl.dispatch.backward import backward_spec
    from tiledsl.lower.backward import lower_backward
    from tiledsl.spec import BackwardSchedule, DqAccumulate, DType, KernelSpec, LoopOrder, Mask
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    variants = {64: [(64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (32, 128, 8, 2)],
                128: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 1)]}
    rows = []
    for d in (64, 128):
        heads = 2048 // d
        for n in args.seqlen:
            batch = max(1, args.tokens // n)
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 2.5 * 4 * batch * heads * n * n * d / (2 if causal else 1)
                qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    t_sdpa = timed(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
                import tiledsl
                o, lse = tiledsl.attention(q, k, v, causal=causal, return_lse=True)
                row = {"kernel": "", "family": "backward kv-outer mma.sync", "dtype": "bf16", "head_dim": d,
                       "seqlen": n, "batch": batch, "heads": heads, "causal": causal, "tflops": {},
                       "peers": {"sdpa_flash_backward": flops / t_sdpa / 1e12}}
                mask = Mask.CAUSAL if causal else Mask.NONE
                base = backward_spec("sm_90a", DType.BF16, d, mask)
                for det in (False, True):
                    for tq, tk, w, s in variants[d][: (4 if not det else 1)]:
                        b = BackwardSchedule(LoopOrder.KV_OUTER, tq, tk, w, s,
                                             dq=DqAccumulate.SEPARATE if det else base.backward.dq)
                        spec = KernelSpec(base.name, base.problem, base.schedule, backward=b)
                        name = f"q{tq}_kv{tk}_w{w}_s{s}" + ("_separate" if det else "_atomic")
                        try:
                            kern = BackwardKernel(spec, lower_backward(spec))
                            t = timed(lambda: kern(q, k, v, o, lse, do))
                            row["tflops"][name] = flops / t / 1e12
                        except Exception as err:
                            row["tflops"][name] = f"error: {str(err)[:200]}"
                        if spec == base:
                            row["kernel"] = kern.name
                print(json.dumps(row), flush=True)
                rows.append(row)
                del out, qg, kg, vg
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "commit": commit,
              "command": "python bench/backward_bench.py " + " ".join(sys.argv[1:]), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
