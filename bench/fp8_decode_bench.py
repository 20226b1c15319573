"""FP8 (e4m3) KV decode vs bf16 KV decode, same schedule (specs/decode_d128.tile), contiguous and
paged (page 16), on decode_bench's shapes: time ratio (issue 15's target: >= 1.8x) and the bytes/s
each reads next to the device copy rate.

    python bench/fp8_decode_bench.py OUT.json

GB/s = bytes of K+V read (2 B Hkv N d x element size) / time. Each fp8 kernel is checked once
against the float64 reference that dequantizes the same bytes (first batch entry, first 4096
keys) before it is timed. Runs in well under 90 s on an H200.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl import compile  # noqa: E402
from tiledsl.bench import record, time_ms  # noqa: E402
from tiledsl.parse import load_specs  # noqa: E402
from tiledsl.spec import DType, KvScale  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import HEAD_DIM, SHAPES, SPEC, copy_gbps  # noqa: E402

PAGE = 16


def specs():
    base = load_specs(str(SPEC))[0]
    out = {}
    for paged in (False, True):
        p = replace(base.problem, kv_page_size=PAGE if paged else None)
        plain = replace(base, problem=p)
        fp8 = replace(base, problem=replace(p, kv_dtype=DType.E4M3, kv_scale=KvScale.PER_HEAD))
        out[("paged16" if paged else "contiguous")] = (compile(plain), compile(fp8))
    return out


def check_fp8(torch, kernel, q, k, v, ks, vs):
    """O error of the fp8 kernel on a short prefix vs the dequantizing float64 reference."""
    import numpy as np
    from tiledsl.fp8_reference import attention_fp8
    n = min(4096, k.shape[2])
    qs, k8, v8 = q[:1].contiguous(), k[:1, :, :n].contiguous(), v[:1, :, :n].contiguous()
    out, _ = kernel(qs, k8, v8, k_scale=ks, v_scale=vs)
    ref, _ = attention_fp8(qs.double().cpu().numpy(), k8.view(torch.uint8).cpu().numpy(),
                           v8.view(torch.uint8).cpu().numpy(), ks.double().cpu().numpy(), vs.double().cpu().numpy())
    err = float(np.linalg.norm(out.double().cpu().numpy() - ref) / np.linalg.norm(ref))
    if not err < 1e-2:
        raise SystemExit(f"{kernel.name}: validation failed: O error {err}")
    return err


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.bench.record)")
    args = parser.parse_args(argv)
    import torch

    kernels = specs()
    ceiling = copy_gbps(torch)
    print(f"device-to-device copy: {ceiling:.0f} GB/s", flush=True)
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        ks = torch.full((kv_heads,), 0.5, device="cuda")
        vs = torch.full((kv_heads,), 0.25, device="cuda")
        for layout, (plain, fp8) in kernels.items():
            if layout == "contiguous":
                err = check_fp8(torch, fp8, q, k8, v8, ks, vs)
                run16, _, _ = plain.bind(q, k, v)
                run8, _, _ = fp8.bind(q, k8, v8, k_scale=ks, v_scale=vs)
            else:   # sequence b in pages [b * P, (b + 1) * P): the same bytes, through a block table
                pages = kv_len // PAGE
                as_pages = lambda t: t.permute(0, 2, 1, 3).reshape(batch * pages, PAGE, kv_heads, HEAD_DIM)  # noqa: E731
                table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).reshape(batch, pages)
                lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
                qp = q.permute(0, 2, 1, 3).contiguous()
                run16, _, _ = plain.bind(qp, as_pages(k), as_pages(v), table, lens)
                run8, _, _ = fp8.bind(qp, as_pages(k8), as_pages(v8), table, lens, k_scale=ks, v_scale=vs)
                err = None
            ms16, ms8 = time_ms(run16), time_ms(run8)
            elems = 2 * batch * kv_heads * kv_len * HEAD_DIM
            for kernel, dtype, ms, size in ((plain, "bf16", ms16, 2), (fp8, "e4m3", ms8, 1)):
                gbps = elems * size / (ms * 1e-3) / 1e9
                rows.append({"kernel": kernel.name, "family": "decode", "dtype": "bf16", "kv_dtype": dtype,
                             "layout": layout, "head_dim": HEAD_DIM, "seqlen": kv_len, "causal": False,
                             "batch": batch, "heads": heads, "kv_heads": kv_heads, "splits": kernel.last_splits,
                             "ms": ms, "gbps": gbps, "fraction_of_copy": gbps / ceiling,
                             **({"speedup_vs_bf16": ms16 / ms8, "error_o": err} if dtype == "e4m3" else {}),
                             "peers": {}})
            print(f"  {layout:10s} b{batch} h{heads}/{kv_heads} n{kv_len}: bf16 {ms16 * 1e3:.0f} us, e4m3 "
                  f"{ms8 * 1e3:.0f} us, {ms16 / ms8:.2f}x (target 1.8x)", flush=True)
        del q, k, v, k8, v8
        torch.cuda.empty_cache()
    record(args.out, "python bench/fp8_decode_bench.py " + " ".join(argv or sys.argv[1:]), rows,
           copy_gbps=ceiling, spec=str(SPEC.relative_to(ROOT)), target_speedup=1.8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
