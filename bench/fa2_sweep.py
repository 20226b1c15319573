"""One GPU call: ceilings, FA2 variants validated against float64, then timed next to SDPA.

Usage (on the GPU machine): python bench/fa2_sweep.py OUT.json [--quick]
"""
from __future__ import annotations

import sys
import time

import torch

from tiledsl.tune.bench import attention_flops, prefill_shape, record, sdpa_peers, time_ms
from tiledsl import compile
from tiledsl.spec import DType, KernelSpec, Mask, Problem, Schedule
from tiledsl.reference.gpu import run_errors

VARIANTS = {  # head dim -> (tile q, tile kv, warps, stages); sweep 3: 32-row warps now spill-free at d128
    64: [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 4, 3)],
    128: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 2)],
}
SEQLENS = [1024, 4096, 8192, 16384]


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = time_ms(lambda: a @ b)
    x = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cp = time_ms(lambda: y.copy_(x))
    return {"matmul_tflops": 2 * 8192**3 / mm / 1e9, "copy_tbps": 2 * x.numel() * 2 / cp / 1e9}


def validate(kernel: Kernel, causal: bool) -> dict:
    errors = {}
    for q_len, kv_len, heads, kv_heads in ((1000, 1000, 4, 2), (300, 1000, 4, 4), (1000, 17, 2, 1)):
        q = torch.randn(2, heads, q_len, kernel.spec.problem.head_dim_qk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, kv_heads, kv_len, kernel.spec.problem.head_dim_qk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, kv_heads, kv_len, kernel.spec.problem.head_dim_v, device="cuda", dtype=torch.bfloat16)
        errors[f"{q_len}x{kv_len}"] = run_errors(kernel, q, k, v)
    return errors


def main() -> None:
    out_path, quick = sys.argv[1], "--quick" in sys.argv
    started = time.time()
    info = ceilings()
    print(f"ceilings: {info}", flush=True)
    rows = []
    peers_cache = {}
    for d, variants in VARIANTS.items():
        for causal in (False, True):
            for tq, tkv, w, st in variants:
                spec = KernelSpec(f"sweep_d{d}", Problem(d, d, DType.BF16, Mask.CAUSAL if causal else Mask.NONE),
                                  Schedule(tile_q=tq, tile_kv=tkv, warps=w, stages=st))
                kernel = compile(spec)
                try:
                    errs = validate(kernel, causal)
                except Exception as err:
                    print(f"{kernel.name}: FAILED {err}", flush=True)
                    rows.append({"kernel": kernel.name, "error": str(err)[:2000]})
                    continue
                ok = all(e[0] < 1e-2 and e[1] < 1e-3 for e in errs.values())
                print(f"{kernel.name}: errors {errs} {'ok' if ok else 'WRONG'}", flush=True)
                for seqlen in SEQLENS[:2] if quick else SEQLENS:
                    batch, heads = prefill_shape(seqlen, d)
                    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    ms = time_ms(lambda: kernel(q, k, v))
                    key = (d, causal, seqlen)
                    if key not in peers_cache:
                        peers_cache[key] = sdpa_peers(q, k, v, causal)
                    peers = peers_cache[key]
                    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
                    tflops = flops / ms / 1e9
                    peer_tflops = {n: (flops / t / 1e9 if isinstance(t, float) else None) for n, t in peers.items() if not n.endswith("_error")}
                    rows.append({"kernel": kernel.name, "family": "fa2", "dtype": "bf16", "head_dim": d, "seqlen": seqlen,
                                 "batch": batch, "heads": heads, "causal": causal, "tflops": tflops, "valid": ok,
                                 "errors": {k2: list(e) for k2, e in errs.items()}, "peers": peer_tflops,
                                 "registers_estimate": kernel.plan.register_estimate})
                    print(f"  d={d} causal={causal} N={seqlen}: {tflops:6.1f} TFLOP/s  peers {peer_tflops}", flush=True)
    record(out_path, "python bench/fa2_sweep.py", rows, ceilings=info, seconds=time.time() - started)


if __name__ == "__main__":
    main()
