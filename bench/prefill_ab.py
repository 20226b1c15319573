"""The hopper family's tile scheduler and tilings (issue: prefill ahead of FlashAttention-4), one A/B run.

Every variant is a spec differing from the tuned table's by one line or one tile (`launch grid | persistent |
dynamic`, FA3's d256 128 x 80 with intra overlap on a grid launch, d64 192 x 192 with three consumers). Each
is checked against float64 (NaN-poisoned outputs, ragged and GQA shapes) before it is timed; failures are
recorded and left out of the timings. Per shape (PEERS.md convention: bf16, 16k tokens, hidden 2048; and the
issue's model shapes) it times, in the same process:

* each variant through its kernel call (`tflops`: what hopper_ablation.py reports) and replayed from a CUDA
  graph of GRAPH_CALLS calls (`tflops_graph`: the kernel alone, no host cost);
* `tiledsl.attention` itself (`api` rows: what a user gets, host cost included);
* the peers in the same run: FA4 (`flash_attn.cute`, when importable), SDPA cuDNN and flash, eager and
  from a graph (`peers`, `peers_graph`);
* the host cost per call of each entry point on a tiny shape (`host_us`), and a profile of
  `tiledsl.attention`'s host path (`host_profile`: the top functions by own time).

    python bench/prefill_ab.py OUT.json [--dims 64 128 256] [--seqlens 1024 2048 4096 16384] [--rep-ms 40]
                               [--no-model-shapes] [--check-only]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.dispatch.tuned import TUNED, hopper_schedule  # noqa: E402
from tiledsl.spec import DType, ItemOrder, KernelSpec, LaunchKind, Mask, Problem  # noqa: E402
from tiledsl.tune.bench import attention_flops, prefill_shape, random_inputs, record, time_ms  # noqa: E402

GRAPH_CALLS = 10   # calls per captured graph: one replay's time / GRAPH_CALLS is a call without host cost
# (label, batch, heads, kv_heads, seqlen, head_dim, causal): the model shapes
MODEL_SHAPES = [("llama3-8b 8k causal", 2, 32, 8, 8192, 128, True), ("gqa prompt 3000 causal", 4, 32, 8, 3000, 128, True),
                ("d256 gqa 8k causal", 2, 16, 4, 8192, 256, True)]
CHECKS = [dict(batch=2, heads=3, q_len=1000, kv_len=1000), dict(batch=1, heads=2, q_len=4097, kv_len=4097),
          dict(batch=2, heads=4, q_len=17, kv_len=300, kv_heads=2), dict(batch=4, heads=16, q_len=300, kv_len=1000),
          dict(batch=2, heads=8, q_len=1000, kv_len=1000, kv_heads=2)]


def tuned(d: int, causal: bool):
    return TUNED[("sm_90", "bf16", d, "causal" if causal else "none")]


def variants(d: int, causal: bool) -> dict[str, KernelSpec]:
    """name -> spec. "tuned" is the table's schedule with the runtime's launch (what `tiledsl.attention`
    runs today); the rest change one thing."""
    from dataclasses import replace
    base = tuned(d, causal)
    problem = Problem(d, d, DType.BF16, Mask.CAUSAL if causal else Mask.NONE)
    schedules = {"tuned": base}
    if base.launch is None:   # the runtime's choice: time each launch (an entry that names one was chosen by a run)
        for launch in LaunchKind:
            schedules[f"tuned {launch.value}"] = replace(base, launch=launch)
        if causal:
            schedules["tuned dynamic pair_by_pair"] = replace(base, launch=LaunchKind.DYNAMIC,
                                                              item_order=ItemOrder.PAIR_BY_PAIR)
    if d == 256:   # the table's entries before FA3's 128 x 80 intra tiling (grid only: the walk's state spills)
        schedules["kv80"] = hopper_schedule(128, 80, 2)
        schedules["kv64 intra"] = hopper_schedule(128, 64, 2, intra=True)
    if d == 64:    # FA3's 192 x 192 (P packed into S's registers without intra overlap)
        schedules["q192 kv192 c3"] = hopper_schedule(192, 192, 3)
        schedules["q192 kv192 c3 dynamic"] = hopper_schedule(192, 192, 3, launch=LaunchKind.DYNAMIC)
    return {name: KernelSpec(f"ab_d{d}", problem, s) for name, s in schedules.items()}


def check(kernel, spec) -> float:
    from tiledsl.reference.gpu import run_errors
    worst = 0.0
    for c in CHECKS:
        q, k, v = random_inputs(spec.problem, c["batch"], c["heads"], c["q_len"], c["kv_len"], c.get("kv_heads"))
        err_o, err_lse = run_errors(kernel, q, k, v)
        if not (err_o < 1e-2 and err_lse < 1e-3):
            raise AssertionError(f"{spec.kernel_name} {c}: O error {err_o}, LSE error {err_lse}")
        worst = max(worst, err_o, err_lse * 10)
    return worst


def fa4():
    """flash_attn.cute.flash_attn_func, or None where FA4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None
    return flash_attn_func


