"""Dropout on the H200: tiledsl's dropout kernels (p = 0.1) against its own kernels without dropout and PyTorch SDPA's
flash backend with dropout_p = 0.1 (the one peer with dropout), forward and backward, same run.

    python bench/dropout_bench.py OUT.json [--seqlens 4096 16384]

Rows (tiledsl.tune.bench.record): kernel tiledsl, family hopper, dtype bf16, mod dropout, pass (forward / backward),
head_dim 128, seqlen, causal (both), tflops (FlashAttention's convention: 16k tokens, hidden 2048, FLOPs 4 B H N^2 d,
halved causal; backward 2.5x that over the time of forward + backward minus forward), and peers measured in the same
run: none (tiledsl without dropout, the same shape) and sdpa_flash (torch.nn.functional.scaled_dot_product_attention
under SDPBackend.FLASH_ATTENTION, dropout_p = 0.1). Before anything is timed, tiledsl's forward and backward with
dropout are checked against the float64 reference (batch 1, heads 2, seqlen 257, the forward's seed and offset) and a
row records the check (`check`: "" or why not; a failed check is not timed)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import tiledsl
from tiledsl.dispatch.backward import chosen_backward_spec
from tiledsl.dispatch.modified import modifications
from tiledsl.dispatch.tuned import tuned_spec
from tiledsl.reference.backward import reference_backward
from tiledsl.reference.forward import reference_attention
from tiledsl.spec import DType, Mask
from tiledsl.tune.bench import attention_flops, prefill_shape, record, time_ms

HEAD_DIM, P = 128, 0.1


def check(causal: bool) -> str:
    """"" when tiledsl's dropout forward and backward match the float64 reference of the generator's (seed, offset)."""
    q, k, v = (torch.randn(1, 2, 257, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(1, 2, 257, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    rng = (generator.initial_seed(), generator.get_offset())
    o = tiledsl.attention(q, k, v, causal=causal, dropout_p=P)
    o.backward(do)
    mods, _ = modifications("attention", dropout_p=P)
    mask = Mask.CAUSAL if causal else Mask.NONE
    forward, _ = tuned_spec("sm_90a", DType.BF16, HEAD_DIM, mask, HEAD_DIM, None, None, 257, mods)
    backward = chosen_backward_spec("sm_90a", DType.BF16, HEAD_DIM, mask, HEAD_DIM, mods=mods)
    inputs = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    o64, lse64 = reference_attention(forward, *inputs, aux={"dropout_rng": rng})
    ref = reference_backward(backward, *inputs, do.double().cpu().numpy(), o64, lse64, aux={"dropout_rng": rng})
    errors = [float(np.linalg.norm(x.detach().double().cpu().numpy() - r) / np.linalg.norm(r))
              for x, r in zip((o, q.grad, k.grad, v.grad), (o64, *ref))]
    return "" if max(errors) < 1e-2 else f"wrong: normwise errors of O, dQ, dK, dV {errors} against float64"


def timed(fn, inputs) -> tuple[float, float]:
    """(forward ms, backward ms: forward + backward minus forward)."""
    with torch.no_grad():
        forward = time_ms(fn)
    grad = torch.randn_like(fn())

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad)
    return forward, time_ms(step) - forward


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    checks = {("causal" if causal else "none"): check(causal) for causal in (True, False)}
    rows = []
    for n in args.seqlens:
        batch, heads = prefill_shape(n, HEAD_DIM)
        for causal in (True, False):
            q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            flops = attention_flops(batch, heads, n, n, HEAD_DIM, causal)

            def flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(q, k, v, dropout_p=P, is_causal=causal)
            failed = checks["causal" if causal else "none"]
            times = {"none": timed(lambda: tiledsl.attention(q, k, v, causal=causal), (q, k, v)),
                     "sdpa_flash": timed(flash, (q, k, v))}
            if not failed:
                times["tiledsl"] = timed(lambda: tiledsl.attention(q, k, v, causal=causal, dropout_p=P), (q, k, v))
            for index, pass_ in enumerate(("forward", "backward")):
                scale = 1.0 if pass_ == "forward" else 2.5

                def tflops(name):
                    t = times.get(name)
                    return None if t is None else scale * flops / (t[index] * 1e-3) / 1e12
                rows.append({"kernel": "tiledsl", "family": "hopper", "dtype": "bf16", "mod": "dropout", "p": P,
                             "pass": pass_, "head_dim": HEAD_DIM, "seqlen": n, "causal": causal,
                             "tflops": tflops("tiledsl"), "check": failed,
                             "peers": {"sdpa_flash": tflops("sdpa_flash"), "none": tflops("none")}})
                print(rows[-1], flush=True)
            record(Path(args.out), "python bench/dropout_bench.py " + " ".join(argv), rows, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
