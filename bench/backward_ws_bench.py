"""The warp-specialized backward (templates/backward_ws.cu.j2) validated, then timed next to the current wgmma
backward, the deterministic path it replaces and the peers, in ONE process.

    python bench/backward_ws_bench.py OUT.json [--seqlens 1024 4096 16384] [--head-dims 64 128 256] [--rep-ms 50]
    python bench/backward_ws_bench.py OUT.json --dry-run     # no GPU: renders the modules, lists what it would time

1. Builds every module (NVRTC in threads; cubins land in the disk cache): per head dim and mask the
   attention_backward table's warp-specialized schedule (BACKWARD_WS_TUNED) and its deterministic one
   (`dq accumulate ordered`), the A/B variants below, the wgmma backward (d64, d128) and the deterministic
   mma.sync backward (`dq accumulate separate`) that deterministic=True ran before.
2. Checks each against float64 autograd on a small shape (tiledsl.tune.backward.check_backward: batch 1,
   heads 2, seqlen 257, fresh random inputs, relative error < 1e-2 on dQ, dK, dV); a wrong module is
   recorded and never timed.
3. Times the backward alone at each shape (bf16, 16k tokens, hidden 2048: PEERS.md; O and LSE random, as
   tiledsl.tune.backward.time_backward_ms: their values do not change the work), next to SDPA's flash and
   cuDNN backward and FlashAttention-4's (when
   flash_attn.cute imports; else None), each as torch.autograd.grad of a retained forward graph, all in the
   same run. TFLOP/s = 2.5 x the forward FLOPs (halved for causal) over the backward's median time.

Rows: kernel, family (backward_ws | backward_ws_variant | backward_wgmma | backward_mma_sync_separate), dtype,
head_dim, seqlen, batch, heads, causal, deterministic, bwd_tflops, ms, peers {fa4_bwd, sdpa_cudnn_bwd,
sdpa_flash_bwd} (TFLOP/s), ratios to each peer; a deterministic row also carries its ratio to the
non-deterministic warp-specialized row of the same shape. About three minutes on an H200 (most of it compiles).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import attention_flops, prefill_shape, record, time_ms   # noqa: E402

BACKWARD_FLOPS = 2.5
# (head dim) -> A/B variants of the table's schedule: name, changes. ws_red: the writer's three warps add dQ_i by
# red.global.add.v4 (at the table's 24 producer registers: 32 + 2 x 240 is more than the block's 3 x 168, and the
# layout refuses it); ws_s3: a 3-slot ring (one staging buffer fits);
# ws_atomic_s2: d256 with dQ added from registers, beside a 2-slot ring (the table stages it for the TMA reduce-add
# beside a 1-slot ring).
RED = {"dq": "atomic"}
VARIANTS = {64: [("ws_red", RED)], 128: [("ws_red", RED), ("ws_s3", {**RED, "stages": 3})],
            256: [("ws_atomic_s2", {"stages": 2, "dq": "atomic"})]}
PEERS = ("fa4_bwd", "sdpa_cudnn_bwd", "sdpa_flash_bwd")


def specs_for(d: int, causal: bool):
    """[(name, family, deterministic, KernelSpec)] of one head dim and mask."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.errors import RuntimeInputError, SpecError
    from tiledsl.layout.backward import backward_layout
    from tiledsl.spec import DqAccumulate, DType, Mask
    mask = Mask.CAUSAL if causal else Mask.NONE
    arch = "sm_90a"
    ws = chosen_backward_spec(arch, DType.BF16, d, mask, None, None, None, False, None, True)
    out = [("ws", "backward_ws", False, ws),
           ("ws_deterministic", "backward_ws", True,
            chosen_backward_spec(arch, DType.BF16, d, mask, None, None, None, True, None, True))]
    for name, changes in VARIANTS.get(d, []):
        changes = {k: DqAccumulate(v) if k == "dq" else v for k, v in changes.items()}
        spec = replace(ws, backward=replace(ws.backward, **changes))
        try:
            backward_layout(spec)
        except SpecError as err:   # a variant the layout refuses at this head dim: skipped, said why
            print(f"skip d{d} {name}: {err.message}", flush=True)
            continue
        out.append((name, "backward_ws_variant", changes.get("dq") is DqAccumulate.ORDERED, spec))
    for name, family, det, mma in (("wgmma", "backward_wgmma", False, "wgmma"),
                                   ("separate", "backward_mma_sync_separate", True, "mma.sync")):
        try:
            out.append((name, family, det, chosen_backward_spec(arch, DType.BF16, d, mask, None, None, None, det, mma,
                                                                False)))
        except RuntimeInputError as err:   # d256: no such kernel
            print(f"skip d{d} {name}: {str(err)[:120]}", flush=True)
    return out


