"""Backward of `tiledsl.attention` (autograd through the custom op) next to PyTorch SDPA's flash and
cuDNN backends, measured in the same run; and one training step's attention (forward + backward)
against SDPA's default choice.

    python bench/backward_bench.py OUT.json [--dims 64 128] [--seqlens 1024 4096 8192 16384] [--rep-ms 100]
                                   [--warp-specialized]   # tiledsl.attention's backward on the warp-specialized family

Conventions (PEERS.md, FlashAttention papers): bf16, 16k tokens per batch (batch = 16384 / seqlen),
hidden 2048 (heads = 2048 / d), forward FLOPs 4 b h s^2 d (halved for causal), backward FLOPs
2.5 x forward, backward time = (forward + backward) - forward, each the CUDA-event median of
do_bench on fresh normal(0, 1) inputs. Every timed call is what training runs: the forward with
inputs that require grad (so it saves what its backward needs), torch.autograd.grad for the
backward. Before timing, each shape's tiledsl gradients are checked against SDPA flash's on the
same inputs (max-norm relative difference under twice tests/attention_reference.GRAD_TOLERANCE:
both are bf16 kernels, each within the bound of float64); a shape that fails is recorded and not
timed. Rows: kind "backward" (TFLOP/s of the backward, peers sdpa_flash / sdpa_cudnn, ratios) and
kind "training_step" (forward + backward ms and TFLOP/s at 3.5 x forward FLOPs, peer: SDPA with
no backend forced). About two minutes on an H200.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import attention_flops, prefill_shape, record, time_ms

BACKWARD_FLOPS = 2.5           # backward FLOPs per forward FLOP (FlashAttention's convention)
CHECK_BOUND = 2 * 8 * 2.0 ** -8   # two bf16 kernels, each within 8 unit roundoffs of float64


def kernels(d: int, causal: bool) -> tuple[str, str, str]:
    """(forward kernel name, its family, backward kernel name) that tiledsl.attention runs."""
    from tiledsl.runtime import device as runtime
    from tiledsl.dispatch import tuned
    from tiledsl.spec import DType, Mask
    mask = Mask.CAUSAL if causal else Mask.NONE
    spec, _ = tuned.tuned_spec(runtime.device_arch(), DType.BF16, d, mask, d, None, None, None)
    try:   # tiledsl/dispatch/backward.py's table; its name is recorded when it offers one
        from tiledsl.dispatch.backward import chosen_backward_spec
        backward = chosen_backward_spec(runtime.device_arch(), DType.BF16, d, mask).kernel_name
    except Exception as err:   # an older or newer entry point: the row still records the forward
        backward = f"unknown ({type(err).__name__})"
    return spec.kernel_name, spec.family.value, backward


def runners(torch, q, k, v, do, causal: bool):
    """name -> (forward, forward + backward) callables, each as training calls it."""
    import tiledsl
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def pair(attend, backend=None):
        def forced():   # the backend stays forced for the backward too
            return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()

        def forward():
            with forced():
                return attend()

        def forward_backward():
            with forced():
                return torch.autograd.grad(attend(), (q, k, v), do)
        return forward, forward_backward
    return {"tiledsl": pair(lambda: tiledsl.attention(q, k, v, causal=causal)),
            "sdpa_flash": pair(lambda: sdpa(q, k, v, is_causal=causal), SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": pair(lambda: sdpa(q, k, v, is_causal=causal), SDPBackend.CUDNN_ATTENTION),
            "sdpa_default": pair(lambda: sdpa(q, k, v, is_causal=causal))}


def max_relative(x, ref) -> float:
    x, ref = x.float(), ref.float()
    if not bool(x.isfinite().all()):
        return float("inf")
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--rep-ms", type=int, default=100, help="timing window per callable and shape (do_bench rep)")
    parser.add_argument("--warp-specialized", action="store_true",
                        help="turn tiledsl.dispatch.backward.BACKWARD_WS on for this run")
    args = parser.parse_args(argv)
    if args.warp_specialized:
        from tiledsl.dispatch import backward
        backward.BACKWARD_WS = True
    import torch
    started = time.time()
    rows, failed = [], []
    for d in args.dims:
        for causal in {"both": [False, True], "yes": [True], "no": [False]}[args.causal]:
            forward_kernel, family, backward_kernel = kernels(d, causal)
            for n in args.seqlens:
                batch, heads = prefill_shape(n, d)
                q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16,
                                           requires_grad=i < 3) for i in range(4))
                fns = runners(torch, q, k, v, do, causal)
                mine, flash = fns["tiledsl"][1](), fns["sdpa_flash"][1]()   # compiles tiledsl's kernels too
                difference = max(max_relative(a, b) for a, b in zip(mine, flash))
                shape = dict(dtype="bf16", head_dim=d, seqlen=n, batch=batch, heads=heads, causal=causal)
                if not difference < CHECK_BOUND:
                    failed.append({**shape, "difference_vs_sdpa_flash": difference})
                    print(f"FAIL d{d} causal={causal} {n}: gradients differ from SDPA flash's by {difference:.3g}",
                          flush=True)
                    continue
                ms = {}
                for name, (fwd, fwd_bwd) in fns.items():
                    try:
                        ms[name] = (time_ms(fwd, rep_ms=args.rep_ms), time_ms(fwd_bwd, rep_ms=args.rep_ms))
                    except Exception as err:   # a backend that refuses the shape is recorded as missing
                        ms[name] = None
                        print(f"{name} d{d} {n}: {str(err).splitlines()[0][:160]}", flush=True)
                flops = attention_flops(batch, heads, n, n, d, causal)
                bwd = {name: BACKWARD_FLOPS * flops / (t[1] - t[0]) / 1e9 for name, t in ms.items()
                       if t is not None and t[1] > t[0]}
                step = {name: (1 + BACKWARD_FLOPS) * flops / t[1] / 1e9 for name, t in ms.items() if t is not None}
                base = dict(kernel=backward_kernel, forward_kernel=forward_kernel, family=family, **shape,
                            difference_vs_sdpa_flash=difference)
                peers = {p: bwd.get(p) for p in ("sdpa_flash", "sdpa_cudnn")}
                rows.append({**base, "kind": "backward", "ms": ms["tiledsl"][1] - ms["tiledsl"][0],
                             "tflops": bwd.get("tiledsl"), "forward_tflops": flops / ms["tiledsl"][0] / 1e9,
                             "peers": peers, "ratios": {p: bwd["tiledsl"] / t for p, t in peers.items() if t and "tiledsl" in bwd}})
                default = ms.get("sdpa_default")
                rows.append({**base, "kind": "training_step", "ms": ms["tiledsl"][1], "tflops": step["tiledsl"],
                             "peers": {"sdpa_default": step.get("sdpa_default")},
                             "peer_ms": {"sdpa_default": default[1] if default else None},
                             "ratios": {"sdpa_default": default[1] / ms["tiledsl"][1] if default else None}})
                r = rows[-2]["ratios"]
                print(f"d{d} {'causal' if causal else 'none  '} {n:6d}  bwd {bwd.get('tiledsl', 0):6.1f} TFLOP/s  "
                      f"x{r.get('sdpa_flash', 0):.2f} flash  x{r.get('sdpa_cudnn', 0):.2f} cuDNN  step "
                      f"{ms['tiledsl'][1]:.2f} ms vs default {default[1] if default else 0:.2f} ms", flush=True)
                del q, k, v, do, fns, mine, flash
    record(args.out, "python bench/backward_bench.py " + " ".join(sys.argv[1:]), rows,
           failed=failed, seconds=round(time.time() - started, 1))
    print(f"{len(rows)} rows, {len(failed)} failed checks, {time.time() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
