"""Paged decode with score_mod / mask_mod expressions against the unmodified paged decode kernel, same run, same
data: 8 sequences x 8192 keys, d128, 32 query heads over 8 kv heads, one query, pages of 16 in random order.

    python bench/serving_expressions_bench.py OUT.json

Rows (tiledsl.tune.bench.record): kernel, family decode, dtype bf16, head_dim, seqlen (keys per sequence), causal
(False: one query), batch, heads, kv_heads, q_len, path paged, pass "forward", mod (none | bias: score_mod = score +
bias[h, q_idx - kv_idx + 8191] over an fp32 (heads, 16383) table | window_global: mask_mod = q_idx - kv_idx < 1024 |
kv_idx < 64, whose kv tiles between the global keys and the window are never loaded), timing (eager: the public
tiledsl.paged_attention call, host path included | graph: its CUDA-graph replay, as launch_bench times it), us, gbps
(the K + V bytes the unmodified kernel reads, over the time: window_global reads fewer, so its gbps is an effective
rate), ratio (the `none` row's us at the same timing over this row's) and peers measured in the same run: flex
(FlexAttention compiled, the same score_mod / mask_mod on the contiguous K and V of the same data: Flex has no
paged decode of its own here; None with the reason where it does not run). Each tiledsl call is checked against
the float64 paged reference on a small case (fresh inputs, kv_lens with a 0) before it is timed; a failed check is
recorded in `checks` and its rows are left out.
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
from tiledsl.tune.bench import record, shuffled_pages, time_ms  # noqa: E402

BATCH, HEADS, KV_HEADS, D, KEYS, PAGE = 8, 32, 8, 128, 8192, 16
EXPRESSIONS = {"none": {}, "bias": {"score_mod": "score + bias[h, q_idx - kv_idx + 8191]"},
               "window_global": {"mask_mod": "q_idx - kv_idx < 1024 | kv_idx < 64"}}


def aux_of(mod: str, heads: int) -> dict:
    return {"bias": torch.randn(heads, 16383, device="cuda") * 0.5} if mod == "bias" else {}


def paged(k, v):
    """K, V (batch, kv heads, n, d) in PAGE-key pages in random order: (k_cache, v_cache, block_table)."""
    return shuffled_pages(k, v, PAGE)


def check(mod: str) -> str:
    """"" when paged_attention with `mod` matches the float64 paged reference on a small case."""
    from tiledsl.reference import serving
    batch, heads, kv_heads, n = 3, 8, 2, 3000
    q = torch.randn(batch, 1, heads, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    k_cache, v_cache, table = paged(k, v)
    lens = torch.tensor([0, 1500, 3000], device="cuda", dtype=torch.int32)
    aux = aux_of(mod, heads)
    try:
        out = tiledsl.paged_attention(q, k_cache, v_cache, table, lens, aux=aux or None, **EXPRESSIONS[mod])
        mods, _ = modifications(**EXPRESSIONS[mod])
        ref, _ = serving.paged_attention(*(x.double().cpu().numpy() for x in (q, k_cache, v_cache)), table.cpu().numpy(),
                                         lens.cpu().numpy(), mods=mods,
                                         aux={n: t.double().cpu().numpy() for n, t in aux.items()})
    except Exception as err:   # recorded, not timed
        return str(err).splitlines()[0][:300]
    got = out.double().cpu().numpy()
    error = float(np.linalg.norm(got - ref) / (np.linalg.norm(ref) or 1.0)) if np.isfinite(got).all() else np.inf
    return "" if error < 1e-2 else f"wrong: normwise error {error:.3g} against float64"


def graph_us(fn) -> float:
    """Median us of one call replayed from a CUDA graph of ten (the graph's launch cost shared)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(10):
            fn()
    return time_ms(graph.replay) / 10 * 1e3


def flex_us(mod: str, q, k, v, aux: dict) -> dict:
    """FlexAttention's us for `mod` on the contiguous tensors (q (batch, heads, 1, d)), or None with why."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        position = k.shape[2] - 1   # the one query's position in its sequence, as the paged kernel reads q_idx
        keywords: dict = {}
        if mod == "bias":
            bias = aux["bias"]
            keywords["score_mod"] = lambda s, b, h, i, j: s + bias[h, i + position - j + 8191]
        elif mod == "window_global":
            def mask(b, h, i, j):
                return (i + position - j < 1024) | (j < 64)
            keywords["block_mask"] = create_block_mask(mask, None, None, q.shape[2], k.shape[2], device="cuda")
        fn = lambda: flex(q, k, v, enable_gqa=True, **keywords)  # noqa: E731
        fn()
        return {"flex": time_ms(fn) * 1e3, "flex_path": "contiguous K, V (same data)"}
    except Exception as err:
        return {"flex": None, "flex_error": str(err).splitlines()[0][:200]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    args = parser.parse_args(argv)
    command = "python bench/serving_expressions_bench.py " + " ".join(argv or sys.argv[1:])
    checks = {mod: check(mod) for mod in EXPRESSIONS}
    print("checks:", {k: v or "ok" for k, v in checks.items()}, flush=True)
    torch.manual_seed(0)
    q = torch.randn(BATCH, 1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, KV_HEADS, KEYS, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    k_cache, v_cache, table = paged(k, v)
    lens = torch.full((BATCH,), KEYS, device="cuda", dtype=torch.int32)
    nbytes = 2 * BATCH * KV_HEADS * KEYS * D * 2
    rows, base = [], {}
    for mod, keywords in EXPRESSIONS.items():
        if checks[mod]:
            continue
        aux = aux_of(mod, HEADS)
        def eager(aux=aux, keywords=keywords):
            return tiledsl.paged_attention(q, k_cache, v_cache, table, lens, aux=aux or None, **keywords)
        eager()
        mods, _ = modifications(**keywords)
        from tiledsl.serving.paged import paged_spec
        from tiledsl.spec import DType, Mask
        kernel = tiledsl.compile(paged_spec(DType.BF16, D, D, Mask.NONE, PAGE, 1, mods=mods)).name
        timings = {"eager": time_ms(eager) * 1e3, "graph": graph_us(eager)}
        peer = flex_us(mod, q.transpose(1, 2).contiguous(), k, v, aux)
        for timing, us in timings.items():
            if mod == "none":
                base[timing] = us
            rows.append({"kernel": kernel, "family": "decode", "dtype": "bf16", "head_dim": D, "seqlen": KEYS,
                         "causal": False, "batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS, "q_len": 1,
                         "path": "paged", "pass": "forward", "mod": mod, "timing": timing, "us": us,
                         "gbps": nbytes / (us * 1e-6) / 1e9, "ratio": base.get(timing, float("nan")) / us,
                         "peers": peer})
            print(f"{mod:14s} {timing:6s} {us:8.1f} us  {rows[-1]['gbps']:7.0f} GB/s  x{rows[-1]['ratio']:.3f} of "
                  f"none  peers {peer}", flush=True)
        record(args.out, command, rows, checks=checks)
    record(args.out, command, rows, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