def sdpa_and_fa4(torch, q, k, v, do, causal: bool, rep_ms: int) -> dict:
    """Median ms of each peer's backward (autograd.grad of a retained graph); None where a peer is absent."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    out = {}
    for label, backend in (("sdpa_flash_bwd", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn_bwd", SDPBackend.CUDNN_ATTENTION)):
        try:
            qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            with sdpa_kernel([backend]):
                o = sdpa(qg, kg, vg, is_causal=causal)
            out[label] = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True), rep_ms=rep_ms)
        except Exception as err:   # a backend that refuses the shape is recorded as missing
            out[label], out[label + "_error"] = None, str(err).splitlines()[0][:200]
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        out["fa4_bwd"] = None
        return out
    try:   # FA4 reads (batch, seqlen, heads, d)
        qg, kg, vg = (x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
        o = flash_attn_func(qg, kg, vg, causal=causal)
        o = o[0] if isinstance(o, tuple) else o
        g = do.transpose(1, 2).contiguous()
        out["fa4_bwd"] = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), g, retain_graph=True), rep_ms=rep_ms)
    except Exception as err:
        out["fa4_bwd"], out["fa4_bwd_error"] = None, str(err).splitlines()[0][:200]
    return out


def dry_run(args) -> int:
    from tiledsl.runtime.backward import compile_backward
    from tiledsl.schedule.cost import Shape
    from tiledsl.tune.backward import backward_flops
    names = set()
    for d in args.head_dims:
        for causal in (False, True):
            for name, family, det, spec in specs_for(d, causal):
                names.add(compile_backward(spec).name)
                for n in args.seqlens:
                    batch, heads = prefill_shape(n, d)
                    flops = BACKWARD_FLOPS * attention_flops(batch, heads, n, n, d, causal)
                    assert abs(backward_flops(spec, Shape(batch, heads, n, n)) - flops) <= 1e-6 * flops
                print(f"d{d} causal={causal} {name:<18} {family:<28} deterministic={det}  {spec.kernel_name}")
    print(f"{len(names)} modules; {len(args.head_dims) * 2 * len(args.seqlens)} shapes; peers {', '.join(PEERS)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: build the sources and list the runs")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    import torch
    from concurrent.futures import ThreadPoolExecutor

    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    from tiledsl.schedule.cost import Shape
    from tiledsl.tune.backward import backward_flops, check_backward
    started = time.time()
    table = {(d, causal): specs_for(d, causal) for d in args.head_dims for causal in (False, True)}
    modules = {}
    for entries in table.values():
        for name, family, det, spec in entries:
            modules.setdefault(spec, compile_backward(spec))
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, m.source, m.name, device_arch()) for m in modules.values()]:
            f.exception()   # a failure shows again, with its message, when the module is checked
    print(f"compiled {len(modules)} modules in {time.time() - started:.0f} s", flush=True)
    checks = {}
    for spec, kernel in modules.items():
        try:
            kernel.functions()
            ok, errors, why = check_backward(kernel)
        except Exception as err:
            ok, errors, why = False, {}, f"build: {str(err).splitlines()[0][:200]}"
        checks[spec] = {"ok": ok, "errors": errors, "why": why}
        print(f"check {kernel.name}: {'ok' if ok else why} {errors}", flush=True)
    rows = []
    for (d, causal), entries in table.items():
        for n in args.seqlens:
            batch, heads = prefill_shape(n, d)
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = torch.randn_like(do), torch.randn(batch, heads, n, device="cuda") + 8.0
            flops = BACKWARD_FLOPS * attention_flops(batch, heads, n, n, d, causal)
            shape = Shape(batch, heads, n, n)
            assert abs(backward_flops(entries[0][3], shape) - flops) <= 1e-6 * flops   # one FLOP convention
            peer_ms = sdpa_and_fa4(torch, q, k, v, do, causal, args.rep_ms)
            peers = {p: flops / peer_ms[p] / 1e9 if isinstance(peer_ms.get(p), float) else None for p in PEERS}
            by_name = {}
            for name, family, det, spec in entries:
                kernel, check = modules[spec], checks[spec]
                row = {"kernel": kernel.name, "name": name, "family": family, "dtype": "bf16", "head_dim": d,
                       "seqlen": n, "batch": batch, "heads": heads, "causal": causal, "deterministic": det,
                       "check": check, "peers": peers,
                       "peer_errors": {p: peer_ms[p + "_error"] for p in PEERS if p + "_error" in peer_ms}}
                if not check["ok"]:
                    rows.append({**row, "bwd_tflops": None, "not_timed": check["why"]})
                    continue
                ms = time_ms(lambda: kernel(q, k, v, o, lse, do), rep_ms=args.rep_ms)
                row.update(ms=ms, bwd_tflops=flops / ms / 1e9)
                row["ratios"] = {p: row["bwd_tflops"] / t for p, t in peers.items() if t}
                by_name[name] = row
                rows.append(row)
            if "ws" in by_name and "ws_deterministic" in by_name:
                by_name["ws_deterministic"]["vs_nondeterministic"] = (by_name["ws_deterministic"]["bwd_tflops"]
                                                                      / by_name["ws"]["bwd_tflops"])
            line = "  ".join(f"{r['name']} {r['bwd_tflops']:.0f}" for r in by_name.values())
            peer_line = "  ".join(f"{p} {t:.0f}" for p, t in peers.items() if t)
            print(f"d{d} {'causal' if causal else 'none  '} {n:6d}  {line}  | {peer_line}", flush=True)
            del q, k, v, do, o, lse
    record(args.out, "python bench/backward_ws_bench.py " + " ".join(sys.argv[1:]), rows,
           seconds=round(time.time() - started, 1), checks={modules[s].name: c for s, c in checks.items()})
    bad = [modules[s].name for s, c in checks.items() if not c["ok"]]
    print(f"{len(rows)} rows, {len(bad)} modules failed their check, {time.time() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
