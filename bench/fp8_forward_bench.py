"""FP8 attention forward on the H200: accuracy (FA3's table) and speed, peers in the same run.

    python bench/fp8_forward_bench.py OUT.json
    python bench/fp8_forward_bench.py --variants OUT.json [--head-dims 256 ...]
    python bench/fp8_forward_bench.py --quantize OUT.json


Accuracy rows {"kind": "accuracy", "variant": bf16 | fp8_tensor | fp8_block | fp8_block_hadamard, "head_dim": 128,
"seqlen": 8192, "rmse"}: RMSE of O against float64 attention (on the GPU) of inputs N(0, 1) + N(0, 100) *
Bernoulli(0.001) (FlashAttention-3's outliers), batch 1, 4 heads. Speed rows (kernel, family, dtype "e4m3",
head_dim, seqlen, causal, tflops eager and CUDA graph, quantize_ms of quantize_fp8 with per-block descales + the
rotation and quantize_gbps its bytes (16-bit in, e4m3 out: 3 per value of q, k, v) per second, peers {cudnn_fp8,
sdpa_cudnn_bf16}); cuDNN FP8 through cudnn-frontend's sdpa_fp8 when `cudnn` imports
(else null with the reason in "skipped"). 16k tokens per row (batch 16k / seqlen), 16 heads. At 16k, d128 and d256
also tflops_pingpong: the same schedule with `overlap pingpong`.

--variants: every schedule of tiledsl.dispatch.tuned.FP8_VARIANTS side by side at 16k tokens (batch 1, 16 heads,
seqlen 16384), none and causal, per-head descales: rows {"kind": "variant", "variant", "tuned" (TUNED_FP8's pick),
kernel, family, dtype, head_dim, seqlen, causal, tflops (eager through tiledsl.attention, TUNED_FP8 pointed at the
variant), tflops_graph (the same call replayed from a CUDA graph), max_abs_vs_base (O against the "base" variant's on
the same input), peers {cudnn_fp8, sdpa_cudnn_bf16}}; `--head-dims` times only those head dims' variants. The kernels
compile in parallel first (NVRTC's disk cache), so the run is a few minutes.
"""
from __future__ import annotations

import itertools
import sys

import tiledsl
from tiledsl.tune.bench import record


def _time(torch, fn, graph: bool = False) -> float:
    """Median milliseconds of fn over 20 runs (events), eager or replayed from a CUDA graph."""
    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def accuracy_rows(torch) -> list[dict]:
    from tiledsl.reference.forward import naive_attention
    import cupy
    torch.manual_seed(0)
    shape = (1, 4, 8192, 128)

    def outliers():
        x = torch.randn(shape, device="cuda") + 10 * torch.randn(shape, device="cuda") * (
            torch.rand(shape, device="cuda") < 1e-3)
        return x.to(torch.bfloat16)
    q, k, v = outliers(), outliers(), outliers()
    ref, _ = naive_attention(*(cupy.asarray(x.double()) for x in (q, k, v)))
    rows = []

    def rmse(o):
        return float(cupy.sqrt(cupy.mean((cupy.asarray(o.double()) - ref) ** 2)))
    rows.append({"kind": "accuracy", "variant": "bf16", "head_dim": 128, "seqlen": 8192, "rmse": rmse(
        tiledsl.attention(q, k, v))})
    for variant, block, rotate in (("fp8_tensor", "tensor", None), ("fp8_block", (128, 128), None),
                                   ("fp8_block_hadamard", (128, 128), "hadamard")):
        q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v, block=block, rotate=rotate, seed=1)
        o = tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
        rows.append({"kind": "accuracy", "variant": variant, "head_dim": 128, "seqlen": 8192, "rmse": rmse(o)})
    return rows


def _cudnn_fp8(torch, q8, k8, v8, causal: bool):
    """A timed callable of cuDNN's sdpa_fp8 on the same bytes (tensors (b, h, s, d)), or (None, reason)."""
    try:
        import cudnn
    except ImportError as err:
        return None, f"cudnn-frontend not importable ({err})"
    try:
        b, h, s, d = q8.shape
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
        tq, tk, tv = (graph.tensor_like(x.view(torch.uint8)) for x in (q8, k8, v8))
        for t in (tq, tk, tv):
            t.set_data_type(cudnn.data_type.FP8_E4M3)
        scale = torch.ones(1, 1, 1, 1, dtype=torch.float32, device="cuda")
        scales = [graph.tensor_like(scale) for _ in range(6)]
        o, _, amax_s, amax_o = graph.sdpa_fp8(tq, tk, tv, *scales, is_inference=True, attn_scale=d ** -0.5,
                                              use_causal_mask=causal)
        out = torch.empty_like(q8.view(torch.uint8))
        amax = torch.empty(1, 1, 1, 1, dtype=torch.float32, device="cuda")
        o.set_output(True).set_data_type(cudnn.data_type.FP8_E4M3)
        for a in (amax_s, amax_o):
            a.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        graph.build([cudnn.heur_mode.A])
        pack = {tq: q8.view(torch.uint8), tk: k8.view(torch.uint8), tv: v8.view(torch.uint8), o: out,
                amax_s: amax, amax_o: torch.empty_like(amax), **{t: scale for t in scales}}
        work = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
        return (lambda: graph.execute(pack, work)), ""
    except Exception as err:   # the frontend's API differs across versions: record why
        return None, f"cudnn sdpa_fp8 failed: {type(err).__name__}: {err}"


