"""The host cost of a call, peers in the same process: per-call wall time of 300 back-to-back calls on
tiny inputs with one sync at the end, for every public entry point, next to SDPA (cuDNN and flash
backends) and FlashAttention-4 where it runs; the host syncs one call makes (torch's sync debug mode
counts them); the kernel alone (the same call captured in a CUDA graph and replayed); the three launch
backends (runtime/launch.py) on the same calls; and one eager 32-layer decode step (attention only, a
fresh q per layer, the caches of a 32 / 8-head d128 model) at batch 1 / 8 / 64, context 1k / 8k,
contiguous and paged, next to SDPA cuDNN on the same caches.

    python bench/launch_bench.py OUT.json [--calls 300] [--steps 10]

Every tiledsl call is first checked against the float64 reference on its inputs. FA4 is optional
(None where `flash_attn.cute` is not importable; see PEERS.md for carrying it).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, D = 32, 8, 128   # the decode model (Llama-3-8B's attention)


def per_call_us(torch, fn, calls: int, rounds: int = 1) -> float:
    """Wall microseconds per call of `calls` back-to-back calls, one sync at the end (after warm-up); the
    least of `rounds` such rounds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def host_syncs(torch, fn) -> int:
    """Host synchronisations one (warm) call makes, as torch's sync debug mode reports them."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def graph_us(torch, fn, replays: int = 300) -> float:
    """Device microseconds per replay of `fn` captured in a CUDA graph: the kernel(s) alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def optional(fn):
    """fn's value, or None when the peer refuses the shape or is not installed."""
    try:
        return fn()
    except Exception:
        return None


