"""Chunked-prefill benchmark: the fa2 kernel on a paged KV cache (pages in random order) next to the
same schedule on contiguous caches (head-major (batch, kv heads, keys, d) and token-major (batch,
keys, kv heads, d), the paged cache's row stride), same run, same data: a chunk of q_len queries against a long
history (the chunk's queries are the sequence's last q_len positions, masks bottom-right).

    python bench/paged_prefill_bench.py OUT.json [--pages 16 64] [--commit SHA] [--ab]

bf16, head dim 128, GQA 32 / 8 heads, batch 2, q_len 512 after 8k keys of history. The paged O is
checked against the contiguous kernel's O (validated against float64 by tests/test_gpu_fa2.py)
before it is timed. --ab adds, per row, the kernel reading its block-table entries inline instead
of from the shared ring they are copied to a step ahead (inline_ms: the kernel before the ring), the
paged kernel on a block table in page order (in_order_ms) and that kernel with the block-table reads
patched out (page = key >> PAGE_SHIFT, right for an in-order table: no_lookup_ms), pricing the ring,
the page order and the table reads. TFLOP/s count the visible (query, key) pairs only: 4 d per pair.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import record, time_ms
from tiledsl.spec import DType, Mask  # noqa: E402

BATCH, HEADS, KV_HEADS, HEAD_DIM, Q_LEN, HISTORY = 2, 32, 8, 128, 512, 8192


def bench_specs(arch: str, pages=(16, 64)):
    """[(page, causal, paged spec, contiguous spec)]: the paged_prefill spec and its schedule on a contiguous cache."""
    from tiledsl.serving.prefill import prefill_spec
    out = []
    for causal in (True, False):
        for page in pages:
            spec = prefill_spec(arch, DType.BF16, HEAD_DIM, HEAD_DIM, Mask.CAUSAL if causal else Mask.NONE, page)
            out.append((page, causal, spec, replace(spec, problem=replace(spec.problem, kv_page_size=None))))
    return out


def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2 if causal else q_len * kv_len


def ab_rows(torch, spec, k_tok, v_tok, q, lens, page, want, random_inputs) -> dict:
    """The paged kernel with its block-table entries read inline (the table read in front of each
    load, as before the shared ring; random-order table: inline_ms), and on an in-order block table
    with and without any table reads (in_order_ms, no_lookup_ms) (ms)."""
    from tiledsl.tune.bench import patch_source
    from tiledsl.families import compile
    table = torch.arange(BATCH * (k_tok.shape[1] // page), device="cuda", dtype=torch.int32).view(BATCH, -1)
    in_order = tuple(x.reshape(-1, page, KV_HEADS, HEAD_DIM) for x in (k_tok, v_tok)) + (table,)
    from tiledsl.layout.fa2 import fa2_page_ring
    ring = f"static constexpr int PAGE_RING = {fa2_page_ring(page, spec.schedule.tile_kv, spec.schedule.stages)[0]};"
    out = {}
    # Lookup-free: `pages` carries the sequence's first page number (batch * table_stride in an
    # in-order table) instead of pointing at its table row; no entries are copied.
    for name, inputs, patches in (
            ("inline_ms", random_inputs, [(ring, "static constexpr int PAGE_RING = 0;")]),
            ("in_order_ms", in_order, []),
            ("no_lookup_ms", in_order, [
                ("const int* pages = block_table + batch * table_stride;",
                 "const int* pages = (const int*)(i64)(batch * table_stride);"),
                ("        if constexpr (C::PAGE_RING > 0 && C::PAGE_PER_TILE) return first;\n"
                 "        else if constexpr (C::PAGE_RING > 0) return load_shared_s32(slot + ((key >> C::PAGE_SHIFT) - first) * 4);\n"
                 "        else return page_of_key<C>(table, key);",
                 "        return (int)(i64)table + (key >> C::PAGE_SHIFT);"),
                ("pages.first = tile * C::BC < seq_kv ? load_shared_s32(pages.slot) : 0;",
                 "pages.first = (int)(i64)table + ((tile * C::BC) >> C::PAGE_SHIFT);"),
                ("pages.held[j] = load_shared_s32(pages.slot + j * 4);",
                 "pages.held[j] = (int)(i64)table + pages.first + j;"),
                ("if (threadIdx.x < C::TILE_PAGES)", "if (false)")])):
        kernel = compile(spec)
        patch_source(kernel, patches)
        run, o, _ = kernel.bind(q, *inputs, lens)
        run()
        torch.cuda.synchronize()
        if not float((o.float() - want.float()).abs().max()) < 1e-2:
            raise SystemExit(f"{name}: O differs from the random-order paged O")
        out[name] = time_ms(run)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--commit", default=None, help="the commit measured (when the tree has no .git)")
    parser.add_argument("--ab", action="store_true", help="also time in-order pages, with and without table reads")
    args = parser.parse_args(argv)
    import torch
    from tiledsl.runtime.device import device_arch
    from tiledsl.dispatch.kernels import kernel_for

    kv_len = HISTORY + Q_LEN
    torch.manual_seed(0)
    q = torch.randn(BATCH, Q_LEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)   # token-major
    k = torch.randn(BATCH, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_tok, v_tok = (x.transpose(1, 2).contiguous() for x in (k, v))   # (batch, keys, kv heads, d)
    lens = torch.full((BATCH,), kv_len, device="cuda", dtype=torch.int32)
    rows = []
    for page, causal, paged_spec, contiguous_spec in bench_specs(device_arch(), args.pages):
        pages_per_seq = kv_len // page
        order = torch.randperm(BATCH * pages_per_seq, device="cuda")
        table = order.view(BATCH, pages_per_seq).to(torch.int32)

        def to_cache(x):   # (batch, kv_heads, n, d) -> (pages, page, kv_heads, d) with page table[b, i] = keys i*page..
            blocks = x.transpose(1, 2).reshape(BATCH * pages_per_seq, page, KV_HEADS, HEAD_DIM)
            cache = torch.empty_like(blocks)
            cache[order] = blocks
            return cache
        k_cache, v_cache = to_cache(k), to_cache(v)
        paged, contiguous = kernel_for(paged_spec), kernel_for(contiguous_spec)
        run_p, out_p, _ = paged.bind(q, k_cache, v_cache, table, lens)
        run_c, out_c, _ = contiguous.bind(q.transpose(1, 2), k, v)
        run_t, out_t, _ = contiguous.bind(q.transpose(1, 2), k_tok.transpose(1, 2), v_tok.transpose(1, 2))
        run_c(), run_t(), run_p()
        torch.cuda.synchronize()
        diff = max(float((out_p.transpose(1, 2).float() - out.float()).abs().max()) for out in (out_c, out_t))
        if not diff < 1e-2:
            raise SystemExit(f"paged O differs from contiguous O by {diff} (page {page}, causal {causal})")
        flops = 4 * BATCH * HEADS * HEAD_DIM * visible_pairs(Q_LEN, kv_len, causal)
        tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        ms_c, ms_t, ms_p = time_ms(run_c), time_ms(run_t), time_ms(run_p)
        row = {"kernel": paged.name, "family": "fa2", "dtype": "bf16", "head_dim": HEAD_DIM, "seqlen": kv_len,
               "q_len": Q_LEN, "causal": causal, "batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS, "page": page,
               "ms": ms_p, "tflops": tflops(ms_p), "max_abs_diff_vs_contiguous": diff,
               "peers": {"contiguous": tflops(ms_c), "contiguous_token_major": tflops(ms_t),
                         "contiguous_kernel": contiguous.name, "contiguous_ms": ms_c, "contiguous_token_major_ms": ms_t},
               "vs_contiguous": ms_c / ms_p, "vs_contiguous_token_major": ms_t / ms_p}
        if args.ab:
            row.update(ab_rows(torch, paged_spec, k_tok, v_tok, q, lens, page, out_p, (k_cache, v_cache, table)))
        rows.append(row)
        print(f"page {page} causal {causal}: paged {ms_p:.3f} ms ({row['tflops']:.0f} TFLOP/s), contiguous {ms_c:.3f} ms, "
              f"token-major {ms_t:.3f} ms; x{row['vs_contiguous']:.3f} / x{row['vs_contiguous_token_major']:.3f} (max |dO| {diff})", flush=True)
        del k_cache, v_cache
    extra = {"commit": args.commit} if args.commit else {}
    record(args.out, "python bench/paged_prefill_bench.py " + " ".join(argv or sys.argv[1:]), rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
