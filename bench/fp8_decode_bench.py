"""FP8 (e4m3) KV decode vs bf16 KV decode (specs/decode_d128.tile's schedule), contiguous and paged
(page 16), on decode_bench's shapes, for several FP8 schedule variants (VARIANTS: conversion path x
kv tile x pipeline stages x warps x min blocks per SM; the layout pass accepts each): time ratio to bf16 (issue 15's target:
>= 1.8x) and the bytes/s each reads next to the device copy rate.

    python bench/fp8_decode_bench.py OUT.json [--variants spec,kv64_s4,...]

GB/s = bytes of K+V read (2 B Hkv N d x element size) / time. Every fp8 kernel (each variant,
contiguous and paged) is first checked against the float64 reference that dequantizes the same
bytes on a small ragged shape (kv_lens not multiples of the tile, GQA 4, per-head scales); a
variant that fails is recorded with its error and not timed. autoschedule.FP8_DECODE_SCHEDULE is
the variant the API runs (`api_pick` in the JSON). Runs in about a minute on an H200.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl import compile  # noqa: E402
from tiledsl.dispatch.autoschedule import FP8_DECODE_SCHEDULE
from tiledsl.tune.bench import record, time_ms
from tiledsl.frontend.parse import load_specs
from tiledsl.spec import DType, KvScale  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from decode_bench import HEAD_DIM, SHAPES, SPEC, copy_gbps  # noqa: E402

PAGE = 16
# FP8 schedule variants (Schedule fields over the bundled spec's): same bytes per block as bf16
# (kv 256), more tiles in flight (stages), the bundled schedule ("spec"); and the `fragments`
# conversion (ldmatrix on the e4m3 ring, converted in registers: no 16-bit tile, so far less shared
# memory) over tile kv, stages, warps and a min-blocks-per-SM promise. Names: [fr_] tile kv _
# stages [_ warps] [_ min blocks].
FR = dict(fp8_convert="fragments")
VARIANTS = {"spec": {}, "kv256_s1": dict(tile_kv=256, stages=1), "kv128_s2": dict(stages=2),
            "kv128_s3": dict(stages=3), "kv64_s4": dict(tile_kv=64, stages=4), "kv64_s2": dict(tile_kv=64, stages=2),
            "kv256_s1_w8": dict(tile_kv=256, stages=1, warps=8),
            "fr_kv128_s1": dict(FR), "fr_kv128_s2": dict(FR, stages=2), "fr_kv128_s3": dict(FR, stages=3),
            "fr_kv64_s2": dict(FR, tile_kv=64, stages=2), "fr_kv64_s4": dict(FR, tile_kv=64, stages=4),
            "fr_kv256_s1": dict(FR, tile_kv=256, stages=1), "fr_kv256_s2_w8": dict(FR, tile_kv=256, stages=2, warps=8),
            "fr_kv128_s1_mb3": dict(FR, min_blocks=3), "fr_kv64_s2_mb3": dict(FR, tile_kv=64, stages=2, min_blocks=3)}


def variant_of(schedule: dict) -> str | None:
    """The VARIANTS name of autoschedule's FP8 pick (Schedule fields over the bundled schedule), or None."""
    if FP8_DECODE_SCHEDULE is None:
        return "spec"
    want = {**schedule, **FP8_DECODE_SCHEDULE}
    for name, v in VARIANTS.items():
        if {**schedule, **v} == want:
            return name
    return None


def specs(names):
    base = load_specs(str(SPEC))[0]
    out = {}
    for paged in (False, True):
        p = replace(base.problem, kv_page_size=PAGE if paged else None)
        plain = replace(base, problem=p)
        fp8 = replace(base, problem=replace(p, kv_dtype=DType.E4M3, kv_scale=KvScale.PER_HEAD))
        out[("paged16" if paged else "contiguous")] = (
            plain, {name: replace(fp8, schedule=replace(fp8.schedule, **VARIANTS[name])) for name in names})
    return base, out


