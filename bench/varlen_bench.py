"""Packed variable-length prefill (tiledsl.varlen_attention) against the same schedule on a uniform
batch of equal total tokens and against SDPA (flash, cuDNN) on the zero-padded batch.

Lengths are drawn uniformly from 256..8192 (seeded) until ~32k tokens; q and k lengths are equal
per sequence. TFLOP/s count the real tokens' FLOPs (causal: half of each sequence's square) for
every row, so a padded peer pays for its padding. Each varlen call includes its host sync (the
cu_seqlens copy; the work list is cached per cu_seqlens). Before timing, the varlen output is
compared per sequence with SDPA flash on that sequence alone.

    python bench/varlen_bench.py OUT.json [--dims 128 64] [--total 32768] [--seed 0] [--rep-ms 100]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import HIDDEN, attention_flops, record, sdpa_peers, time_ms  # noqa: E402


def draw_lengths(total: int, seed: int, low: int = 256, high: int = 8192) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(rng.integers(low, high + 1), max(total - sum(lengths), low))))
    return lengths


def check_against_sdpa(out, q, k, v, cu, causal: bool) -> float:
    """The worst per-sequence relative error of `out` against SDPA flash on each sequence alone."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    worst = 0.0
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        ref = sdpa(*(x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=causal)[0].transpose(0, 1)
        worst = max(worst, float(torch.linalg.norm((out[rows] - ref).float()) / torch.linalg.norm(ref.float())))
    return worst


def warmup(dims) -> int:
    import concurrent.futures
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.serving.varlen import varlen_spec
    arch, specs = device_arch(), []
    for d in dims:
        for dtype in (DType.BF16, DType.FP16):
            for mask, window in ((Mask.NONE, None), (Mask.CAUSAL, None), (Mask.WINDOW, (100, 20))):
                specs.append(varlen_spec(arch, dtype, d, mask, d, window))
        specs += [tuned_spec(arch, DType.BF16, d, mask)[0] for mask in (Mask.NONE, Mask.CAUSAL)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(kernel_for, specs))
    print(f"compiled {len(specs)} kernels", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--total", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--warmup", action="store_true", help="only compile, in parallel, the kernels this bench and "
                    "tests/test_gpu_varlen.py launch (NVRTC's disk cache keeps them for later processes)")
    args = ap.parse_args()
    if args.warmup:
        return warmup(args.dims)
    import numpy as np
    import torch

    from tiledsl.runtime.device import device_arch
    from tiledsl.runtime.launch import replayer
    from tiledsl.spec import DType, Mask
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.serving.varlen import varlen_spec
    lengths = draw_lengths(args.total, args.seed)
    total, longest = sum(lengths), max(lengths)
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu = torch.tensor(cu_host, device="cuda")
    uniform = round(total / len(lengths))   # the uniform batch: as many sequences, equal total tokens
    print(f"lengths {lengths} total {total}; uniform batch {len(lengths)} x {uniform}", flush=True)
    rows, failed = [], False
    for d in args.dims:
        heads = HIDDEN // d
        q, k, v = (torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            mask = Mask.CAUSAL if causal else Mask.NONE
            spec = varlen_spec(device_arch(), DType.BF16, d, mask)
            kernel = kernel_for(spec)
            flops = sum(attention_flops(1, heads, n, n, d, causal) for n in lengths)
            out, _ = kernel(q, k, v, cu, cu)
            err = check_against_sdpa(out, q, k, v, cu_host.tolist(), causal)
            ok = err < 1e-2
            failed |= not ok
            print(f"d{d} causal={causal}: worst per-sequence error vs SDPA flash {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            ms = time_ms(lambda: kernel(q, k, v, cu, cu), rep_ms=args.rep_ms)
            launch = replayer(kernel.prepare_varlen(q, k, v, cu, cu)[2], q)   # the launch alone: no sync, no checks
            kernel_ms = time_ms(launch, rep_ms=args.rep_ms)
            # the same schedule (batched layout) on a uniform batch of equal total tokens
            batched = kernel_for(tuned_spec(device_arch(), DType.BF16, d, mask)[0])
            uq, uk, uv = (torch.randn(len(lengths), heads, uniform, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            uniform_flops = attention_flops(len(lengths), heads, uniform, uniform, d, causal)
            uniform_ms = time_ms(lambda: batched(uq, uk, uv), rep_ms=args.rep_ms)
            ucu = torch.arange(0, len(lengths) + 1, device="cuda", dtype=torch.int32) * uniform
            pq, pk, pv = (x.transpose(1, 2).reshape(-1, heads, d) for x in (uq, uk, uv))
            uniform_varlen_ms = time_ms(lambda: kernel(pq, pk, pv, ucu, ucu), rep_ms=args.rep_ms)
            launch_u = replayer(kernel.prepare_varlen(pq, pk, pv, ucu, ucu)[2], pq)
            uniform_varlen_kernel_ms = time_ms(launch_u, rep_ms=args.rep_ms)
            # SDPA on the zero-padded batch (batch, heads, longest, d); real tokens' FLOPs
            padded = [torch.zeros(len(lengths), heads, longest, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for b, n in enumerate(lengths):
                for dst, src in zip(padded, (q, k, v)):
                    dst[b, :, :n] = src[cu_host[b]:cu_host[b + 1]].transpose(0, 1)
            sdpa = sdpa_peers(*padded, causal, args.rep_ms)
            peers = {"uniform_batched_tflops": uniform_flops / uniform_ms / 1e9,
                     "uniform_varlen_tflops": uniform_flops / uniform_varlen_ms / 1e9,
                     "uniform_varlen_launch_only_tflops": uniform_flops / uniform_varlen_kernel_ms / 1e9,
                     **{f"{name}_padded_tflops": flops / t / 1e9 for name, t in sdpa.items() if isinstance(t, float)},
                     **{f"{name}_padded": t for name, t in sdpa.items() if not isinstance(t, float) and t is not None}}
            tflops = flops / ms / 1e9
            row = {"kernel": spec.kernel_name, "family": spec.family.value, "dtype": "bf16", "head_dim": d,
                   "seqlen": f"varlen {len(lengths)} seqs, {total} tokens (256..8192, seed {args.seed})",
                   "lengths": lengths, "heads": heads, "causal": causal, "ms": ms, "tflops": tflops,
                   "launch_only_ms": kernel_ms, "launch_only_tflops": flops / kernel_ms / 1e9,
                   "check_error_vs_sdpa_flash": err, "uniform": f"{len(lengths)} x {uniform}", "peers": peers,
                   "vs_uniform_batched": tflops / peers["uniform_batched_tflops"],
                   "launch_only_vs_uniform_batched": flops / kernel_ms / 1e9 / peers["uniform_batched_tflops"],
                   **{f"vs_{name}_padded": tflops / peers[f"{name}_padded_tflops"] for name in ("sdpa_flash", "sdpa_cudnn")
                      if f"{name}_padded_tflops" in peers}}
            rows.append(row)
            print(f"d{d} {'causal' if causal else 'none  '} varlen {tflops:6.1f} TFLOP/s (launch only "
                  f"{row['launch_only_tflops']:6.1f}, x{row['launch_only_vs_uniform_batched']:.3f}) | uniform batched "
                  f"{peers['uniform_batched_tflops']:6.1f} (x{row['vs_uniform_batched']:.3f}) uniform varlen "
                  f"{peers['uniform_varlen_tflops']:6.1f} (launch only {peers['uniform_varlen_launch_only_tflops']:6.1f}) | padded SDPA flash {peers.get('sdpa_flash_padded_tflops', 0):6.1f} "
                  f"cuDNN {peers.get('sdpa_cudnn_padded_tflops', 0):6.1f}", flush=True)
            del padded
    record(args.out, "python bench/varlen_bench.py " + " ".join(sys.argv[2:]), rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