def _pingpong(torch, q8, k8, v8, qs, ks, vs, causal: bool):
    """A timed callable of the FP8 kernel of this call's tuned schedule with `overlap pingpong` added."""
    from dataclasses import replace
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.dispatch.tuned import fp8_descale_kind, fp8_spec
    spec = fp8_spec("sm_90", q8.shape[-1], tiledsl.Mask.CAUSAL if causal else tiledsl.Mask.NONE, None, None,
                    fp8_descale_kind(qs, ks, vs), tiledsl.DType.BF16)
    kernel = kernel_for(replace(spec, name=spec.name + "_pingpong", schedule=replace(spec.schedule, pingpong=True)))
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q8.shape[:3], dtype=torch.float32, device="cuda")
    return lambda: kernel(q8, k8, v8, out=out, lse=lse, q_descale=qs, k_descale=ks, v_descale=vs)


def speed_rows(torch) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    rows, tokens, heads = [], 16384, 16
    for d in (64, 128, 256):
        for seqlen in (4096, 16384):
            for causal in (False, True):
                batch = tokens // seqlen
                q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda").to(torch.bfloat16) for _ in range(3))
                quant = _time(torch, lambda: tiledsl.quantize_fp8(q, k, v, block=128,
                                                                  rotate="hadamard"))
                q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)

                def run():
                    return tiledsl.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
                flops = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
                eager, graphed = _time(torch, run), _time(torch, run, graph=True)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    bf16 = _time(torch, lambda: sdpa(q, k, v, is_causal=causal))
                peer, why = _cudnn_fp8(torch, q8, k8, v8, causal)
                cudnn_ms = _time(torch, peer) if peer else None
                row = {"kind": "speed", "kernel": tiledsl.dispatch.tuned.fp8_spec(
                           "sm_90", d, tiledsl.Mask.CAUSAL if causal else tiledsl.Mask.NONE, None, None,
                           tiledsl.dispatch.tuned.fp8_descale_kind(qs, ks, vs), tiledsl.DType.BF16).kernel_name,
                       "family": "hopper", "dtype": "e4m3", "head_dim": d, "seqlen": seqlen, "batch": batch,
                       "heads": heads, "causal": causal, "tflops": flops / eager / 1e9,
                       "tflops_graph": flops / graphed / 1e9, "quantize_ms": quant,
                       "quantize_gbps": 3 * 3 * q.numel() / quant / 1e6, "attention_ms": eager,
                       "peers": {"cudnn_fp8": flops / cudnn_ms / 1e9 if cudnn_ms else None,
                                 "sdpa_cudnn_bf16": flops / bf16 / 1e9}}
                if why:
                    row["skipped"] = {"cudnn_fp8": why}
                if seqlen == 16384 and d >= 128:   # the tuned schedule with ping-pong, same inputs (not tuned yet)
                    pingpong = _pingpong(torch, q8, k8, v8, qs, ks, vs, causal)
                    row["tflops_pingpong"] = flops / _time(torch, pingpong) / 1e9
                rows.append(row)
                print(row, flush=True)
    return rows


def _variant_spec(d: int, causal: bool, schedule, descale):
    """The spec tiledsl.attention runs for FP8 at head dim d with TUNED_FP8's entry set to `schedule`."""
    from tiledsl.dispatch import tuned
    key = ("sm_90", d)
    kept = tuned.TUNED_FP8[key]
    tuned.TUNED_FP8[key] = schedule
    try:
        return tuned.fp8_spec("sm_90", d, tiledsl.Mask.CAUSAL if causal else tiledsl.Mask.NONE, None, None, descale,
                              tiledsl.DType.BF16)
    finally:
        tuned.TUNED_FP8[key] = kept


def _compile_all(specs) -> None:
    """NVRTC for every spec at once (threads; the cubins land in the disk cache kernel_for loads from)."""
    from concurrent.futures import ThreadPoolExecutor
    from tiledsl.families import compile as compile_kernel
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    arch = device_arch()
    kernels = [compile_kernel(s) for s in specs]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: compile_cubin(k.source, k.name, arch), kernels))


