"""Score and mask modifications on the H200: tiledsl against FlashAttention-4 and FlexAttention, same run.

    python bench/scoremod_bench.py OUT.json [--seqlens 4096 16384] [--mods document ...] [--backward]
    python bench/scoremod_bench.py OUT.json --variants [--seqlens 4096 16384]   (softcap's ways, ALiBi, sinks)
    python bench/scoremod_bench.py OUT.json --pass backward [--seqlens 4096 16384]   (the backward's rows)

Rows (tiledsl.tune.bench.record): mod (`none`: tiledsl's unmodified kernel at the shape; softcap,
alibi, sinks, document, rel_bias), pass (forward / backward), head_dim 128, seqlen, causal, tflops
(FlashAttention's convention: 16k tokens, hidden 2048, causal FLOPs 4 B H N^2 d / 2 for every mod, so a
row's ratio to another is a time ratio; backward 2.5x over the time of forward + backward minus
forward), and peers measured in the same run: fa4 (flash_attn.cute with its softcap; None where it has
no such modification or is not importable), flex (torch.nn.attention.flex_attention, compiled; None for
sinks, which it has no form for) and varlen (tiledsl's varlen kernel over the document rows' documents).
The document rows (documents of DOC_LEN tokens, packed back to back: their ends fall inside kv tiles) run
causal and not, and count their FLOPs over the visible (query, key) pairs only: 4 d B H times the sum over
documents of L^2 (L (L + 1) / 2 causal), the same count for every peer (fa4: flash_attn.cute's varlen
function over the documents); tiledsl's document calls pass validate=False (no host check of the ids:
sync-free, as the peers are).
A tiledsl row whose modification has no kernel yet records the refusal in `error` and tflops None.
`--pass backward`: rows of the backward alone (pass "backward") for none, softcap, ALiBi, sinks (learnable:
dsink computed), document (flex: its mask_mod over the ids, as a block mask; validate=False), causal and not, and
the expressions rel_bias (score_mod over a bias table, aux: no gradient) and window_global (mask_mod = kv_idx == 0 |
q_idx - kv_idx < WINDOW), causal only (--mods rel_bias window_global for those alone); FLOPs of the mask's visible
pairs (2.5x the forward's) over the time of
forward + backward minus forward, for tiledsl (tiledsl.attention through autograd: the warp-specialized
backward) and flex (FlexAttention compiled, the same score_mod, its backward by autograd); each tiledsl backward
checked first against the float64 reference's gradients (batch 1, heads 2, seqlen 257).
Every tiledsl kernel is checked against the float64 reference (batch 1, heads 2, seqlen 257, fresh
inputs, O poisoned with NaN by the kernel's own tests) before it is timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import tiledsl
from tiledsl.frontend.parse import load_spec
from tiledsl.reference.forward import reference_attention
from tiledsl.tune.bench import attention_flops, prefill_shape, record, time_ms

HEAD_DIM, CAP, DOC_LEN, WINDOW = 128, 30.0, 1000, 1024
MODS = ("none", "softcap", "alibi", "sinks", "document", "rel_bias", "window_global")
DEFAULT_MODS = MODS[:-1]   # the rows a run without --mods measures (window_global: the backward's, by name)


def modification(mod: str, batch: int, heads: int, n: int, device="cuda", is_causal: bool = True):
    """(tiledsl keywords, flex score_mod, flex mask_mod, fa4 keywords or None, documents (n,) or None)."""
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    if mod == "none":
        return {}, None, causal, {}, None
    if mod == "softcap":
        return dict(softcap=CAP), lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP), causal, dict(softcap=CAP), None
    if mod == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)
        return dict(alibi_slopes="geometric"), lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), causal, None, None
    if mod == "sinks":
        return dict(sinks=torch.randn(heads, device=device)), None, None, None, None
    if mod == "document":
        docs = torch.arange(n, device=device) // DOC_LEN
        ids = docs.to(torch.int32).expand(batch, n).contiguous()
        if not is_causal:
            return dict(document_ids=ids), None, lambda b, h, q, kv: docs[q] == docs[kv], None, docs
        return dict(document_ids=ids), None, lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv), None, docs
    if mod == "window_global":
        return (dict(mask_mod=f"kv_idx == 0 | q_idx - kv_idx < {WINDOW}"), None,
                lambda b, h, q, kv: (q >= kv) & ((kv == 0) | (q - kv < WINDOW)), None, None)
    bias = torch.randn(heads, 2 * n - 1, device=device)
    return (dict(score_mod=f"score + bias[h, q_idx - kv_idx + {n - 1}]", aux={"bias": bias}),
            lambda s, b, h, q, kv: s + bias[h, q - kv + n - 1], causal, None, None)


def check_tiledsl(mod: str, causal: bool = True) -> str:
    """"" when tiledsl's kernel for `mod` matches the float64 reference at a small shape, else why not."""
    batch, heads, n = 1, 2, 257 if mod != "document" else 2257   # a document row: documents of DOC_LEN
    q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keywords = modification(mod, batch, heads, n, is_causal=causal)[0]
    try:
        o = tiledsl.attention(q, k, v, causal=causal, **keywords)
    except Exception as err:   # a modification without a kernel yet: recorded, not timed
        return str(err).splitlines()[0][:300]
    spec = load_spec(tiledsl.spec_for(q, k, v, causal=causal, **keywords))
    aux = {name: t.double().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()
           for name, t in _aux_of(keywords).items()}
    ref, _ = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)), aux=aux)
    error = float(np.linalg.norm(o.double().cpu().numpy() - ref) / np.linalg.norm(ref))
    return "" if error < 1e-2 else f"wrong: normwise error {error:.3g} against float64"