def graph_ms(fn) -> float | None:
    """Milliseconds per call of `fn` replayed from a CUDA graph of GRAPH_CALLS calls (None: not capturable)."""
    import torch
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up on a side stream, as torch recommends before capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        return time_ms(graph.replay, rep_ms=ARGS.rep_ms) / GRAPH_CALLS
    except Exception as err:
        print(f"  graph capture failed: {str(err).splitlines()[0][:160]}", flush=True)
        return None


def peers(q, k, v, causal: bool) -> tuple[dict, dict]:
    """({peer: ms}, {peer: ms from a graph}): FA4, SDPA cuDNN and flash on the same tensors."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    gqa = q.shape[1] != k.shape[1]
    eager, graph = {}, {}
    for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                def fn():
                    return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
                fn()
                torch.cuda.synchronize()
                eager[label], graph[label] = time_ms(fn, rep_ms=ARGS.rep_ms), graph_ms(fn)
        except Exception as err:   # a backend that refuses the shape is recorded as missing
            eager[label] = graph[label] = None
            eager[label + "_error"] = str(err).splitlines()[0][:200]
    flash4 = fa4()
    if flash4 is not None:
        qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))   # FA4 takes (batch, seqlen, heads, d)
        try:
            def fn4():
                return flash4(qs, ks, vs, causal=causal)
            fn4()
            torch.cuda.synchronize()
            eager["fa4"], graph["fa4"] = time_ms(fn4, rep_ms=ARGS.rep_ms), graph_ms(fn4)
        except Exception as err:
            eager["fa4"] = graph["fa4"] = None
            eager["fa4_error"] = str(err).splitlines()[0][:200]
    return eager, graph


def tflops(flops: float, ms):
    return flops / ms / 1e9 if isinstance(ms, float) else None


def host_costs(kernels: dict) -> tuple[dict, list[str]]:
    """Microseconds per call of 300 back-to-back calls on a tiny shape (one sync at the end), and the top of
    a profile of `tiledsl.attention`'s host path."""
    import torch
    import tiledsl
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernel = next(kern for (d, causal, name), kern in kernels.items() if d == 128 and causal and name == "tuned")
    calls = {"tiledsl.attention": lambda: tiledsl.attention(q, k, v, causal=True),
             "kernel call": lambda: kernel(q, k, v)}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        calls["sdpa_cudnn"] = lambda: sdpa(q, k, v, is_causal=True)
        flash4 = fa4()
        if flash4 is not None:
            qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            calls["fa4"] = lambda: flash4(qs, ks, vs, causal=True)
        out = {}
        for name, fn in calls.items():
            try:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(300):
                    fn()
                torch.cuda.synchronize()
                out[name] = (time.perf_counter() - started) / 300 * 1e6
            except Exception as err:
                out[name] = None
                out[name + "_error"] = str(err).splitlines()[0][:200]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        tiledsl.attention(q, k, v, causal=True)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    return out, text.getvalue().splitlines()[-40:]


