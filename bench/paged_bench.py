"""Paged decode benchmark: GB/s of K+V read by the decode kernel on a paged cache (page 16,
pages in random order) next to the same kernel on a contiguous cache and PyTorch SDPA (cuDNN)
on the contiguous cache, same run, same data.

    python bench/paged_bench.py OUT.json [--page 16]

Shapes: bench/decode_bench.py's (head dim 128, bf16, one query per sequence). The paged kernel's
O is checked against the contiguous kernel's (validated against float64 by decode_bench and the
GPU tests) before it is timed. GB/s = 2 B Hkv N d 2 bytes / time (the block table's bytes are
left out: 4 B per 16 keys, under 0.1%).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl import compile  # noqa: E402
from tiledsl.tune.bench import record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_specs

SPEC = ROOT / "specs" / "decode_d128.tile"
SHAPES = [(1, 32, 32, 32768), (8, 32, 32, 8192), (4, 32, 8, 65536), (1, 32, 32, 131072)]   # decode_bench.py's
HEAD_DIM = 128


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--page", type=int, default=16)
    args = parser.parse_args(argv)
    import torch

    spec = load_specs(str(SPEC))[0]
    contiguous = compile(spec)
    paged = compile(replace(spec, problem=replace(spec.problem, kv_page_size=args.page)))
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pages_per_seq = kv_len // args.page
        order = torch.randperm(batch * pages_per_seq, device="cuda")
        table = order.view(batch, pages_per_seq).to(torch.int32)

        def to_cache(x):   # (batch, kv_heads, n, d) -> (pages, page, kv_heads, d), page table[b, i] = x[b, :, i*page:]
            blocks = x.transpose(1, 2).reshape(batch * pages_per_seq, args.page, kv_heads, HEAD_DIM)
            cache = torch.empty_like(blocks)
            cache[order] = blocks
            return cache
        k_cache, v_cache = to_cache(k), to_cache(v)
        lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
        q_tok = q.transpose(1, 2).contiguous()   # (batch, 1, heads, d)
        run_c, out_c, _ = contiguous.bind(q, k, v)
        run_p, out_p, _ = paged.bind(q_tok, k_cache, v_cache, table, lens)
        run_c(), run_p()
        torch.cuda.synchronize()
        diff = float((out_p.transpose(1, 2).float() - out_c.float()).abs().max())
        if not diff < 1e-2:
            raise SystemExit(f"paged O differs from contiguous O by {diff} at b{batch} h{heads}/{kv_heads} n{kv_len}")
        nbytes = 2 * batch * kv_heads * kv_len * HEAD_DIM * 2
        gbps = lambda ms: None if ms is None else nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        ms_c, ms_p = time_ms(run_c), time_ms(run_p)
        peers_ms = sdpa_peers(q, k, v, causal=False)
        cudnn = gbps(peers_ms.get("sdpa_cudnn"))
        row = {"kernel": paged.name, "family": "decode", "dtype": "bf16", "head_dim": HEAD_DIM, "seqlen": kv_len,
               "causal": False, "batch": batch, "heads": heads, "kv_heads": kv_heads, "page": args.page,
               "splits": paged.last_splits, "ms": ms_p, "gbps": gbps(ms_p), "max_abs_diff_vs_contiguous": diff,
               "peers": {"contiguous": gbps(ms_c), "contiguous_kernel": contiguous.name, "sdpa_cudnn": cudnn},
               "vs_contiguous": ms_c / ms_p, "vs_sdpa_cudnn": gbps(ms_p) / cudnn if cudnn else None}
        rows.append(row)
        print(f"b{batch} h{heads}/{kv_heads} n{kv_len}: paged {row['gbps']:.0f} GB/s, contiguous {gbps(ms_c):.0f}, "
              f"cuDNN {cudnn or float('nan'):.0f}; x{row['vs_contiguous']:.3f} of contiguous", flush=True)
        del q, k, v, k_cache, v_cache
        torch.cuda.empty_cache()
    record(args.out, "python bench/paged_bench.py " + " ".join(argv or sys.argv[1:]), rows, spec=str(SPEC.relative_to(ROOT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