BACKWARD_MODS = ("none", "softcap", "alibi", "sinks", "document", "rel_bias", "window_global")
EXPRESSION_MODS = ("rel_bias", "window_global")   # causal only: their expressions are written for it


def check_backward(mod: str, causal: bool) -> str:
    """"" when tiledsl's backward with `mod` matches the float64 reference's gradients at a small shape."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.reference.backward import reference_backward
    from tiledsl.spec import DType, Mask
    batch, heads, n = 1, 2, 257 if mod != "document" else 2257   # a document row: documents of DOC_LEN
    q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    keywords = modification(mod, batch, heads, n, is_causal=causal)[0]
    if "sinks" in keywords:
        keywords["sinks"].requires_grad_(True)
    try:
        (tiledsl.attention(q, k, v, causal=causal, **keywords).float() * do.float()).sum().backward()
    except Exception as err:   # a modification without a backward yet: recorded, not timed
        return str(err).splitlines()[0][:300]
    mods, _ = modifications("attention_backward", differentiable=True,
                            **{key: keywords[key] for key in ("softcap", "alibi_slopes", "sinks", "document_ids",
                                                              "score_mod", "mask_mod", "aux") if key in keywords})
    spec = chosen_backward_spec("sm_90a", DType.BF16, HEAD_DIM, Mask.CAUSAL if causal else Mask.NONE, HEAD_DIM,
                                mods=mods)
    aux = {name: t.detach().double().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()
           for name, t in _aux_of(keywords).items()}   # geometric: none
    inputs = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    o, lse = reference_attention(spec, *inputs, aux=aux)
    ref = reference_backward(spec, *inputs, do.double().cpu().numpy(), o, lse, aux=aux)
    got = [q.grad, k.grad, v.grad] + ([keywords["sinks"].grad] if "sinks" in keywords else [])
    errors = [float(np.linalg.norm(g.double().cpu().numpy() - r) / np.linalg.norm(r)) for g, r in zip(got, ref)]
    return "" if max(errors) < 1e-2 else f"wrong: normwise gradient errors {errors} against float64"


def backward_rows(seqlens: list[int], mods: list[str], argv: list[str], out: Path) -> list[dict]:
    """The `--pass backward` rows (the module docstring), saved after each."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    cases = [(mod, causal) for mod in mods if mod in BACKWARD_MODS for causal in (True, False)
             if causal or mod not in EXPRESSION_MODS]
    checks = {f"{mod}_{'causal' if causal else 'none'}": check_backward(mod, causal) for mod, causal in cases}
    rows = []
    for n in seqlens:
        batch, heads = prefill_shape(n, HEAD_DIM)
        for mod, causal in cases:
            check = checks[f"{mod}_{'causal' if causal else 'none'}"]
            flops = 2.5 * (document_flops(batch, heads, n, causal) if mod == "document" else
                           window_flops(batch, heads, n) if mod == "window_global" else
                           attention_flops(batch, heads, n, n, HEAD_DIM, causal))
            q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            keywords, score_mod, mask_mod, _, _ = modification(mod, batch, heads, n, is_causal=causal)
            learned = [keywords["sinks"].requires_grad_(True)] if "sinks" in keywords else []
            times = {}
            if not check:
                sync_free = {"validate": False} if mod == "document" else {}
                times["tiledsl"] = timed(lambda: tiledsl.attention(q, k, v, causal=causal, **keywords, **sync_free),
                                         True, (q, k, v, *learned))
            if mod != "sinks":   # FlexAttention has no form for sinks
                block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda") \
                    if causal or mod == "document" else None
                times["flex"] = timed(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask), True,
                                      (q, k, v))

            def tflops(name):
                t = times.get(name)
                return None if t is None else flops / ((t[1] - t[0]) * 1e-3) / 1e12
            rows.append({"kernel": f"tiledsl_{mod}_backward", "family": "backward_ws", "dtype": "bf16", "mod": mod,
                         "pass": "backward", "head_dim": HEAD_DIM, "seqlen": n, "causal": causal, "batch": batch,
                         "heads": heads, "tflops": tflops("tiledsl"), "error": check or None,
                         "flops": "2.5x the forward's visible pairs", "peers": {"flex": tflops("flex")}})
            print(rows[-1], flush=True)
            record(out, "python bench/scoremod_bench.py " + " ".join(argv), rows, checks=checks)
    return rows


