"""Which kernels PyTorch SDPA's cuDNN backend launches for the issue's decode shapes: name, grid,
block, shared memory, registers and duration, from a torch.profiler trace (a probe; nothing ships).

Usage: python bench/experiments/cudnn_decode_kernels.py OUT.json"""
from __future__ import annotations

import json
import sys
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

from tiledsl.tune.bench import record

SHAPES = [(1, 32, 32, 32768), (4, 32, 8, 65536), (8, 32, 32, 8192), (1, 32, 32, 131072)]


def main(out_path: str) -> None:
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(3):
                sdpa(q, k, v, enable_gqa=heads != kv_heads)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    sdpa(q, k, v, enable_gqa=heads != kv_heads)
                torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            prof.export_chrome_trace(trace.name)
            events = json.load(open(trace.name))["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel"]
        seen = []
        for e in kernels[-len(kernels) // 3:]:   # the last call
            args = e.get("args", {})
            seen.append({"name": e["name"][:160], "us": e.get("dur"), "grid": args.get("grid"), "block": args.get("block"),
                         "shared_bytes": args.get("shared memory"), "registers": args.get("registers per thread"),
                         "blocks_per_sm": args.get("blocks per SM"), "occupancy": args.get("est. achieved occupancy %")})
        print(f"b{batch} h{heads}/{kv_heads} n{kv_len}:", flush=True)
        for s in seen:
            print("   ", s, flush=True)
        rows.append({"batch": batch, "heads": heads, "kv_heads": kv_heads, "kv_len": kv_len, "kernels": seen})
        del q, k, v
        torch.cuda.empty_cache()
    record(out_path, "python bench/experiments/cudnn_decode_kernels.py OUT", rows)


if __name__ == "__main__":
    main(sys.argv[1])