def validate(torch, kernel, paged: bool) -> float:
    """O error of an fp8 kernel vs the dequantizing float64 reference: batch 3 with kv_lens
    (1000, 17, 300), 8 heads on 2 kv heads, random e4m3 over a wide range, per-head scales."""
    import numpy as np
    from tiledsl.reference.fp8 import attention_fp8, paged_attention_fp8
    lens_host = [1000, 17, 300]
    batch, kv_heads, heads, n = 3, 2, 8, 63 * PAGE   # 1008 keys: whole pages
    q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k8 = (torch.randn(batch, kv_heads, n, HEAD_DIM, device="cuda") * 4).to(torch.float8_e4m3fn)
    v8 = (torch.randn(batch, kv_heads, n, HEAD_DIM, device="cuda") * 4).to(torch.float8_e4m3fn)
    ks, vs = torch.rand(kv_heads, device="cuda") * 0.5 + 0.05, torch.rand(kv_heads, device="cuda") * 0.5 + 0.05
    lens = torch.tensor(lens_host, device="cuda", dtype=torch.int32)
    hs = lambda s: s.double().cpu().numpy()  # noqa: E731
    if paged:
        pages = -(-n // PAGE)
        as_pages = lambda t: t.view(torch.uint8).permute(0, 2, 1, 3).reshape(batch * pages, PAGE, kv_heads, HEAD_DIM)  # noqa: E731
        perm = torch.randperm(batch * pages, device="cuda")
        kc, vc = as_pages(k8)[torch.argsort(perm)], as_pages(v8)[torch.argsort(perm)]   # page i of the table at perm[i]
        table = perm.to(torch.int32).reshape(batch, pages)
        kc, vc = kc.contiguous().view(torch.float8_e4m3fn), vc.contiguous().view(torch.float8_e4m3fn)
        qp = q.permute(0, 2, 1, 3).contiguous()
        out = torch.full_like(qp, float("nan"))
        kernel(qp, kc, vc, table, lens, out=out, k_scale=ks, v_scale=vs)
        ref, _ = paged_attention_fp8(qp.double().cpu().numpy(), kc.view(torch.uint8).cpu().numpy(),
                                     vc.view(torch.uint8).cpu().numpy(), hs(ks), hs(vs), table.cpu().numpy(),
                                     np.asarray(lens_host, dtype=np.int32))
    else:
        out = torch.full_like(q, float("nan"))
        kernel(q, k8, v8, kv_lens=lens, out=out, k_scale=ks, v_scale=vs)
        ref, _ = attention_fp8(q.double().cpu().numpy(), k8.view(torch.uint8).cpu().numpy(),
                               v8.view(torch.uint8).cpu().numpy(), hs(ks), hs(vs), np.asarray(lens_host))
    got = out.double().cpu().numpy()
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated VARIANTS names")
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    import torch

    base, variant_specs = specs(names)
    api_pick = variant_of({"tile_kv": base.schedule.tile_kv, "stages": base.schedule.stages, "warps": base.schedule.warps})
    ceiling = copy_gbps(torch)
    print(f"device-to-device copy: {ceiling:.0f} GB/s; API pick (autoschedule.FP8_DECODE_SCHEDULE = "
          f"{FP8_DECODE_SCHEDULE}): {api_pick}", flush=True)
    kernels, failed = {}, {}
    for layout, (plain, fp8s) in variant_specs.items():
        kernels[layout] = (compile(plain), {})
        for name, spec in fp8s.items():
            try:
                kernel = compile(spec)
                err = validate(torch, kernel, layout == "paged16")
            except Exception as e:   # noqa: BLE001  (a variant that does not build or run is reported, not fatal)
                failed[(layout, name)] = f"{type(e).__name__}: {e}"
                print(f"  {layout} {name}: FAILED {failed[(layout, name)]}", flush=True)
                continue
            if not err < 1e-2:
                failed[(layout, name)] = f"validation failed: O error {err}"
                print(f"  {layout} {name}: {failed[(layout, name)]}", flush=True)
                continue
            kernels[layout][1][name] = (kernel, err)
            print(f"  {layout} {name}: valid (O error {err:.1e}), {kernel.plan.launch.smem_bytes} B shared", flush=True)
    rows = [{"kernel": name, "layout": layout, "family": "decode", "kv_dtype": "e4m3", "error": why, "peers": {}}
            for (layout, name), why in failed.items()]
    for batch, heads, kv_heads, kv_len in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        ks = torch.full((kv_heads,), 0.5, device="cuda")
        vs = torch.full((kv_heads,), 0.25, device="cuda")
        pages = kv_len // PAGE
        as_pages = lambda t: t.permute(0, 2, 1, 3).reshape(batch * pages, PAGE, kv_heads, HEAD_DIM)  # noqa: E731
        table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).reshape(batch, pages)
        lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
        qp = q.permute(0, 2, 1, 3).contiguous()
        elems = 2 * batch * kv_heads * kv_len * HEAD_DIM
        for layout, (plain, fp8s) in kernels.items():
            if layout == "contiguous":
                bind16 = lambda kern: kern.bind(q, k, v)  # noqa: E731
                bind8 = lambda kern: kern.bind(q, k8, v8, k_scale=ks, v_scale=vs)  # noqa: E731
            else:   # sequence b in pages [b * P, (b + 1) * P): the same bytes, through a block table
                bind16 = lambda kern: kern.bind(qp, as_pages(k), as_pages(v), table, lens)  # noqa: E731
                bind8 = lambda kern: kern.bind(qp, as_pages(k8), as_pages(v8), table, lens, k_scale=ks,  # noqa: E731
                                               v_scale=vs)
            ms16 = time_ms(bind16(plain)[0])
            common = {"family": "decode", "dtype": "bf16", "layout": layout, "head_dim": HEAD_DIM, "seqlen": kv_len,
                      "causal": False, "batch": batch, "heads": heads, "kv_heads": kv_heads, "peers": {}}
            gbps16 = elems * 2 / (ms16 * 1e-3) / 1e9
            rows.append({"kernel": plain.name, "variant": "bf16", "kv_dtype": "bf16", **common, "splits": plain.last_splits,
                         "smem_bytes": plain.plan.launch.smem_bytes, "ms": ms16, "gbps": gbps16,
                         "fraction_of_copy": gbps16 / ceiling})
            line = [f"bf16 {ms16 * 1e3:.0f} us"]
            for name, (kernel, err) in fp8s.items():
                ms8 = time_ms(bind8(kernel)[0])
                gbps = elems / (ms8 * 1e-3) / 1e9
                rows.append({"kernel": kernel.name, "variant": name, "api_pick": name == api_pick, "kv_dtype": "e4m3",
                             **common, "splits": kernel.last_splits, "smem_bytes": kernel.plan.launch.smem_bytes,
                             "ms": ms8, "gbps": gbps, "fraction_of_copy": gbps / ceiling, "speedup_vs_bf16": ms16 / ms8,
                             "error_o": err})
                line.append(f"{name} {ms8 * 1e3:.0f} us {ms16 / ms8:.2f}x")
            print(f"  {layout:10s} b{batch} h{heads}/{kv_heads} n{kv_len}: " + ", ".join(line), flush=True)
        del q, k, v, k8, v8
        torch.cuda.empty_cache()
    record(args.out, "python bench/fp8_decode_bench.py " + " ".join(argv or sys.argv[1:]), rows,
           copy_gbps=ceiling, spec=str(SPEC.relative_to(ROOT)), target_speedup=1.8, variants=VARIANTS,
           api_pick=api_pick, fp8_decode_schedule=FP8_DECODE_SCHEDULE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