def variant_rows(torch, head_dims: list[int] | None = None) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from tiledsl.dispatch import tuned
    from tiledsl.runtime.launch import clear_prepared
    from tiledsl.spec import Descale
    batch, heads, seqlen = 1, 16, 16384
    picked = {d: next(n for n, s in v.items() if s == tuned.TUNED_FP8[("sm_90", d)])
              for d, v in tuned.FP8_VARIANTS.items()}
    timed = {d: v for d, v in tuned.FP8_VARIANTS.items() if head_dims is None or d in head_dims}
    specs = {(d, causal, name): _variant_spec(d, causal, schedule, Descale.PER_HEAD)   # quantize_fp8 default
             for d, variants in timed.items() for causal in (False, True)
             for name, schedule in variants.items()}
    _compile_all(list(specs.values()))
    rows = []
    for d, variants in timed.items():
        q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda").to(torch.bfloat16) for _ in range(3))
        q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
        for causal in (False, True):
            flops = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                bf16 = _time(torch, lambda: sdpa(q, k, v, is_causal=causal))
            peer, why = _cudnn_fp8(torch, q8, k8, v8, causal)
            peers = {"cudnn_fp8": flops / _time(torch, peer) / 1e9 if peer else None,
                     "sdpa_cudnn_bf16": flops / bf16 / 1e9}
            base = None
            for name, schedule in variants.items():
                key, kept = ("sm_90", d), tuned.TUNED_FP8[("sm_90", d)]
                tuned.TUNED_FP8[key] = schedule
                clear_prepared()   # the prepared FP8 call holds the last variant's kernel
                try:
                    def run():
                        return tiledsl.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
                    out = run().float()
                    eager, graphed = _time(torch, run), _time(torch, run, graph=True)
                finally:
                    tuned.TUNED_FP8[key] = kept
                    clear_prepared()
                base = out if base is None else base
                row = {"kind": "variant", "variant": name, "tuned": name == picked[d],
                       "kernel": specs[(d, causal, name)].kernel_name, "family": "hopper", "dtype": "e4m3",
                       "head_dim": d, "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal,
                       "tflops": flops / eager / 1e9, "tflops_graph": flops / graphed / 1e9,
                       "max_abs_vs_base": float((out - base).abs().max()), "peers": peers}
                if why:
                    row["skipped"] = {"cudnn_fp8": why}
                rows.append(row)
                print(row, flush=True)
    return rows


def quantize_rows(torch) -> list[dict]:
    tokens, heads, kv_heads = 16384, 16, 8
    lengths = [100 + (3996 - 100) * i // 7 for i in range(8)]
    lengths[-1] += tokens - sum(lengths)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    rows = []
    for d in (64, 128, 256):
        shapes = (heads, kv_heads, kv_heads)
        batched = [torch.randn(4, h, tokens // 4, d, device="cuda").to(torch.bfloat16) for h in shapes]
        packed = [torch.randn(tokens, h, d, device="cuda").to(torch.bfloat16) for h in shapes]

        def cast():
            for t in batched:
                (t / (t.abs().amax() / 448)).to(torch.float8_e4m3fn)
        cast_ms = _time(torch, cast)
        elements = sum(t.numel() for t in batched)
        for layout, tensors in (("batched", batched), ("packed", packed)):
            extra = {} if layout == "batched" else {"cu_seqlens_q": offsets, "cu_seqlens_k": offsets,
                                                    "max_seqlen_q": max(lengths), "max_seqlen_k": max(lengths)}
            for block in (None, 128):
                for rotate in (None, "hadamard"):
                    def run():
                        return tiledsl.quantize_fp8(*tensors, block=block, rotate=rotate, **extra)
                    run()
                    ms = _time(torch, run)
                    graph_us = _time(torch, run, graph=True) * 1e3
                    row = {"kind": "quantize", "kernel": "quantize_fp8", "family": "quantize", "dtype": "e4m3",
                           "layout": layout, "block": block, "rotate": rotate, "head_dim": d, "seqlen": tokens,
                           "causal": False, "tokens": tokens, "quantize_ms": ms, "quantize_us_graph": graph_us,
                           "quantize_gbps": 3 * elements / ms / 1e6, "peers": {"torch_cast_ms": cast_ms}}
                    rows.append(row)
                    print(row, flush=True)
    return rows


def main(argv: list[str]) -> int:
    variants = "--variants" in argv[1:]
    quantize = "--quantize" in argv[1:]
    args = [a for a in argv[1:] if a not in ("--variants", "--quantize")]
    head_dims = None
    if "--head-dims" in args:
        at = args.index("--head-dims")
        head_dims = [int(a) for a in args[at + 1:]]
        args = args[:at]
    if len(args) != 1 or head_dims == []:
        print(__doc__)
        return 2
    import torch
    import tiledsl.dispatch.tuned  # noqa: F401  (the kernel names of the rows)
    if quantize:
        rows = quantize_rows(torch)
    elif variants:
        rows = variant_rows(torch, head_dims)
    else:
        rows = accuracy_rows(torch)
        for r in rows:
            print(r, flush=True)
        rows += speed_rows(torch)
    record(args[0], " ".join(["python"] + argv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
