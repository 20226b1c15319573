"""Decode: GB/s against the number of KV splits, to check `split kv = auto` (one GPU call).

Each (shape, split count) is validated against the float64 reference first, then timed; cuDNN is
timed before and after each shape, so the spread of the two shows the noise.

Usage: python bench/decode_splits.py OUT.json"""
from __future__ import annotations

import dataclasses
import sys

import torch

from tiledsl.tune.bench import record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_spec
from tiledsl import compile
from tiledsl.reference.gpu import run_errors

# (batch, heads, kv heads, cache length): split counts to time
SHAPES = {(1, 32, 32, 32768): ["auto", 8, 16, 32, 64, 128],
          (4, 32, 8, 65536): ["auto", 8, 16, 32, 64, 128],
          (8, 32, 32, 8192): ["auto", 1, 2, 4, 8, 16],
          (1, 32, 32, 131072): ["auto", 8, 32, 64, 128, 256]}


def main(out_path: str) -> None:
    base = load_spec("specs/decode_d128.tile")
    rows = []
    for (batch, heads, kv_heads, kv_len), split_counts in SHAPES.items():
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        cudnn = [nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6]
        shape_rows = []
        for splits in split_counts:
            spec = dataclasses.replace(base, schedule=dataclasses.replace(base.schedule, split_kv=splits))
            kernel = compile(spec)
            err_o, err_lse = run_errors(kernel, q, k, v)
            run, _, _ = kernel.bind(q, k, v)
            gbps = nbytes / time_ms(run) / 1e6
            shape_rows.append({"kernel": kernel.name, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                               "kv_len": kv_len, "splits": kernel.last_splits, "asked": splits, "gbps": gbps,
                               "error_o": err_o, "error_lse": err_lse})
            print(f"b{batch} h{heads}/{kv_heads} n{kv_len} splits {splits!s:>4} ({kernel.last_splits:3d}): {gbps:6.0f} GB/s"
                  f"  err {err_o:.2e}", flush=True)
        cudnn.append(nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6)
        print(f"  cuDNN {[round(c) for c in cudnn]}", flush=True)
        for row in shape_rows:
            row["peers"] = {"sdpa_cudnn_runs": cudnn}
        rows += shape_rows
        del q, k, v
        torch.cuda.empty_cache()
    record(out_path, "python bench/decode_splits.py OUT", rows)


if __name__ == "__main__":
    main(sys.argv[1])
