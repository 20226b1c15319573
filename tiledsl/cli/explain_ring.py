"""`tiledsl explain-ring --ranks W --seqlen N [--heads H --kv-heads G --head-dim D --causal ...] [--json]`:
what tiledsl.distributed.ring_attention will cost on W GPUs (tiledsl/distributed/explain.py): per-rank work,
bytes sent per step, and per step the block's compute time (the tune model) against the link time, so a user
sees whether the ring will be compute- or link-bound and its predicted scaling efficiency."""
from __future__ import annotations

import argparse
import json

from .common import COUNT
from ..errors import CliError, RuntimeInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=COUNT, required=True, help="GPUs in the ring")
    parser.add_argument("--seqlen", type=COUNT, required=True, help="tokens in the whole sequence")
    parser.add_argument("--batch", type=COUNT, default=1)
    parser.add_argument("--heads", type=COUNT, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=COUNT, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--head-dim", type=COUNT, default=128)
    parser.add_argument("--head-dim-v", type=COUNT, default=None, help="v's head dim (default: --head-dim)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="one-way GPU-to-GPU bandwidth in GB/s (default: the H200's NVLink peak, 450)")
    parser.add_argument("--json", action="store_true", help="print the explanation as JSON")


def run(args: argparse.Namespace) -> int:
    from ..distributed.explain import explain_ring
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise CliError(f"--link-gbps must be > 0, got {args.link_gbps}")
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise CliError(f"--heads {args.heads} is not a multiple of --kv-heads {kv_heads}")
    try:
        explanation = explain_ring(args.seqlen, args.ranks, args.heads, args.head_dim, kv_heads, args.head_dim_v,
                                   args.batch, args.dtype, args.causal, args.layout,
                                   None if args.link_gbps is None else args.link_gbps * 1e9)
    except RuntimeInputError as err:
        raise CliError(str(err)) from None
    print(json.dumps(explanation.as_dict(), indent=1) if args.json else explanation.text().rstrip("\n"))
    return 0
