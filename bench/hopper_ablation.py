"""FA3's ablation rebuilt from DSL knobs, and the hopper family against SDPA in the same run.

Each variant is a spec; the rows of one shape differ by one schedule line: FA2 on wgmma (the bundled
spec) -> hopper (TMA producer, no overlap) -> + pingpong -> + intra -> both. Every kernel is checked
against the float64 reference (NaN-poisoned outputs) before it is timed.

    python bench/hopper_ablation.py OUT.json [--dims 64 128] [--seqlens 1024 4096 8192 16384]
                                    [--causal both|yes|no] [--variants NAME ...] [--check-only]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import attention_flops, prefill_shape, random_inputs, record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_specs

HOPPER = """attention {name} {{
    head_dim = {d}
    dtype    = bf16
    mask     = {mask}
    schedule {{
        order      q, kv
        tile       q = {q}, kv = {kv}
        warpgroups producer 1 regs {pregs}, consumer {consumers} regs {cregs}
        pipeline   {stages} stages via tma
{overlap}    }}
}}
"""


def hopper(d, causal, overlap="", q=128, kv=128, consumers=2, stages=2, pregs=24, cregs=240):
    line = f"        overlap    {overlap}\n" if overlap else ""
    text = HOPPER.format(name="h", d=d, mask="causal" if causal else "none", q=q, kv=kv, pregs=pregs,
                         consumers=consumers, cregs=cregs, stages=stages, overlap=line)
    return load_specs(text)[0]


def fa2_wgmma(d, causal):
    return load_specs(str(ROOT / "specs" / f"fa2_wgmma_d{d}{'_causal' if causal else ''}.tile"))[0]


def variants(d, causal):
    """name -> spec: the ablation chain, then tile and consumer-count alternatives. Kernels launch as
    the runtime chooses (persistent without a mask, one block per work item otherwise); a name
    ending in " grid" or " persistent" forces one launch."""
    if d == 256:
        return {"hopper kv80": hopper(d, causal, kv=80), "hopper+intra kv64": hopper(d, causal, "intra", kv=64)}
    out = {"fa2_wgmma": fa2_wgmma(d, causal), "hopper": hopper(d, causal),
           "hopper+pingpong": hopper(d, causal, "pingpong"), "hopper+intra": hopper(d, causal, "intra"),
           "hopper+both": hopper(d, causal, "pingpong, intra"),
           "hopper+intra " + ("persistent" if causal else "grid"): hopper(d, causal, "intra")}
    if d == 128:
        out["hopper+intra kv176"] = hopper(d, causal, "intra", kv=176)
    if d == 64:
        out["hopper+intra c3 q192"] = hopper(d, causal, "intra", q=192, consumers=3, pregs=32, cregs=160)
        out["hopper+both c3 q192"] = hopper(d, causal, "pingpong, intra", q=192, consumers=3, pregs=32, cregs=160)
    return out


CHECKS = [dict(batch=2, heads=3, q_len=1000, kv_len=1000), dict(batch=1, heads=2, q_len=4097, kv_len=4097),
          dict(batch=2, heads=4, q_len=17, kv_len=300, kv_heads=2), dict(batch=2, heads=2, q_len=300, kv_len=1000)]


def check(kernel, spec) -> float:
    from tiledsl.reference.gpu import run_errors
    worst = 0.0
    for c in CHECKS:
        q, k, v = random_inputs(spec.problem, c["batch"], c["heads"], c["q_len"], c["kv_len"], c.get("kv_heads"))
        err_o, err_lse = run_errors(kernel, q, k, v)
        worst = max(worst, err_o, err_lse * 10)
        if not (err_o < 1e-2 and err_lse < 1e-3):
            raise AssertionError(f"{spec.kernel_name} {c}: O error {err_o}, LSE error {err_lse}")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--variants", nargs="*")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=100, help="timing window per kernel and shape (do_bench rep)")
    args = ap.parse_args()
    from tiledsl import compile
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    specs = {(d, c, name): spec for d in args.dims for c in causals for name, spec in variants(d, c).items()
             if not args.variants or name in args.variants}
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:   # NVRTC compiles in parallel
        kernels = dict(zip(specs, pool.map(lambda s: compile(s), specs.values())))
        for (_, _, name), kernel in kernels.items():
            kernel.persistent = {" grid": False, " persistent": True}.get(name[name.rfind(" "):]) if " " in name else None
        list(pool.map(lambda k: k.function(), kernels.values()))
    print(f"compiled {len(kernels)} kernels in {time.time() - started:.1f} s", flush=True)
    rows, checked = [], {}
    for key, kernel in kernels.items():
        try:
            checked[key] = check(kernel, specs[key])
            print(f"ok   {key} worst {checked[key]:.2e}", flush=True)
        except Exception as err:
            checked[key] = None
            print(f"FAIL {key}: {err}", flush=True)
    if not args.check_only:
        for d in args.dims:
            for causal in causals:
                for n in args.seqlens:
                    batch, heads = prefill_shape(n, d)
                    problem = next(sp for (dd, _, _), sp in specs.items() if dd == d).problem
                    q, k, v = random_inputs(problem, batch, heads, n, n)
                    flops = attention_flops(batch, heads, n, n, d, causal)
                    peers = {name: flops / t / 1e9 for name, t in sdpa_peers(q, k, v, causal, args.rep_ms).items()
                             if isinstance(t, float)}
                    for (dd, cc, name), kernel in kernels.items():
                        if (dd, cc) != (d, causal) or checked[(dd, cc, name)] is None:
                            continue
                        ms = time_ms(lambda: kernel(q, k, v), rep_ms=args.rep_ms)
                        spec = specs[(dd, cc, name)]
                        row = {"kernel": spec.kernel_name, "variant": name, "family": spec.family.value, "dtype": "bf16",
                               "head_dim": d, "seqlen": n, "batch": batch, "heads": heads, "causal": causal, "ms": ms,
                               "tflops": flops / ms / 1e9, "peers": peers}
                        rows.append(row)
                        cudnn = peers.get("sdpa_cudnn")
                        print(f"d{d} {'causal' if causal else 'none  '} {n:6d} {name:22s} {row['tflops']:6.1f} TFLOP/s"
                              f"  cuDNN {cudnn or 0:6.1f}  x{row['tflops'] / cudnn if cudnn else 0:.3f}", flush=True)
    record(args.out, "python bench/hopper_ablation.py " + " ".join(sys.argv[2:]), rows,
           checks={"|".join(map(str, k)): v for k, v in checked.items()})
    return 0 if all(v is not None for v in checked.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
