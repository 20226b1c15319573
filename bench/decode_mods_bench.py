"""Decode and paged decode with score modifications (softcap, ALiBi, sinks) against the same unmodified
decode kernel, same run, same data: a modified decode call should cost what the unmodified one does (decode
reads K and V once; the modification is a few instructions per score).

    python bench/decode_mods_bench.py OUT.json [--shapes small]

Rows (tiledsl.tune.bench.record): kernel, family decode, dtype bf16, head_dim, seqlen (keys per sequence),
causal (q_len > 1), batch, heads, kv_heads, q_len, path (contiguous | paged: page 16, pages in random order),
mod (none | softcap | alibi | sinks | all), timing (kernel: bind()'s launch | eager: the public call,
tiledsl.attention / tiledsl.paged_attention, host path included | graph: CUDA-graph replay of the public call),
ms, gbps (K + V bytes / time), ratio (the `none` row's ms at the same shape, path and timing over this row's:
the target is >= 0.97), and peers measured in the same run: fa4 (flash_attn.cute's flash_attn_func with its
softcap / learnable_sink on the contiguous cache; None where it is not importable or refuses) and flex
(FlexAttention compiled, softcap and ALiBi as score_mods; None for sinks, which it has no form for).
Every tiledsl kernel is checked against the float64 reference on a small case (fresh inputs, kv_lens with a 0)
before it is timed; a failed check is recorded in `checks` and its rows are left out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tiledsl  # noqa: E402
from tiledsl.dispatch.modified import modifications  # noqa: E402
from tiledsl.dispatch.tuned import tuned_spec  # noqa: E402
from tiledsl.serving.paged import paged_spec  # noqa: E402
from tiledsl.spec import DType, Mask  # noqa: E402
from tiledsl.tune.bench import record, shuffled_pages, time_ms  # noqa: E402

CAP, PAGE = 30.0, 16
MODS = ("none", "softcap", "alibi", "sinks", "all")
# (batch, heads, kv_heads, head_dim, kv_len, q_len): Gemma-2-like d128 GQA decode, a long context, 4 speculative
# queries, gpt-oss-like d64 (64 heads over 8 kv heads)
SHAPES = {"full": [(8, 32, 8, 128, 8192, 1), (1, 32, 8, 128, 65536, 1), (8, 32, 8, 128, 8192, 4),
                   (8, 64, 8, 64, 8192, 1)],
          "small": [(4, 16, 4, 128, 4096, 1), (4, 16, 4, 64, 4096, 4)]}


def keywords(mod: str, heads: int, device="cuda") -> dict:
    """tiledsl's keywords for `mod` (fresh slopes and sinks)."""
    slopes = torch.rand(heads, device=device) * 0.1
    sinks = torch.randn(heads, device=device)
    return {"none": {}, "softcap": {"softcap": CAP}, "alibi": {"alibi_slopes": slopes}, "sinks": {"sinks": sinks},
            "all": {"softcap": CAP, "alibi_slopes": slopes, "sinks": sinks}}[mod]


def check(mod: str, d: int, q_len: int) -> str:
    """"" when the contiguous and paged calls of `mod` match the float64 references on a small case."""
    from tiledsl.reference import serving
    from tiledsl.reference.forward import reference_attention
    batch, heads, kv_heads, n = 3, 8, 2, 300
    q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor([0, 129, 300], device="cuda", dtype=torch.int32)
    kw = keywords(mod, heads)
    causal = q_len > 1
    aux = {name: t.double().cpu().numpy() for name, t in kw.items() if torch.is_tensor(t)}
    try:
        out = tiledsl.attention(q, k, v, causal=causal, kv_lens=lens, **kw)
        spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=causal, **kw))[0]
        if spec.family.value != "decode":
            return f"dispatched to {spec.family.value}, not decode"
        ref, _ = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)), lens.cpu().numpy(),
                                     aux=aux)
        errors = [_error(out.double().cpu().numpy(), ref)]
        q_tok, k_cache, v_cache, table = paged(q, k, v)
        out_p = tiledsl.paged_attention(q_tok, k_cache, v_cache, table, lens, causal=causal, **kw)
        ref_p, _ = serving.paged_attention(q_tok.double().cpu().numpy(), k_cache.double().cpu().numpy(),
                                           v_cache.double().cpu().numpy(), table.cpu().numpy(), lens.cpu().numpy(),
                                           mask="causal" if causal else "none", mods=spec.problem.mods, aux=aux)
        errors.append(_error(out_p.double().cpu().numpy(), ref_p))
    except Exception as err:   # recorded, not timed
        return str(err).splitlines()[0][:300]
    worst = max(errors)
    return "" if worst < 1e-2 else f"wrong: normwise error {worst:.3g} against float64"


def _error(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / (np.linalg.norm(ref) or 1.0)) if np.isfinite(out).all() else float("inf")


def paged(q, k, v):
    """q token-major and K, V in PAGE-key pages in random order: (q (batch, q_len, heads, d), k_cache, v_cache,
    block_table)."""
    return (q.transpose(1, 2).contiguous(),) + shuffled_pages(k, v, PAGE)


