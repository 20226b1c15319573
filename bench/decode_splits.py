"""Decode: GB/s against the number of KV splits, to check `split kv = auto` (one GPU call).

Usage: python bench/decode_splits.py OUT.json"""
from __future__ import annotations

import dataclasses
import sys

import torch

from tiledsl.bench import record, sdpa_peers, time_ms
from tiledsl.parse import load_spec
from tiledsl.runtime import compile

SHAPES = [(1, 32, 32, 32768), (4, 32, 8, 65536)]
SPLITS = ["auto", 4, 8, 12, 16, 24, 32, 48, 64]


def main(out_path: str) -> None:
    base = load_spec("specs/decode_d128.tile")
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        peers = {n: (nbytes / t / 1e6 if isinstance(t, float) else None)
                 for n, t in sdpa_peers(q, k, v, False).items() if not n.endswith("_error")}
        for splits in SPLITS:
            spec = dataclasses.replace(base, schedule=dataclasses.replace(base.schedule, split_kv=splits))
            kernel = compile(spec)
            run, out, lse = kernel.bind(q, k, v)
            ms = time_ms(run)
            gbps = nbytes / ms / 1e6
            rows.append({"kernel": kernel.name, "batch": batch, "heads": heads, "kv_heads": kv_heads, "kv_len": kv_len,
                         "splits": kernel.last_splits, "asked": splits, "gbps": gbps, "peers": peers})
            print(f"b{batch} h{heads}/{kv_heads} n{kv_len} splits {splits!s:>4} ({kernel.last_splits:3d}): {gbps:6.0f} GB/s"
                  f"  cuDNN {peers.get('sdpa_cudnn') or 0:6.0f}", flush=True)
    record(out_path, "python bench/decode_splits.py", rows)


if __name__ == "__main__":
    main(sys.argv[1])
