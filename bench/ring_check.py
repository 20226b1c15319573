"""Multi-GPU check of tiledsl.distributed.ring_attention: outputs and gradients of the ring against
single-GPU tiledsl (tiledsl.attention + autograd) on the same inputs, at 32k-128k tokens, zigzag and
contiguous, causal and not, GQA; and, at 4k tokens, both against float64 attention.

    torchrun --nproc-per-node N bench/ring_check.py OUT.json [--seqlens 32768 65536 131072] [--dry-run]

Every rank builds the same global inputs from the seed, runs the whole sequence on its own GPU (the
single-GPU result) and the ring on its shard, and compares its shard of the two; errors are max-norm relative
over the whole sequence (all-reduced). Bounds: both are bf16 computations each within tests/
attention_reference's bound of float64 (O: OUT_TOLERANCE, gradients: GRAD_TOLERANCE; LSE: TOLERANCE_LSE
absolute), so they may differ by twice it; the 4k anchor rows hold each to the bound itself. Exit 1 when
any row fails. --dry-run: gloo on the CPU, the float64 reference blocks, tiny shapes, float64 throughout
(bound 1e-12): checks this script's plumbing on a machine without GPUs. About 1-2 minutes on 2 H200s."""
from __future__ import annotations

import argparse
import os
import sys

from ring_support import ROOT, all_max, init

sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import record  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write (rank 0; tiledsl.tune.bench.record)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--anchor-seqlen", type=int, default=4096, help="tokens of the float64 anchor rows")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None, help="default: fresh (rank 0's, shared with all)")
    parser.add_argument("--dry-run", action="store_true", help="gloo on the CPU with the float64 reference blocks")
    args = parser.parse_args(argv)
    import torch

    import tiledsl
    from tests import attention_reference as ref
    from tests.gpu_support import TOLERANCE_LSE
    from tiledsl.distributed import ring_attention, shard
    setup = init(args.dry_run)
    world, dtype = setup.world, setup.dtype(torch)
    # every rank must build the same inputs: the largest of the ranks' fresh seeds
    fresh = int.from_bytes(os.urandom(4), "little")
    args.seed = int(all_max(setup, [args.seed if args.seed is not None else fresh])[0])
    if args.dry_run:
        args.seqlens, args.anchor_seqlen, args.heads, args.head_dim = [8 * world, 16 * world], 4 * world, 2, 16
        bounds = {"o": 1e-12, "lse": 1e-12, "grads": 1e-12}
    else:
        name = str(dtype).replace("torch.", "")
        bounds = {"o": ref.OUT_TOLERANCE[name], "lse": TOLERANCE_LSE, "grads": ref.GRAD_TOLERANCE[name]}

    def inputs(n, kv_heads, seed):
        gen = torch.Generator(device=setup.device).manual_seed(seed)
        make = lambda h: torch.randn(1, h, n, args.head_dim, generator=gen, dtype=dtype,  # noqa: E731
                                     device=setup.device)
        return make(args.heads), make(kv_heads), make(kv_heads), make(args.heads)

    def single(q, k, v, do, causal):
        """(O, LSE, dQ, dK, dV) of the whole sequence on this GPU: tiledsl (or float64 on a dry run)."""
        if args.dry_run:
            return ref.gradients(q, k, v, do, causal=causal)
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o, lse = tiledsl.attention(q, k, v, causal=causal, return_lse=True)
        o.backward(do)
        return o.detach(), lse, q.grad, k.grad, v.grad

    def ring(q, k, v, do, causal, layout):
        mine = [shard(x, setup.rank, world, layout).requires_grad_(i < 3) for i, x in enumerate((q, k, v, do))]
        o, lse = ring_attention(*mine[:3], causal=causal, layout=layout, return_lse=True, blocks=setup.blocks)
        o.backward(mine[3])
        return o.detach(), lse, mine[0].grad, mine[1].grad, mine[2].grad

    def errors(got, want, layout):
        """Max-norm relative errors (LSE: absolute) of this rank's shard of `got` against `want`, over all ranks."""
        local = []
        for i, (g, w) in enumerate(zip(got, want)):
            w = shard(w, setup.rank, world, layout).double()
            diff = (g.double() - w).abs()
            diff = diff.nan_to_num(float("inf"))
            local += [float(diff.max()), 1.0 if i == 1 else float(w.abs().max())]
        gathered = all_max(setup, local)
        return [gathered[2 * i] / max(gathered[2 * i + 1], 1e-300) for i in range(len(got))]

    names = ("o", "lse", "dq", "dk", "dv")
    rows, failed = [], 0
    # (tokens, causal, layout, kv heads, against float64): contiguous at the first length only, then the anchor
    plan = [(n, causal, layout, kv, False) for n in args.seqlens for causal in (True, False)
            for layout in ("zigzag", "contiguous") for kv in (args.heads, max(args.heads // 4, 1))
            if layout == "zigzag" or n == args.seqlens[0]]
    plan.append((args.anchor_seqlen, True, "zigzag", max(args.heads // 4, 1), True))
    for i, (n, causal, layout, kv_heads, anchor) in enumerate(plan):
        q, k, v, do = inputs(n, kv_heads, args.seed + i)
        mine = ring(q, k, v, do, causal, layout)
        want = ref.gradients(q, k, v, do, causal=causal) if anchor else single(q, k, v, do, causal)
        errs = dict(zip(names, errors(mine, want, layout)))
        factor = 1.0 if anchor or args.dry_run else 2.0
        limit = {"o": factor * bounds["o"], "lse": factor * bounds["lse"],
                 **{g: factor * bounds["grads"] for g in ("dq", "dk", "dv")}}
        passed = all(errs[x] < limit[x] for x in names)
        failed += not passed
        row = dict(kernel="ring_attention", family="ring", dtype=str(dtype).replace("torch.", ""),
                   head_dim=args.head_dim, seqlen=n, causal=causal, layout=layout, ranks=world, heads=args.heads,
                   kv_heads=kv_heads, errors=errs,
                   against="float64" if anchor or args.dry_run else "single-GPU tiledsl",
                   bounds=limit, passed=passed, peers={"single_gpu": "float64 attention (dry run)" if args.dry_run else
                                                       "tiledsl.attention + autograd on one GPU"})
        rows.append(row)
        setup.say(f"{'PASS' if passed else 'FAIL'} {n} tokens {layout} {'causal' if causal else 'none'} "
                  f"kv_heads {kv_heads} vs {row['against']}: " + ", ".join(f"{x} {errs[x]:.2e}" for x in names))
        del q, k, v, do, mine, want
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    if setup.rank == 0:
        record(args.out, "torchrun --nproc-per-node {} bench/ring_check.py {}".format(world, " ".join(sys.argv[1:])),
               rows, seed=args.seed, ranks=world, failed=failed)
        print(f"{len(rows) - failed} passed, {failed} failed", flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