def _aux_of(keywords: dict) -> dict:
    names = {"alibi_slopes": "alibi_slopes", "sinks": "sinks", "document_ids": "document_ids"}
    out = {names[k]: v for k, v in keywords.items() if k in names and torch.is_tensor(v)}
    return {**out, **keywords.get("aux", {})}


# The hopper kernels timed by their own calls (the tuned schedule, one compile each), interleaved round by round
# so clock drift over the run falls on every variant alike: `none`, softcap by each way (mods/softcap.py;
# tanh_approx at TANH_APPROX_CAP, the only caps its error fits: its instructions do not depend on the cap),
# ALiBi and sinks. Rows: mod, variant, cap, tflops (median of the rounds), ratio (to `none` in the same rounds).
VARIANT_ROUNDS = 3
TANH_APPROX_CAP = 0.5


def variant_mods():
    from tiledsl.mods.model import AlibiSlopes, Modifications
    from tiledsl.mods.softcap import TanhVia
    out = {"none": ("none", Modifications())}
    for via in TanhVia:
        cap = TANH_APPROX_CAP if via is TanhVia.TANH_APPROX else CAP
        out[f"softcap_{via.value}"] = ("softcap", Modifications(softcap=cap, softcap_via=via))
    out["alibi"] = ("alibi", Modifications(alibi=AlibiSlopes.GIVEN))
    out["sinks"] = ("sinks", Modifications(sinks=True))
    return out