def sdpa(torch, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def call(q, k, v, causal=False):
        with sdpa_kernel([backend]):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return call


def fa4():
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_func, flash_attn_varlen_func


def peers_of(torch, timed: dict) -> dict:
    return {name: (None if fn is None else optional(fn)) for name, fn in timed.items()}


def last_kernel(cache) -> str:
    """The kernel name of the most recently prepared call in a dispatch cache."""
    value = next(reversed(cache.values()))
    return (value[0] if isinstance(value, tuple) else value).name


def call_rows(torch, calls: int) -> list[dict]:
    import numpy as np

    import tiledsl
    from tests import attention_reference as ref
    from tiledsl.dispatch import backward as dispatch_backward
    from tiledsl.dispatch import tuned
    from tiledsl.reference.serving import paged_attention as paged_reference
    from tiledsl.serving import paged
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)   # noqa: E731
    cudnn, flash, fa = sdpa(torch, "cudnn"), sdpa(torch, "flash"), fa4()
    rows = []

    def row(api, shape, fn, check, peers, kernel, seqlen, causal, graphable=True, family="", rounds=1):
        out = fn()
        torch.cuda.synchronize()
        error = check(out)
        if not error < 2e-2:
            raise SystemExit(f"{api} {shape}: error {error} against the float64 reference")
        us = per_call_us(torch, fn, calls, rounds)
        entry = {"api": api, "shape": shape, "kernel": kernel(), "family": family, "dtype": "bf16", "head_dim": D,
                 "seqlen": seqlen, "causal": causal, "tiledsl_us": round(us, 2), "host_syncs": host_syncs(torch, fn),
                 "tiledsl_graph_us": round(graph_us(torch, fn), 2) if graphable else None, "error": error,
                 "peers": {k: (None if v is None else round(v, 2)) for k, v in peers_of(torch, peers).items()}}
        print(entry, flush=True)
        rows.append(entry)

    def err(o, want):
        return float(torch.linalg.norm(o.double() - want.double()) / torch.linalg.norm(want.double()))

    # attention prefill, 128 tokens
    q, k, v = randn(1, 16, 128, D), randn(1, 16, 128, D), randn(1, 16, 128, D)
    want = ref.attention(q.double(), k.double(), v.double(), causal=True)[0]
    row("attention", "b1 h16 n128 d128 causal", lambda: tiledsl.attention(q, k, v, causal=True), lambda o: err(o, want),
        {"sdpa_cudnn_us": lambda: per_call_us(torch, lambda: cudnn(q, k, v, True), calls),
         "sdpa_flash_us": lambda: per_call_us(torch, lambda: flash(q, k, v, True), calls),
         "fa4_us": None if fa is None else lambda: per_call_us(
             torch, lambda: fa[0](*(x.transpose(1, 2) for x in (q, k, v)), causal=True), calls)},
        lambda: last_kernel(tuned._calls), 128, True)
    # attention decode, 8 seqs x 1k
    qd, kd, vd = randn(8, HEADS, 1, D), randn(8, KV_HEADS, 1024, D), randn(8, KV_HEADS, 1024, D)
    want_d = ref.attention(qd.double(), kd.double(), vd.double())[0]
    row("attention_decode", "8 x 1k, 32/8 heads, d128", lambda: tiledsl.attention(qd, kd, vd), lambda o: err(o, want_d),
        {"sdpa_cudnn_us": lambda: per_call_us(torch, lambda: cudnn(qd, kd, vd), calls),
         "sdpa_flash_us": lambda: per_call_us(torch, lambda: flash(qd, kd, vd), calls), "fa4_us": None},
        lambda: last_kernel(tuned._calls), 1024, False)
    # paged decode, 8 x 1k, page 16 (pages in random order)
    page, pages_per_seq = 16, 1024 // 16
    order = torch.randperm(8 * pages_per_seq, device="cuda")
    table = order.view(8, pages_per_seq).to(torch.int32)
    k_cache, v_cache = randn(8 * pages_per_seq, page, KV_HEADS, D), randn(8 * pages_per_seq, page, KV_HEADS, D)
    lens = torch.full((8,), 1024, device="cuda", dtype=torch.int32)
    qp = randn(8, 1, HEADS, D)
    want_p = torch.from_numpy(paged_reference(qp.float().cpu().numpy(), k_cache.float().cpu().numpy(),
                                              v_cache.float().cpu().numpy(), table.cpu().numpy(),
                                              lens.cpu().numpy())[0]).cuda()
    fa_paged = None if fa is None else (lambda: per_call_us(torch, lambda: fa[1](
        qp.view(8, HEADS, D), k_cache, v_cache, cu_seqlens_q=torch.arange(9, device="cuda", dtype=torch.int32),
        max_seqlen_q=1, page_table=table, seqused_k=lens), calls))
    row("paged_attention", "8 x 1k, page 16, 32/8 heads", lambda: tiledsl.paged_attention(
        qp, k_cache, v_cache, table, lens), lambda o: err(o, want_p),
        {"sdpa_cudnn_us": None, "sdpa_flash_us": None, "fa4_us": fa_paged}, lambda: last_kernel(paged._calls), 1024,
        False)
    # the planned run of the same step
    planned = tiledsl.PagedAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, page_size=page,
                                     num_pages=k_cache.shape[0], dtype=torch.bfloat16, device="cuda", max_batch=8,
                                     max_pages=pages_per_seq)
    planned.plan(table.cpu().numpy(), lens.cpu().numpy())
    out_p = torch.empty_like(qp)
    row("paged_run", "8 x 1k, page 16, out=", lambda: planned.run(qp, k_cache, v_cache, out=out_p),
        lambda o: err(o, want_p), {"sdpa_cudnn_us": None, "sdpa_flash_us": None, "fa4_us": fa_paged},
        lambda: planned.planned[-1][0].name, 1024, False)
    # the same paged step with softcap and sinks (Gemma / gpt-oss serving): the host path of a modified call
    from tiledsl.mods.model import Modifications
    sinks = torch.randn(HEADS, device="cuda")
    mods = Modifications(softcap=30.0, sinks=True)
    want_m = torch.from_numpy(paged_reference(qp.float().cpu().numpy(), k_cache.float().cpu().numpy(),
                                              v_cache.float().cpu().numpy(), table.cpu().numpy(), lens.cpu().numpy(),
                                              mods=mods, aux={"sinks": sinks.double().cpu().numpy()})[0]).cuda()
    row("paged_attention_mods", "8 x 1k, page 16, softcap + sinks", lambda: tiledsl.paged_attention(
        qp, k_cache, v_cache, table, lens, softcap=30.0, sinks=sinks), lambda o: err(o, want_m),
        {"sdpa_cudnn_us": None, "sdpa_flash_us": None, "fa4_us": None}, lambda: last_kernel(paged._calls), 1024,
        False)
    planned_m = tiledsl.PagedAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, page_size=page,
                                       num_pages=k_cache.shape[0], dtype=torch.bfloat16, device="cuda", max_batch=8,
                                       max_pages=pages_per_seq, softcap=30.0, sinks=True)
    planned_m.plan(table.cpu().numpy(), lens.cpu().numpy())
    row("paged_run_mods", "8 x 1k, page 16, out=, softcap + run(sinks=)", lambda: planned_m.run(
        qp, k_cache, v_cache, out=out_p, sinks=sinks), lambda o: err(o, want_m),
        {"sdpa_cudnn_us": None, "sdpa_flash_us": None, "fa4_us": None}, lambda: planned_m.planned[-1][0].name, 1024,
        False)
    # varlen, 4 sequences (512 tokens), max_seqlen given
    lengths = [200, 17, 167, 128]
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu = torch.from_numpy(cu_host).cuda()
    total = int(cu_host[-1])
    qv, kv, vv = randn(total, 16, D), randn(total, 16, D), randn(total, 16, D)
    from tiledsl.reference.serving import varlen_attention as varlen_reference
    want_v = torch.from_numpy(varlen_reference(qv.float().cpu().numpy(), kv.float().cpu().numpy(),
                                               vv.float().cpu().numpy(), cu_host, cu_host, mask="causal")[0]).cuda()
    from tiledsl.serving import varlen as serving_varlen
    row("varlen_attention", "4 seqs, 512 tokens, h16 d128 causal", lambda: tiledsl.varlen_attention(
        qv, kv, vv, cu, cu, max(lengths), max(lengths), causal=True), lambda o: err(o, want_v),
        {"sdpa_cudnn_us": None, "sdpa_flash_us": None,
         "fa4_us": None if fa is None else lambda: per_call_us(torch, lambda: fa[1](
             qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
             causal=True), calls)},
        lambda: next(reversed(serving_varlen._kernels.values())).name, total, True)
    # forward + backward through autograd, 128 tokens
    qg, kg, vg = (randn(1, 16, 128, D).requires_grad_() for _ in range(3))
    do = randn(1, 16, 128, D)

    def step(attend):
        def run():
            o = attend(qg, kg, vg)
            o.backward(do)
            return o
        return run
    want_o, _, *want_grads = ref.gradients(qg, kg, vg, do, causal=True)

    def first_step_error(o):   # O and the gradients of a row's first step (its .grad start empty)
        return max([err(o, want_o)] + [err(x.grad, want) for x, want in zip((qg, kg, vg), want_grads)])
    # Both backward families the autograd path takes on Hopper; the least of 5 rounds, peers alike (the
    # step's time swings with the autograd engine's thread handoffs).
    default_ws = dispatch_backward.BACKWARD_WS
    for ws in (True, False):
        dispatch_backward.BACKWARD_WS = ws
        for x in (qg, kg, vg):
            x.grad = None
        row("fwd_bwd", "b1 h16 n128 d128 causal", step(lambda q, k, v: tiledsl.attention(q, k, v, causal=True)),
            first_step_error,
            {"sdpa_cudnn_us": lambda: per_call_us(torch, step(lambda q, k, v: cudnn(q, k, v, True)), calls, 5),
             "sdpa_flash_us": lambda: per_call_us(torch, step(lambda q, k, v: flash(q, k, v, True)), calls, 5),
             "fa4_us": None if fa is None else lambda: per_call_us(torch, step(
                 lambda q, k, v: fa[0](*(x.transpose(1, 2) for x in (q, k, v)), causal=True)[0].transpose(1, 2)),
                 calls, 5)},
            lambda: last_kernel(dispatch_backward._calls), 128, True, graphable=False,
            family="warp-specialized backward" if ws else "wgmma backward", rounds=5)
    dispatch_backward.BACKWARD_WS = default_ws
    return rows