def graph_ms(fn) -> float:
    """Median ms of one call replayed from a CUDA graph of ten (the graph's launch cost shared)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(10):
            fn()
    return time_ms(graph.replay) / 10


def peers(mod: str, q, k, v, kw: dict, causal: bool) -> dict:
    """fa4 and flex ms of `mod` on the contiguous tensors (None where absent or refused, with why)."""
    out: dict = {}
    heads = q.shape[1]
    try:
        from flash_attn.cute import flash_attn_func
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        fa4 = {"none": {}, "softcap": {"softcap": CAP}, "sinks": {"learnable_sink": kw.get("sinks")}}.get(mod)
        if fa4 is None:
            out["fa4"], out["fa4_error"] = None, f"no {mod} in flash_attn.cute"
        else:
            fn = lambda: flash_attn_func(qt, kt, vt, causal=causal, **fa4)  # noqa: E731
            fn()
            out["fa4"] = time_ms(fn)
    except Exception as err:
        out["fa4"], out["fa4_error"] = None, str(err).splitlines()[0][:200]
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        slopes = kw.get("alibi_slopes")
        position = k.shape[2] - q.shape[2]
        score_mod = {"none": None, "softcap": lambda s, b, h, i, j: CAP * torch.tanh(s / CAP),
                     "alibi": lambda s, b, h, i, j: s - slopes[h] * (i + position - j).abs()}.get(mod, "none")
        if score_mod == "none" or causal:
            out["flex"], out["flex_error"] = None, "no form for sinks" if score_mod == "none" else "causal not timed"
        else:
            fn = lambda: flex(q, k, v, score_mod=score_mod, enable_gqa=heads != k.shape[1])  # noqa: E731
            fn()
            out["flex"] = time_ms(fn)
    except Exception as err:
        out["flex"], out["flex_error"] = None, str(err).splitlines()[0][:200]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="full")
    args = parser.parse_args(argv)
    command = "python bench/decode_mods_bench.py " + " ".join(argv or sys.argv[1:])
    cases = sorted({(d, q_len) for _, _, _, d, _, q_len in SHAPES[args.shapes]})
    checks = {f"{mod}_d{d}_q{q_len}": check(mod, d, q_len) for mod in MODS for d, q_len in cases}
    print("checks:", {k: v or "ok" for k, v in checks.items()}, flush=True)
    rows = []
    for batch, heads, kv_heads, d, n, q_len in SHAPES[args.shapes]:
        torch.manual_seed(0)
        causal = q_len > 1
        q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        q_tok, k_cache, v_cache, table = paged(q, k, v)
        lens = torch.full((batch,), n, device="cuda", dtype=torch.int32)
        nbytes = 2 * batch * kv_heads * n * d * 2
        base: dict = {}
        for mod in MODS:
            if checks[f"{mod}_d{d}_q{q_len}"]:
                continue
            kw = keywords(mod, heads)
            mods, aux = modifications(**kw)
            mask = Mask.CAUSAL if causal else Mask.NONE
            spec, _ = tuned_spec("sm_90a", DType.BF16, d, mask, None, None, None, q_len, mods)
            kernel = tiledsl.compile(spec)
            paged_kernel = tiledsl.compile(paged_spec(DType.BF16, d, d, mask, PAGE, q_len, mods=mods))
            run_c, _, _ = kernel.bind(q, k, v, aux=aux)
            run_p, _, _ = paged_kernel.bind(q_tok, k_cache, v_cache, table, lens, aux=aux)
            eager_c = lambda: tiledsl.attention(q, k, v, causal=causal, **kw)  # noqa: E731
            eager_p = lambda: tiledsl.paged_attention(  # noqa: E731
                q_tok, k_cache, v_cache, table, lens, causal=causal, **kw)
            timings = {("contiguous", "kernel"): time_ms(run_c), ("paged", "kernel"): time_ms(run_p),
                       ("contiguous", "eager"): time_ms(eager_c), ("paged", "eager"): time_ms(eager_p),
                       ("contiguous", "graph"): graph_ms(eager_c), ("paged", "graph"): graph_ms(eager_p)}
            peer = peers(mod, q, k, v, kw, causal)
            for (path, timing), ms in timings.items():
                if mod == "none":
                    base[(path, timing)] = ms
                rows.append({"kernel": (kernel if path == "contiguous" else paged_kernel).name, "family": "decode",
                             "dtype": "bf16", "head_dim": d, "seqlen": n, "causal": causal, "batch": batch,
                             "heads": heads, "kv_heads": kv_heads, "q_len": q_len, "path": path, "mod": mod,
                             "timing": timing, "ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9,
                             "ratio": base.get((path, timing), float("nan")) / ms,
                             "splits": (kernel if path == "contiguous" else paged_kernel).last_splits,
                             "peers": peer if path == "contiguous" else {}})
                print(f"b{batch} h{heads}/{kv_heads} d{d} n{n} q{q_len} {path:10s} {timing:6s} {mod:8s} "
                      f"{ms * 1e3:8.1f} us  x{rows[-1]['ratio']:.3f} of none  "
                      f"peers {peer if path == 'contiguous' else ''}", flush=True)
            record(args.out, command, rows, checks=checks)
    record(args.out, command, rows, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