def variant_rows(n: int) -> list[dict]:
    """One row per variant at seqlen n (d128 causal bf16), each kernel checked against float64 first."""
    from tiledsl import compile as compile_spec
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.spec import DType, Mask
    batch, heads = prefill_shape(n, HEAD_DIM)
    flops = attention_flops(batch, heads, n, n, HEAD_DIM, True)
    q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    aux = {"alibi_slopes": torch.rand(heads, device="cuda") * 0.5, "sinks": torch.randn(heads, device="cuda")}
    calls, checks = {}, {}
    for variant, (mod, mods) in variant_mods().items():
        spec, _ = tuned_spec("sm_90a", DType.BF16, HEAD_DIM, Mask.CAUSAL, mods=mods)
        kernel = compile_spec(spec)
        wants = {a.name: aux[a.name] for a in mods.user_aux()}
        checks[variant] = check_kernel(kernel, spec, wants)
        calls[variant] = (lambda kernel=kernel, wants=wants: kernel(q, k, v, aux=wants))
    times = {variant: [] for variant in calls}
    for _ in range(VARIANT_ROUNDS):
        for variant, call in calls.items():
            times[variant].append(time_ms(call))
    rows = []
    for variant, (mod, mods) in variant_mods().items():
        ms = float(np.median(times[variant]))
        rows.append({"kernel": f"tiledsl_{variant}", "family": "hopper", "dtype": "bf16", "mod": mod,
                     "variant": variant, "cap": mods.softcap, "pass": "forward", "head_dim": HEAD_DIM, "seqlen": n,
                     "causal": True, "batch": batch, "heads": heads, "tflops": flops / (ms * 1e-3) / 1e12,
                     "ms_rounds": times[variant], "ratio": float(np.median(times["none"])) / ms,
                     "error": checks[variant] or None, "peers": {}})
        print(rows[-1], flush=True)
    return rows


