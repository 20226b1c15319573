"""GPU kernel time (torch.profiler, device side only) of the backward at 1k tokens per sequence, 16
sequences, hidden 2048, bf16: tiledsl's modules (preprocess + main + convert, via attention_backward)
next to SDPA flash's and cuDNN's backward kernels, so that host-side launch overhead (which the
end-to-end bench/backward_bench.py rows at 1k include) is left out. Also the wall-clock ms per
attention_backward call with the GPU already busy (host submission cost).

    python bench/backward_profile_small.py [OUT.json]
"""
from __future__ import annotations

import json
import sys
import time


def device_ms(torch, fn, calls=20) -> tuple[float, dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        us = getattr(e, "device_time_total", None)
        us = getattr(e, "cuda_time_total", 0) if us is None else us
        if e.device_type.name == "CUDA" and us > 0 and "Memset" not in e.name and "Memcpy" not in e.name:
            kernels[e.name[:80]] = kernels.get(e.name[:80], 0.0) + us / 1000.0 / calls
    return sum(kernels.values()), kernels


def main() -> int:
    import torch
    import tiledsl
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from tiledsl.dispatch.backward import attention_backward
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            heads, n, batch = 2048 // d, 1024, 16
            flops = 2.5 * 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
            q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = tiledsl.attention(q, k, v, causal=causal, return_lse=True)
            row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": batch, "heads": heads}
            ms, parts = device_ms(torch, lambda: attention_backward(q, k, v, o, lse, do, causal=causal))
            row["tiledsl_device_ms"], row["tiledsl_kernels_ms"] = ms, parts
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                attention_backward(q, k, v, o, lse, do, causal=causal)
            row["tiledsl_host_ms_per_call"] = (time.perf_counter() - start) * 1000 / 50
            torch.cuda.synchronize()
            for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
                with sdpa_kernel([backend]):
                    out = sdpa(qg, kg, vg, is_causal=causal)
                ms, _ = device_ms(torch, lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
                row[label + "_device_ms"] = ms
            row["tflops_device"] = {key[:-10]: flops / row[key] / 1e9 for key in row if key.endswith("_device_ms")}
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                              if k != "tiledsl_kernels_ms"}), flush=True)
            rows.append(row)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"date": "2026-12-01", "gpu": torch.cuda.get_device_name(),
                       "command": "python bench/backward_profile_small.py OUT.json", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
