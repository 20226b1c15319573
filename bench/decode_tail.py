"""Decode: where the last percent goes, in one GPU run. Times the bundled spec next to variants
that change one thing, and the spec again at the end; cuDNN is timed before and after each shape so
the spread shows the noise. Earlier runs (bench/NOTES.md): an L2 evict-first hint, other tile /
warp / stage shapes, one barrier per kv tile, the merge skipped (MERGE below), per-warp pipelines
against block-wide barriers, refilling before waiting, a second V buffer. This one: the spec (kv128,
one K and one V buffer per warp) against the previous spec, kv64 with 3 stages. Variants other than
`no_merge` are validated first.

Usage: python bench/decode_tail.py OUT.json"""
from __future__ import annotations

import dataclasses
import sys

import torch

from tiledsl.tune.bench import patch_source, record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_spec
from tiledsl import compile
from tiledsl.reference.gpu import run_errors

SHAPES = [(1, 32, 32, 32768), (4, 32, 8, 65536), (8, 32, 32, 8192), (1, 32, 32, 131072)]
MERGE = "if (ticket != num_splits - 1) return;"   # a "no_merge" variant patches this to "return;"
VARIANTS = {   # name: (schedule changes, lowering overrides, source patches)
    "spec": ({}, {}, ()),
    "kv64_s3": ({"tile_kv": 64, "stages": 3}, {}, ()),
    "spec_again": None,   # the first kernel timed again: the spread of the two is the noise
}


def build(base, changes, overrides, patch):
    spec = dataclasses.replace(base, schedule=dataclasses.replace(base.schedule, **changes))
    kernel = compile(spec, **overrides)
    patch_source(kernel, patch)
    return kernel


def main(out_path: str) -> None:
    base = load_spec("specs/decode_d128.tile")
    kernels = {name: build(base, *variant) for name, variant in VARIANTS.items() if variant}
    kernels["spec_again"] = kernels["spec"]
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        cudnn = []
        for name, kernel in kernels.items():
            if name in ("spec", "kv64_s3"):   # cuDNN at the start and in the middle
                cudnn.append(nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6)
            err = run_errors(kernel, q, k, v) if name != "no_merge" else (None, None)
            run, _, _ = kernel.bind(q, k, v)
            gbps = nbytes / time_ms(run) / 1e6
            rows.append({"kernel": kernel.name, "variant": name, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                         "kv_len": kv_len, "splits": kernel.last_splits, "gbps": gbps, "error_o": err[0], "error_lse": err[1]})
            print(f"b{batch} h{heads}/{kv_heads} n{kv_len:6d} {name:12s} ({kernel.last_splits:2d} splits): {gbps:6.0f} GB/s"
                  f"  err {err[0]}", flush=True)
        cudnn.append(nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6)
        print(f"  cuDNN {[round(c) for c in cudnn]}", flush=True)
        for row in rows[-len(kernels):]:
            row["peers"] = {"sdpa_cudnn_runs": cudnn}
        del q, k, v
        torch.cuda.empty_cache()
    record(out_path, "python bench/decode_tail.py OUT", rows)


if __name__ == "__main__":
    main(sys.argv[1])