def time_shape(label, d, causal, batch, heads, kv_heads, n, kernels, checked, rows) -> None:
    import torch
    import tiledsl
    problem = Problem(d, d, DType.BF16, Mask.CAUSAL if causal else Mask.NONE)
    q, k, v = random_inputs(problem, batch, heads, n, n, kv_heads)
    flops = attention_flops(batch, heads, n, n, d, causal)
    eager, graph = peers(q, k, v, causal)
    peer_tflops = {p: tflops(flops, ms) for p, ms in eager.items() if not p.endswith("_error")}
    peer_graph = {p: tflops(flops, ms) for p, ms in graph.items()}
    shape = {"family": "hopper", "dtype": "bf16", "head_dim": d, "seqlen": n, "batch": batch, "heads": heads,
             "kv_heads": kv_heads, "causal": causal, "shape": label, "peers": peer_tflops, "peers_graph": peer_graph,
             "peer_errors": {p: e for p, e in eager.items() if p.endswith("_error")}}

    def api():
        return tiledsl.attention(q, k, v, causal=causal)
    api()
    torch.cuda.synchronize()
    ms = time_ms(api, rep_ms=ARGS.rep_ms)
    rows.append({**shape, "kernel": "tiledsl.attention", "variant": "api", "ms": ms, "tflops": tflops(flops, ms),
                 "tflops_graph": tflops(flops, graph_ms(api))})
    for (dd, cc, name), kernel in kernels.items():
        if (dd, cc) != (d, causal) or checked[(dd, cc, name)] is None:
            continue
        ms = time_ms(lambda: kernel(q, k, v), rep_ms=ARGS.rep_ms)
        ms_graph = graph_ms(lambda: kernel(q, k, v))
        row = {**shape, "kernel": kernel.name, "variant": name, "ms": ms, "ms_graph": ms_graph,
               "tflops": tflops(flops, ms), "tflops_graph": tflops(flops, ms_graph)}
        rows.append(row)
        best = max((t for t in peer_graph.values() if t), default=0)
        print(f"d{d} {'causal' if causal else 'none  '} {n:6d} {label[:22]:22s} {name:28s} "
              f"{row['tflops']:6.1f} / graph {row['tflops_graph'] or 0:6.1f} TFLOP/s  best peer (graph) {best:6.1f}"
              f"  fa4 {peer_graph.get('fa4') or 0:6.1f}", flush=True)


ARGS = None


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 16384])
    ap.add_argument("--rep-ms", type=int, default=40, help="timing window per measurement (do_bench rep)")
    ap.add_argument("--no-model-shapes", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=400,
                    help="shapes not started by then are skipped (the file is written after every shape)")
    ARGS = args = ap.parse_args()
    from tiledsl import compile
    specs = {(d, c, name): spec for d in args.dims for c in (False, True) for name, spec in variants(d, c).items()}
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:   # NVRTC compiles in parallel
        kernels = dict(zip(specs, pool.map(compile, specs.values())))
        list(pool.map(lambda kern: kern.function(), kernels.values()))
    print(f"compiled {len(kernels)} kernels in {time.time() - started:.1f} s", flush=True)
    checked = {}
    for key, kernel in kernels.items():
        try:
            checked[key] = check(kernel, specs[key])
            print(f"ok   {key} {kernel.name} worst {checked[key]:.2e}", flush=True)
        except Exception as err:
            checked[key] = None
            print(f"FAIL {key} {kernel.name}: {err}", flush=True)
    rows, host, profile, skipped = [], {}, [], []

    def save():
        record(args.out, "python bench/prefill_ab.py " + " ".join(sys.argv[2:]), rows,
               checks={"|".join(map(str, key)): value for key, value in checked.items()},
               kernels={"|".join(map(str, key)): kern.name for key, kern in kernels.items()},
               host_us=host, host_profile=profile, graph_calls=GRAPH_CALLS, skipped=skipped,
               seconds=round(time.time() - started, 1))
    if not args.check_only:
        host, profile = host_costs(kernels) if 128 in args.dims else ({}, [])
        print("host us per call:", {k: round(v, 1) if isinstance(v, float) else v for k, v in host.items()})
        shapes = []
        for d in args.dims:
            for causal in (False, True):
                for n in args.seqlens:
                    batch, heads = prefill_shape(n, d)
                    shapes.append(("peers convention", d, causal, batch, heads, heads, n))
        shapes.sort(key=lambda shape: shape[-1])   # the short sequences (the largest gaps) first
        if not args.no_model_shapes:
            shapes += [(label, d, causal, batch, heads, kv_heads, n)
                       for label, batch, heads, kv_heads, n, d, causal in MODEL_SHAPES if d in args.dims]
        for shape in shapes:
            if time.time() - started > args.deadline_s:
                skipped.append(shape)
                continue
            time_shape(*shape, kernels, checked, rows)
            save()
    print(f"total {time.time() - started:.0f} s; skipped {len(skipped)} shapes past the deadline", flush=True)
    save()
    return 0 if all(value is not None for value in checked.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
