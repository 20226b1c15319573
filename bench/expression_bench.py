"""score_mod / mask_mod expressions in the hopper forward on the H200: tiledsl against its own unmodified kernel and
FlexAttention compiled with the same score_mod / mask_mod, in one run.

    python bench/expression_bench.py OUT.json [--seqlens 4096 16384]

Rows (tiledsl.tune.bench.record), d128 bf16, batch and heads by the papers' convention (16k tokens, hidden 2048):
  rel_bias       score_mod = score + bias[h, q_idx - kv_idx + N - 1], causal (a learned relative-position table)
  window_global  mask_mod = kv_idx == 0 | q_idx - kv_idx < 256, causal (a sliding window with a global token)
  prefix_lm      mask_mod = kv_idx <= q_idx | kv_idx < 1024, no mask (prefix-LM: the first 1024 keys bidirectional)
each with mod (the expression's name), pass "forward", head_dim, seqlen, causal, tflops and peers {flex,
unmodified}. FLOPs count the visible (query, key) pairs, 4 d per pair, the same for every peer of a row: a
ratio within a row is a time ratio. `unmodified` is tiledsl's kernel for the mask alone (causal, or none for
prefix_lm) at the same shape, over the same FLOP count; `ms` holds every peer's median milliseconds. The kernels
are timed through bind() (the prepared launch: no dispatch in the timing), each checked first against the
float64 reference at batch 1, heads 2, 700 rows (so the window row has empty tiles between its global key's).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from tiledsl import compile as compile_spec
from tiledsl.dispatch.modified import modifications
from tiledsl.dispatch.tuned import tuned_spec
from tiledsl.reference.forward import reference_attention
from tiledsl.spec import DType, Mask
from tiledsl.tune.bench import prefill_shape, record, time_ms

HEAD_DIM, WINDOW, PREFIX = 128, 256, 1024
EXPRESSIONS = ("rel_bias", "window_global", "prefix_lm")


def expression_case(name: str, heads: int, n: int):
    """(causal, tiledsl keywords, flex score_mod, flex mask_mod, visible pairs of one (batch, head))."""
    i = np.arange(n)
    if name == "rel_bias":
        bias = torch.randn(heads, 2 * n - 1, device="cuda")
        return (True, dict(score_mod=f"score + bias[h, q_idx - kv_idx + {n - 1}]", aux={"bias": bias}),
                lambda s, b, h, q, kv: s + bias[h, q - kv + n - 1], lambda b, h, q, kv: q >= kv,
                int((i + 1).sum()))
    if name == "window_global":
        pairs = int((np.minimum(i + 1, WINDOW) + (i >= WINDOW)).sum())
        return (True, dict(mask_mod=f"kv_idx == 0 | q_idx - kv_idx < {WINDOW}"), None,
                lambda b, h, q, kv: (q >= kv) & ((kv == 0) | (q - kv < WINDOW)), pairs)
    pairs = int(np.minimum(np.maximum(i + 1, PREFIX), n).sum())
    return (False, dict(mask_mod=f"kv_idx <= q_idx | kv_idx < {PREFIX}"), None,
            lambda b, h, q, kv: (kv <= q) | (kv < PREFIX), pairs)


def kernel_of(causal: bool, keywords: dict):
    """The compiled tuned kernel attention() runs for these keywords, and its aux tensors."""
    mods, aux = modifications("expression_bench", **keywords)
    spec, _ = tuned_spec("sm_90a", DType.BF16, HEAD_DIM, Mask.CAUSAL if causal else Mask.NONE, mods=mods)
    return compile_spec(spec), spec, aux


def check(name: str) -> str:
    """"" when tiledsl's kernel for `name` matches the float64 reference at a small shape, else why not."""
    batch, heads, n = 1, 2, 700
    causal, keywords, _, _, _ = expression_case(name, heads, n)
    try:
        kernel, spec, aux = kernel_of(causal, keywords)
        q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o, _ = kernel(q, k, v, aux=aux)
    except Exception as err:   # no kernel: recorded, not timed
        return str(err).splitlines()[0][:300]
    ref, _ = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)),
                                 aux={a: t.double().cpu().numpy() for a, t in aux.items()})
    error = float(np.linalg.norm(o.double().cpu().numpy() - ref) / np.linalg.norm(ref))
    return "" if error < 1e-2 else f"wrong: normwise error {error:.3g} against float64"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    checks = {name: check(name) for name in EXPRESSIONS}
    rows = []
    for n in args.seqlens:
        batch, heads = prefill_shape(n, HEAD_DIM)
        q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in EXPRESSIONS:
            causal, keywords, score_mod, mask_mod, pairs = expression_case(name, heads, n)
            flops = 4.0 * HEAD_DIM * batch * heads * pairs
            ms = {}
            if not checks[name]:
                kernel, _, aux = kernel_of(causal, keywords)
                run, _, _ = kernel.bind(q, k, v, aux=aux)
                ms["tiledsl"] = time_ms(run)
            plain, _, _ = kernel_of(causal, {})
            run_plain, _, _ = plain.bind(q, k, v)
            ms["unmodified"] = time_ms(run_plain)
            block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
            ms["flex"] = time_ms(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask))

            def tflops(peer):
                return None if peer not in ms else flops / (ms[peer] * 1e-3) / 1e12
            rows.append({"kernel": f"tiledsl_{name}", "family": "hopper", "dtype": "bf16", "mod": name,
                         "expression": keywords.get("score_mod") or keywords.get("mask_mod"), "pass": "forward",
                         "head_dim": HEAD_DIM, "seqlen": n, "causal": causal, "batch": batch, "heads": heads,
                         "tflops": tflops("tiledsl"), "error": checks[name] or None, "flops": "visible pairs",
                         "ms": ms, "peers": {"flex": tflops("flex"), "unmodified": tflops("unmodified")}})
            print(rows[-1], flush=True)
            record(Path(args.out), "python bench/expression_bench.py " + " ".join(argv), rows, checks=checks)
    record(Path(args.out), "python bench/expression_bench.py " + " ".join(argv), rows, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