def check_kernel(kernel, spec, aux: dict) -> str:
    """"" when `kernel` matches the float64 reference (batch 1, heads 2, 257 rows, q and k spread 3x so softcap
    saturates), else why not."""
    batch, heads, n = 1, 2, 257
    q, k = ((torch.randn(batch, heads, n, HEAD_DIM, device="cuda") * 3).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    small = {name: t[:heads].contiguous() for name, t in aux.items()}
    o, _ = kernel(q, k, v, aux=small)
    ref, _ = reference_attention(spec, *(x.double().cpu().numpy() for x in (q, k, v)),
                                 aux={name: t.double().cpu().numpy() for name, t in small.items()})
    error = float(np.linalg.norm(o.double().cpu().numpy() - ref) / np.linalg.norm(ref))
    return "" if error < 1e-2 else f"wrong: normwise error {error:.3g} against float64"


def window_flops(batch: int, heads: int, n: int) -> float:
    """FLOPs of window_global's visible pairs: each query's WINDOW latest keys (itself included) and key 0."""
    i = np.arange(n)
    return 4.0 * HEAD_DIM * batch * heads * float((np.minimum(i + 1, WINDOW) + (i >= WINDOW)).sum())


def document_flops(batch: int, heads: int, n: int, causal: bool) -> float:
    """FLOPs of the visible pairs of n tokens in documents of DOC_LEN (the last one shorter)."""
    lengths = [min(DOC_LEN, n - s) for s in range(0, n, DOC_LEN)]
    pairs = sum(L * (L + 1) // 2 if causal else L * L for L in lengths)
    return 4.0 * HEAD_DIM * batch * heads * pairs


def fa4_varlen():
    """flash_attn.cute's varlen function, or None where it is not importable."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception:
        return None


def timed(fn, backward: bool, inputs):
    """(forward ms, forward + backward ms or None)."""
    forward = time_ms(fn)
    if not backward:
        return forward, None
    out = fn()
    grad = torch.randn_like(out)

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad)
    return forward, time_ms(step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--variants", action="store_true",
                        help="only the hopper kernels' variants (softcap's ways, ALiBi, sinks), interleaved")
    parser.add_argument("--mods", nargs="+", choices=MODS, default=list(DEFAULT_MODS), help="the rows to measure")
    parser.add_argument("--pass", dest="pass_", choices=("forward", "backward"), default="forward",
                        help="backward: the backward's rows alone (BACKWARD_MODS of --mods; causal and not)")
    args = parser.parse_args(argv)
    if args.pass_ == "backward":
        backward_rows(args.seqlens, args.mods, argv, Path(args.out))
        return 0
    if args.variants:
        rows = [row for n in args.seqlens for row in variant_rows(n)]
        record(Path(args.out), "python bench/scoremod_bench.py " + " ".join(argv), rows)
        return 0
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        flash_attn_func = None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    cases = [(mod, causal) for mod in args.mods for causal in ((True, False) if mod == "document" else (True,))]
    checks = {f"{mod}{'' if causal else '_noncausal'}": check_tiledsl(mod, causal) for mod, causal in cases}
    varlen_fa4 = fa4_varlen()
    rows = []

    def save():
        record(Path(args.out), "python bench/scoremod_bench.py " + " ".join(argv), rows, checks=checks,
               fa4_available=flash_attn_func is not None)
    for n in args.seqlens:
        batch, heads = prefill_shape(n, HEAD_DIM)
        for mod, causal in cases:
            check = checks[f"{mod}{'' if causal else '_noncausal'}"]
            flops = (document_flops(batch, heads, n, causal) if mod == "document" else
                     window_flops(batch, heads, n) if mod == "window_global" else
                     attention_flops(batch, heads, n, n, HEAD_DIM, True))
            q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=args.backward) for _ in range(3))
            keywords, score_mod, mask_mod, fa4, docs = modification(mod, batch, heads, n, is_causal=causal)
            if docs is not None:
                keywords = {**keywords, "validate": False}
            times = {}
            if not check:
                times["tiledsl"] = timed(lambda: tiledsl.attention(q, k, v, causal=causal, **keywords), args.backward,
                                         (q, k, v))
            if score_mod is not None or mask_mod is not None:
                block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda") if mask_mod else None
                times["flex"] = timed(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
                                      args.backward, (q, k, v))
            if flash_attn_func is not None and fa4 is not None:
                qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(args.backward) for x in (q, k, v))
                times["fa4"] = timed(lambda: flash_attn_func(qt, kt, vt, causal=True, **fa4)[0], args.backward,
                                     (qt, kt, vt))
            if docs is not None:
                lengths = [min(DOC_LEN, n - s) for s in range(0, n, DOC_LEN)] * batch
                cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device="cuda")
                packed = [x.detach().transpose(1, 2).reshape(batch * n, heads, HEAD_DIM) for x in (q, k, v)]
                times["varlen"] = timed(lambda: tiledsl.varlen_attention(*packed, cu, cu, DOC_LEN, DOC_LEN,
                                                                         causal=causal), False, ())
                if varlen_fa4 is not None:
                    try:
                        times["fa4"] = timed(lambda: varlen_fa4(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                causal=causal)[0], False, ())
                    except Exception as err:   # an FA4 build without this signature: noted, not timed
                        checks[f"fa4_varlen_{mod}"] = str(err).splitlines()[0][:300]
            for pass_ in ("forward", "backward") if args.backward else ("forward",):
                def tflops(name):
                    t = times.get(name)
                    if t is None or (pass_ == "backward" and t[1] is None):
                        return None
                    ms = t[0] if pass_ == "forward" else t[1] - t[0]
                    return (flops if pass_ == "forward" else 2.5 * flops) / (ms * 1e-3) / 1e12
                rows.append({"kernel": f"tiledsl_{mod}", "family": "hopper", "dtype": "bf16", "mod": mod,
                             "pass": pass_, "head_dim": HEAD_DIM, "seqlen": n, "causal": causal, "batch": batch,
                             "heads": heads, "tflops": tflops("tiledsl"), "error": check or None,
                             "flops": "visible pairs" if mod == "document" else "causal N^2 / 2",
                             "peers": {"fa4": tflops("fa4"), "flex": tflops("flex"), "varlen": tflops("varlen")}})
                print(rows[-1], flush=True)
                save()   # after every row: a run cut short keeps what it measured
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
