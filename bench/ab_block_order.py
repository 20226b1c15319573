"""A/B of the FA2 launch order (tiledsl/runtime/block_order.py) in one GPU run: the same compiled kernel
launched with one group per pair (the old pair-after-pair order), the automatic grouping, one
global longest-first list, and equal groups of other sizes; SDPA flash timed before each round,
and every variant run twice, so the spread shows the noise.

Usage: python bench/ab_block_order.py OUT.json"""
from __future__ import annotations

import sys

import torch

from tiledsl.tune.bench import attention_flops, prefill_shape, record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_spec
from tiledsl import compile
from tiledsl.reference.gpu import run_errors

CASES = [("specs/fa2_d128_causal.tile", n) for n in (1024, 4096, 8192, 16384)] + \
        [("specs/fa2_d64_causal.tile", n) for n in (1024, 4096, 8192, 16384)]
SLOTS = 132 * 2   # both causal specs run 2 blocks per SM


def check(kernel, group):
    """Float64 check of the kernel at this launch order on a ragged shape (several groups, a short last one)."""
    p = kernel.spec.problem
    q = torch.randn(3, 5, 700, p.head_dim_qk, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 5, 900, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kernel.order_groups = group
    return run_errors(kernel, q, k, v)


def main(out_path: str) -> None:
    rows = []
    for path, n in CASES:
        kernel = compile(load_spec(path))
        p = kernel.spec.problem
        d, causal = p.head_dim_qk, p.mask.value == "causal"
        b, h = prefill_shape(n, d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = attention_flops(b, h, n, n, d, causal)
        kernel.order_groups = None
        auto = kernel.order_groups_for(kernel.prepare(q, k, v)[1], 0)
        q_tiles, pairs = -(-n // kernel.plan.launch.tile_q), b * h
        groups = {"pairs": pairs, f"auto({auto})": None, "global": 1}
        for per_slot in (1.0, 2.0):   # equal groups giving every resident slot this many longest blocks
            count = min(pairs, max(1, round(pairs / (2 * per_slot * SLOTS / (q_tiles + 1)))))
            if count not in (1, auto, pairs):
                groups[f"slot{per_slot:g}({count})"] = count
        for rep in range(2):
            peers = {name: flops / t / 1e9 for name, t in sdpa_peers(q, k, v, causal).items() if isinstance(t, float)}
            for name, group in groups.items():
                err = check(kernel, 4 if group == 1 and rep else group)   # also several unequal groups on a ragged shape
                kernel.order_groups = group
                tf = flops / time_ms(lambda: kernel(q, k, v)) / 1e9
                rows.append({"case": f"{kernel.name} N={n}", "variant": name, "rep": rep, "tflops": tf,
                             "error_o": err[0], "error_lse": err[1], "peers": peers})
                print(f"{kernel.name:40s} N={n:5d} {name:12s} rep{rep}: {tf:6.1f} TFLOP/s  flash {peers.get('sdpa_flash', 0):6.1f}"
                      f"  (err {err[0]:.1e}/{err[1]:.1e})", flush=True)
    record(out_path, "python bench/ab_block_order.py OUT", rows)


if __name__ == "__main__":
    main(sys.argv[1])
