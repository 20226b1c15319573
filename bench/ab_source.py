"""A/B of a one-line change to the generated CUDA, in one GPU run: each case times the bundled
kernel and the patched kernel alternately (base, patch, ..., base) so the spread of the two base
runs shows the noise. The patches here are experiments, not product code.

A patch whose target is no longer in the generated CUDA stops the run (tiledsl.tune.bench.patch_source).
The tile_skip experiment (results/2026-11-30-ab-tile-skip.json) was dropped: its target, the
per-warp tile skip, is gone from the template, so it timed two identical kernels.

Usage: python bench/ab_source.py OUT.json [l2_prefetch]"""
from __future__ import annotations

import sys

import torch

from tiledsl.tune.bench import attention_flops, patch_source, prefill_shape, record, time_ms
from tiledsl.frontend.parse import load_spec
from tiledsl import compile
from tiledsl.reference.gpu import run_errors

CP_ASYNC = "cp.async.cg.shared.global [%0]"
EXPERIMENTS = {
    "l2_prefetch": {"base": None,
                    "l2_128": (CP_ASYNC, "cp.async.cg.shared.global.L2::128B [%0]"),
                    "l2_256": (CP_ASYNC, "cp.async.cg.shared.global.L2::256B [%0]")},
}
PREFILL = {"l2_prefetch": [("specs/fa2_d128_causal.tile", 4096), ("specs/fa2_d128.tile", 4096), ("specs/fa2_d64_causal.tile", 4096)]}


def variant(spec, patch):
    kernel = compile(spec)
    if patch:
        patch_source(kernel, [patch])   # the cubin cache is keyed by the source, so no name change is needed
    return kernel


def check(kernel, spec):
    p = spec.problem
    nq = p.queries_per_seq or 300
    q = torch.randn(2, 8, nq, p.head_dim_qk, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2 if p.queries_per_seq else 8, 1000, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return run_errors(kernel, q, k, v)[0]


def main(out_path: str, experiment: str) -> None:
    rows, patches = [], EXPERIMENTS[experiment]
    for path, n in PREFILL[experiment]:
        spec = load_spec(path)
        d = spec.problem.head_dim_qk
        b, h = prefill_shape(n, d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = attention_flops(b, h, n, n, d, spec.problem.mask.value == "causal")
        for rep in range(2):
            for name, patch in patches.items():
                kernel = variant(spec, patch)
                err = check(kernel, spec)
                tf = flops / time_ms(lambda: kernel(q, k, v)) / 1e9
                rows.append({"case": f"{spec.name} N={n}", "variant": name, "rep": rep, "tflops": tf, "error": err})
                print(f"{spec.name:18s} N={n} {name:7s} rep{rep}: {tf:6.1f} TFLOP/s (err {err:.1e})", flush=True)
    if experiment != "l2_prefetch":
        record(out_path, f"python bench/ab_source.py OUT {experiment}", rows)
        return
    spec = load_spec("specs/decode_d128.tile")
    for batch, heads, kv_heads, kv_len in [(1, 32, 32, 32768), (4, 32, 8, 65536)]:
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        for rep in range(2):
            for name, patch in patches.items():
                kernel = variant(spec, patch)
                err = check(kernel, spec)
                run, _, _ = kernel.bind(q, k, v)
                gbps = nbytes / time_ms(run) / 1e6
                rows.append({"case": f"decode b{batch} h{heads}/{kv_heads} n{kv_len}", "variant": name, "rep": rep,
                             "gbps": gbps, "error": err})
                print(f"decode b{batch} {kv_heads}kv n{kv_len} {name:7s} rep{rep}: {gbps:6.0f} GB/s (err {err:.1e})", flush=True)
    record(out_path, f"python bench/ab_source.py OUT {experiment}", rows)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "l2_prefetch")
