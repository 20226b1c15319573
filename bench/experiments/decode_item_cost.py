"""Decode with persistent blocks: what one work item costs (a probe; nothing here ships).

Times the bundled decode spec at several split counts next to variants of its generated CUDA that
drop one piece of the per-item tail: the acq_rel ticket made relaxed, the ticket and merge
skipped, the partial stores skipped too, and the warp combine skipped too (all but the first give
wrong answers; they measure cost). Skipping the combine leaves O unread, so the compiler deletes
the softmax and P V as well: `no_combine` measures the K/V stream with no compute at all. cuDNN is
timed in the same run.

Usage: python bench/experiments/decode_item_cost.py OUT.json

Its patches match the persistent decode template of commit 4af8f6e (reverted: see bench/NOTES.md);
run it on a checkout of that commit."""
from __future__ import annotations

import dataclasses
import sys

import torch

from tiledsl.bench import record, sdpa_peers, time_ms
from tiledsl.parse import load_spec
from tiledsl import compile
from tiledsl.validate import run_errors

TICKET = "ticket = atomic_add_acq_rel(counter, 1);"
NO_MERGE = "        if (num_splits == 1) continue;   // the next combine"
PARTIAL = "            if (num_splits > 1) {\n                *reinterpret_cast<float4*>(o_part"
COMBINE = "        combine_warp_states<C>(acc_o, row_max, row_sum, scratch, warp, lane);\n"
VARIANTS = {
    "spec": (),
    "relaxed_ticket": ((TICKET, "ticket = atomicAdd(counter, 1);"),),
    "no_merge": ((NO_MERGE, "        continue;   // probe"),),
    "no_partial": ((NO_MERGE, "        continue;   // probe"), (PARTIAL, "            if (false) {\n                *reinterpret_cast<float4*>(o_part")),
    "no_combine": ((COMBINE, "        continue;   // probe\n"),),
}
SHAPES = {(1, 32, 32, 32768): [8, 32, 128], (8, 32, 32, 8192): [1, 8]}


def build(base, splits, patches):
    spec = dataclasses.replace(base, schedule=dataclasses.replace(base.schedule, split_kv=splits))
    kernel = compile(spec)
    for old, new in patches:
        assert kernel.source.count(old) == 1, old
        kernel.source = kernel.source.replace(old, new)
    return kernel


def main(out_path: str) -> None:
    base = load_spec("specs/decode_d128.tile")
    rows = []
    for (batch, heads, kv_heads, kv_len), split_counts in SHAPES.items():
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        cudnn = nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6
        for splits in split_counts:
            for name, patches in VARIANTS.items():
                if splits == 1 and name != "spec" and name != "no_combine":
                    continue
                kernel = build(base, splits, patches)
                err = run_errors(kernel, q, k, v)[0] if name in ("spec", "relaxed_ticket") else None
                run, _, _ = kernel.bind(q, k, v)
                gbps = nbytes / time_ms(run) / 1e6
                rows.append({"kernel": kernel.name, "variant": name, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                             "kv_len": kv_len, "splits": splits, "gbps": gbps, "error_o": err,
                             "peers": {"sdpa_cudnn_gbps": cudnn}})
                print(f"b{batch} n{kv_len} splits {splits:3d} {name:15s} {gbps:6.0f} GB/s  err {err}  (cuDNN {cudnn:.0f})",
                      flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    record(out_path, "python bench/experiments/decode_item_cost.py OUT", rows)


if __name__ == "__main__":
    main(sys.argv[1])
