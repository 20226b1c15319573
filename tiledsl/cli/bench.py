"""`tiledsl bench`: TFLOP/s of each kernel under the FlashAttention papers' convention (16k
tokens, hidden 2048, bf16 forward), next to PyTorch SDPA's flash and cuDNN backends timed in the
same run, with the ratios."""
from __future__ import annotations

import json
import sys

from ..tune.bench import prefill_shape, random_inputs, record, sdpa_peers, time_ms
from .common import SEQLEN, concrete_specs, gpu_ready
from ..errors import CliError
from ..spec import DType, Mask

DEFAULT_SEQLENS = (1024, 4096, 8192, 16384)


def add_arguments(parser) -> None:
    parser.add_argument("specs", nargs="*", metavar="SPEC", help=".tile file(s)")
    parser.add_argument("--name", help="only the kernels of the attention block with this name")
    # `--seqlen 1024 4096 SPEC` must not read SPEC as a length: the values are taken as strings and the
    # ones after the last integer go back to the specs (split_seqlens).
    parser.add_argument("--seqlen", nargs="+", metavar="N", default=None,
                        help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_SEQLENS))})")
    parser.add_argument("--against", choices=["sdpa", "none"], default="sdpa", help="peers timed in the same run")
    parser.add_argument("--record", metavar="JSON", help="write the run to this JSON file (bench/results/...)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def bench_spec(spec, seqlen: int, against: str) -> dict:
    from ..families import compile
    kernel = compile(spec)
    p = spec.problem
    batch, heads = prefill_shape(seqlen, p.head_dim_qk)
    q, k, v = random_inputs(p, batch, heads, seqlen, seqlen)
    ms = time_ms(lambda: kernel(q, k, v))
    causal = p.mask is Mask.CAUSAL
    from ..schedule.cost import Shape, shape_flops
    flops = shape_flops(spec, Shape(batch, heads, seqlen, seqlen))   # a window counts the pairs it shows
    peers = {}
    if against == "sdpa" and p.mask in (Mask.NONE, Mask.CAUSAL):
        peers = {name: (flops / t / 1e9 if isinstance(t, float) else None)
                 for name, t in sdpa_peers(q, k, v, causal).items() if not name.endswith("_error")}
    return {"kernel": spec.kernel_name, "family": spec.family.value, "dtype": p.dtype.value, "head_dim": p.head_dim_qk,
            "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal, "ms": ms,
            "tflops": flops / ms / 1e9, "peers": peers}


def split_seqlens(args) -> None:
    """args.seqlen's integers, checked against SEQLEN's range; anything after them (a spec path that
    followed the lengths) joins args.specs. A missing SPEC is argparse's one-line error."""
    import argparse
    values, seqlens = list(args.seqlen or ()), []
    while values:
        try:
            int(values[0])
        except ValueError:
            break
        try:
            seqlens.append(SEQLEN(values.pop(0)))
        except argparse.ArgumentTypeError as err:
            raise CliError(f"argument --seqlen: {err}") from None
    if args.seqlen is not None and not seqlens:
        raise CliError(f"argument --seqlen: expected at least one length, got {args.seqlen[0]!r}")
    args.specs = list(args.specs) + values
    args.seqlen = seqlens or list(DEFAULT_SEQLENS)
    if not args.specs:
        raise CliError("tiledsl bench: the following arguments are required: SPEC (see tiledsl bench --help)")


def run(args) -> int:
    split_seqlens(args)
    specs = concrete_specs(args.specs, args.name)
    gpu_ready("bench", specs, torch_for="bench --against sdpa" if args.against == "sdpa" else
              "" if all(s.problem.dtype is DType.FP16 for s in specs) else "bf16/fp32 inputs (CuPy has no bfloat16)")
    rows = [bench_spec(spec, n, args.against) for spec in specs for n in args.seqlen]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    if args.record:
        record(args.record, "tiledsl bench " + " ".join(sys.argv[2:]), rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':44s} {'seqlen':>6s} {'TFLOP/s':>8s} {'flash':>7s} {'cuDNN':>7s} {'vs flash':>8s} "
          f"{'vs cuDNN':>8s}")
    for r in rows:
        flash, cudnn = r["peers"].get("sdpa_flash"), r["peers"].get("sdpa_cudnn")
        ratio = lambda peer: f"{r['tflops'] / peer:7.2f}x" if peer else "      -"  # noqa: E731
        fmt = lambda x: f"{x:7.1f}" if x else "      -"  # noqa: E731
        print(f"{r['kernel']:44s} {r['seqlen']:6d} {r['tflops']:8.1f} {fmt(flash)} {fmt(cudnn)} {ratio(flash):>8s} "
              f"{ratio(cudnn):>8s}")