def backend_rows(torch, calls: int) -> list[dict]:
    """The same warm calls through each launch backend (TILEDSL_LAUNCH), prepared afresh for each."""
    import os

    import tiledsl
    from tiledsl.runtime import launch
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)   # noqa: E731
    q, k, v = randn(1, 16, 128, D), randn(1, 16, 128, D), randn(1, 16, 128, D)
    qd, kd, vd = randn(8, HEADS, 1, D), randn(8, KV_HEADS, 1024, D), randn(8, KV_HEADS, 1024, D)
    rows = []
    for backend in launch.LAUNCH_BACKENDS:
        os.environ["TILEDSL_LAUNCH"] = backend
        launch.clear_prepared()
        used = launch.backend_name()
        entry = {"api": "launch_backend", "backend": backend, "backend_used": used,
                 "attention_us": round(per_call_us(torch, lambda: tiledsl.attention(q, k, v, causal=True), calls), 2),
                 "attention_decode_us": round(per_call_us(torch, lambda: tiledsl.attention(qd, kd, vd), calls), 2)}
        print(entry, flush=True)
        rows.append(entry)
    os.environ.pop("TILEDSL_LAUNCH", None)
    launch.clear_prepared()
    return rows


def decode_loop_rows(torch, steps: int) -> list[dict]:
    """One eager 32-layer decode step per (batch, context, paged): caches cycled over enough distinct
    layers that no layer finds its cache in L2; the contiguous cache is a strided view of the paged one
    (pages in order), so tiledsl (contiguous and paged) and SDPA cuDNN read the same bytes."""
    import tiledsl
    cudnn = sdpa(torch, "cudnn")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, page, layers = [], 16, 32
    for batch in (1, 8, 64):
        for context in (1024, 8192):
            layer_bytes = 2 * batch * KV_HEADS * context * D * 2
            distinct = min(layers, max(2, math.ceil(4 * l2 / layer_bytes)))
            pages = batch * context // page
            caches = [(torch.randn(pages, page, KV_HEADS, D, device="cuda", dtype=torch.bfloat16),
                       torch.randn(pages, page, KV_HEADS, D, device="cuda", dtype=torch.bfloat16))
                      for _ in range(distinct)]
            contiguous = [tuple(c.view(batch, context, KV_HEADS, D).transpose(1, 2) for c in pair) for pair in caches]
            table = torch.arange(pages, device="cuda", dtype=torch.int32).view(batch, context // page)
            lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            qs = [torch.randn(batch, HEADS, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            q_tok = [q.transpose(1, 2) for q in qs]   # (batch, 1, heads, d) views of the same q

            def tiledsl_step():
                for i in range(layers):
                    tiledsl.attention(qs[i], *contiguous[i % distinct])

            def paged_step():
                for i in range(layers):
                    tiledsl.paged_attention(q_tok[i], *caches[i % distinct], table, lens)

            def cudnn_step():
                for i in range(layers):
                    cudnn(qs[i], *contiguous[i % distinct])
            check = tiledsl.attention(qs[0], *contiguous[0])
            want = cudnn(qs[0], *contiguous[0])
            error = float(torch.linalg.norm((check - want).double()) / torch.linalg.norm(want.double()))
            timed = {name: step_us(torch, fn, steps) for name, fn in
                     (("tiledsl", tiledsl_step), ("paged", paged_step), ("cudnn", optional_step(cudnn_step)))}
            for paged in (False, True):
                entry = {"api": "decode_loop", "layers": layers, "batch": batch, "context": context, "paged": paged,
                         "kernel": "", "family": "decode", "dtype": "bf16", "head_dim": D, "seqlen": context,
                         "causal": False, "distinct_layer_caches": distinct, "error_vs_cudnn": error,
                         "tiledsl_us": timed["paged" if paged else "tiledsl"],
                         "peers": {"sdpa_cudnn_us": timed["cudnn"]}}
                print(entry, flush=True)
                rows.append(entry)
            caches = contiguous = None   # this shape's memory back before the next one's
            torch.cuda.empty_cache()
    return rows


def optional_step(fn):
    def run():
        try:
            fn()
        except Exception:
            return "refused"
    return run


def step_us(torch, fn, steps: int):
    """Median wall microseconds of one step (sync before and after each)."""
    if fn() == "refused":
        return None
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(times), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="write the run as JSON here")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    import torch

    from tiledsl.runtime import launch
    from tiledsl.tune.bench import record
    torch.manual_seed(0)
    rows = call_rows(torch, args.calls) + backend_rows(torch, args.calls) + decode_loop_rows(torch, args.steps)
    record(Path(args.out), " ".join(["python", *sys.argv]), rows, launch_backend=launch.backend_name(),
           fa4_available=fa4() is not None, torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
