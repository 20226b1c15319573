"""A/B of backward variants in ONE GPU call: each variant is checked against float64 autograd on a
small shape (tune_backward.check_backward; a wrong one is reported and not timed), then timed with
SDPA's flash and cuDNN backward in the same process, bf16, d 64/128, seqlen 1k-16k (16k tokens
per shape), causal and not. The lead picks winners into backward.BACKWARD_TUNED from the JSON.

    python bench/backward_ab.py OUT.json [--seqlen 1024 4096 16384] [--heads-dims 64 128]

Variants: "current" = main's tuned config with v2 dQ atomics (what shipped before this change);
the rest use v4 dQ atomics unless named _v2; wgmma_* are templates/backward_wgmma.cu.j2's main kernel
(two warpgroups x 64 keys). TFLOP/s = 2.5 x forward FLOPs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time

# (name, (tile q, tile kv, warps, stages), dq_vector, mma, wgmma lowering options)
# wgmma options (lower_backward_wgmma): dv_order early | late, dv_waited, dq_staged; unnamed = layout's choice.
VARIANTS = {
    64: [("current_q128_kv128_w8_s2_v2", (128, 128, 8, 2), 2, "mma.sync", {}),
         ("wgmma_q128_early", (128, 128, 8, 2), 4, "wgmma", {"dv_order": "early", "dv_waited": True}),
         ("wgmma_q128", (128, 128, 8, 2), 4, "wgmma", {}),
         ("wgmma_q128_s3", (128, 128, 8, 3), 4, "wgmma", {})],
    128: [("current_q64_kv128_w8_s2_v2", (64, 128, 8, 2), 2, "mma.sync", {}),
          ("wgmma_q64_early", (64, 128, 8, 2), 4, "wgmma", {"dv_order": "early"}),
          ("wgmma_q64", (64, 128, 8, 2), 4, "wgmma", {}),
          ("wgmma_q64_s3", (64, 128, 8, 3), 4, "wgmma", {})],
}


def variant_spec(base, tile, mma):
    from tiledsl.spec import BackwardSchedule, DqAccumulate, KernelSpec, LoopOrder, Mma
    return KernelSpec(base.name, base.problem, base.schedule,
                      backward=BackwardSchedule(LoopOrder.KV_OUTER, *tile, mma=Mma(mma), dq=DqAccumulate.ATOMIC))


def peers(q, k, v, do, causal):
    """Median ms of SDPA flash and cuDNN backward (autograd.grad of a retained graph)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tiledsl.tune.bench import time_ms
    out = {}
    for label, backend in (("sdpa_flash_backward", SDPBackend.FLASH_ATTENTION),
                           ("sdpa_cudnn_backward", SDPBackend.CUDNN_ATTENTION)):
        try:
            qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            with sdpa_kernel([backend]):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            out[label] = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
        except Exception as err:   # a backend that refuses the shape is recorded as missing
            out[label], out[label + "_error"] = None, str(err).splitlines()[0][:200]
    return out


def main() -> int:
    import torch
    import tiledsl
    from tiledsl.runtime.backward import BackwardKernel
    from tiledsl.dispatch.backward import backward_spec
    from tiledsl.lower.backward import lower_backward
    from tiledsl.spec import DType, Mask
    from tiledsl.tune.backward import backward_flops, check_backward, time_backward_ms
    from tiledsl.schedule.cost import Shape
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--commit", default="")
    ap.add_argument("--commit-note", default="")
    args = ap.parse_args()
    started = time.time()
    kernels, checks = {}, {}
    from concurrent.futures import ThreadPoolExecutor
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    built = []
    for d in args.head_dims:   # NVRTC in threads first (cubins are cached on disk; functions() then only loads)
        for causal in (False, True):
            base = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE)
            for name, tile, vector, mma, options in VARIANTS[d]:
                spec = variant_spec(base, tile, mma)
                plan = lower_backward(spec, dq_vector=vector, **options)
                built.append((BackwardKernel(spec, plan).source, plan.kernel_name))
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, src, name, device_arch()) for src, name in built]:
            f.exception()   # failures show again (with the message) when the variant is checked
    print(f"compiled {len(built)} modules in {time.time() - started:.0f} s", flush=True)
    for d in args.head_dims:   # build and check every variant first (small shape, float64 autograd)
        for causal in (False, True):
            base = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE)
            for name, tile, vector, mma, options in VARIANTS[d]:
                spec = variant_spec(base, tile, mma)
                try:
                    kern = BackwardKernel(spec, lower_backward(spec, dq_vector=vector, **options))
                    ok, errors, why = check_backward(kern)
                except Exception as err:
                    kern, ok, errors, why = None, False, {}, f"build: {str(err).splitlines()[0][:200]}"
                kernels[d, causal, name], checks[d, causal, name] = (kern if ok else None), {"ok": ok, "errors": errors,
                                                                                          "why": why}
                print(f"check d{d} causal={causal} {name}: {'ok' if ok else why} {errors}", flush=True)
    rows = []
    for d in args.head_dims:
        heads = 2048 // d
        for n in args.seqlen:
            batch = max(1, args.tokens // n)
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                o, lse = tiledsl.attention(q, k, v, causal=causal, return_lse=True)
                shape = Shape(batch, heads, n, n)
                base = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE)
                flops = backward_flops(base, shape)
                row = {"kernel": base.kernel_name, "family": "backward kv-outer (mma.sync, wgmma_*)", "dtype": "bf16", "head_dim": d,
                       "seqlen": n, "batch": batch, "heads": heads, "causal": causal, "tflops": {}, "checks": {},
                       "peers": {}}
                for label, ms in peers(q, k, v, do, causal).items():
                    row["peers"][label] = flops / ms / 1e9 if isinstance(ms, float) else ms
                for name, *_ in VARIANTS[d]:
                    kern = kernels[d, causal, name]
                    row["checks"][name] = checks[d, causal, name]
                    if kern is None:
                        row["tflops"][name] = "not timed: " + checks[d, causal, name]["why"]
                        continue
                    row["tflops"][name] = flops / time_backward_ms(kern, shape, (o, lse)) / 1e9
                flash = row["peers"].get("sdpa_flash_backward")
                if isinstance(flash, float):
                    row["vs_flash"] = {k: t / flash for k, t in row["tflops"].items() if isinstance(t, float)}
                print(json.dumps({k: row[k] for k in ("head_dim", "seqlen", "causal", "tflops", "peers")}), flush=True)
                rows.append(row)
                del q, k, v, do, o, lse
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "commit": commit,
              "commit_note": args.commit_note,
              "command": "python bench/backward_ab.py " + " ".join(sys.argv[1:]), "seconds": time.time() - started,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
