"""Scaling of tiledsl.distributed.ring_attention: one GPU against n GPUs for the same total tokens, forward
and backward, causal zigzag, bf16 d128, 64k to 1M tokens; with the compute-only ring (the same blocks with
no link) and the link rate measured in the same run, and explain-ring's prediction at that rate.

    torchrun --nproc-per-node N bench/ring_bench.py OUT.json [--seqlens 65536 ... 1048576] [--heads 8]
             [--kv-heads 8] [--layouts zigzag] [--rep-ms 2000] [--dry-run]

Per total length: single-GPU tiledsl (tiledsl.attention forward, forward + backward through autograd) on
every rank's GPU at once (the same work on each; the slowest rank's median is kept; a length that does not
fit one GPU is recorded as out of memory: the largest that fits is the last that did); the ring forward and
forward + backward on the ranks' shards; the compute-only ring (ring_forward / ring_backward on a ring whose
exchanges move nothing); the one-way link GB/s of a K/V shard's exchange. Backward = (forward + backward) -
forward. Rows per (length, layout, pass): ms of each, scaling efficiency = single / (n x ring), overlap =
compute-only / ring (1.0: the link is fully hidden), the prediction. Every rank must see the same out of
memory (same GPUs): the timing's all-reduces assume every rank times the same calls. Each timed call starts
on every rank after a barrier; medians over reps sized by --rep-ms. About 3-4 minutes on 2 H200s at the default lengths
(one GPU's forward + backward at 1M tokens takes ~17 s). --dry-run: gloo on the CPU, the float64 reference
blocks and tiny shapes: this script's plumbing on a machine without GPUs."""
from __future__ import annotations

import argparse
import sys

from ring_support import ROOT, NoLinkRing, init, link_gbps, time_ms

sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import attention_flops, record  # noqa: E402

BACKWARD_FLOPS = 2.5   # backward FLOPs per forward FLOP (tiledsl.tune.backward.FLOPS_PER_FORWARD)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write (rank 0; tiledsl.tune.bench.record)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072, 262144, 524288, 1048576])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layouts", nargs="+", default=["zigzag"], choices=["zigzag", "contiguous"])
    parser.add_argument("--rep-ms", type=float, default=2000.0, help="timing window per measurement")
    parser.add_argument("--no-single", action="store_true", help="skip the single-GPU runs (then no efficiency)")
    parser.add_argument("--dry-run", action="store_true", help="gloo on the CPU with the float64 reference blocks")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    import tiledsl
    from tests import attention_reference as ref
    from tiledsl.distributed import explain_ring, ring_attention, ring_backward, ring_forward
    setup = init(args.dry_run)
    world, dtype, d = setup.world, setup.dtype(torch), args.head_dim
    if args.dry_run:
        args.seqlens, args.heads, args.kv_heads, d, args.rep_ms = [16 * world, 32 * world], 2, 1, 16, 1.0
    kv_heads = args.kv_heads or args.heads
    causal = True

    def make(heads, n, grad=False):
        return torch.randn(1, heads, n, d, dtype=dtype, device=setup.device, requires_grad=grad)

    def single_times(n):
        """(forward ms, forward + backward ms) of the whole sequence on each GPU; None when it does not fit."""
        try:
            q, k, v = make(args.heads, n, True), make(kv_heads, n, True), make(kv_heads, n, True)
            do = make(args.heads, n)
            if args.dry_run:
                attend = lambda: ref.attention(q, k, v, causal=causal)[0]  # noqa: E731
            else:
                attend = lambda: tiledsl.attention(q, k, v, causal=causal)  # noqa: E731
            with torch.no_grad():
                fwd = time_ms(setup, attend, args.rep_ms, collective=False)
            both = time_ms(setup, lambda: torch.autograd.grad(attend(), (q, k, v), do), args.rep_ms, collective=False)
            return fwd, both
        except torch.OutOfMemoryError:
            return None
        finally:
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()

    rows = []
    for n in args.seqlens:
        local = n // world
        single = None if args.no_single else single_times(n)
        fits = all(x == 1.0 for x in _all_flags(setup, single is not None))
        gbps = link_gbps(setup, kv_heads * local * 2 * d * 2, args.rep_ms) if world > 1 else None
        for layout in args.layouts:
            q, k, v = make(args.heads, local, True), make(kv_heads, local, True), make(kv_heads, local, True)
            do = make(args.heads, local)
            attend = lambda: ring_attention(q, k, v, causal=causal, layout=layout, blocks=setup.blocks)  # noqa: E731
            with torch.no_grad():
                fwd = time_ms(setup, attend, args.rep_ms)
            both = time_ms(setup, lambda: torch.autograd.grad(attend(), (q, k, v), do), args.rep_ms)
            no_link = NoLinkRing(setup.rank, world)
            kw = dict(causal=causal, layout=layout, blocks=setup.blocks)

            def compute_only():
                o_acc, lse = ring_forward(q, k, v, no_link, **kw)
                return ring_backward(q, k, v, o_acc.to(dtype), lse, do, no_link, **kw)
            c_fwd = time_ms(setup, lambda: ring_forward(q, k, v, no_link, **kw), args.rep_ms)
            c_both = time_ms(setup, compute_only, args.rep_ms)
            predicted = explain_ring(n, world, args.heads, d, kv_heads, batch=1, causal=causal, layout=layout,
                                     link_bytes_per_s=gbps * 1e9 if gbps else None) if not args.dry_run else None
            flops = attention_flops(1, args.heads, n, n, d, causal)
            for name, ring_ms, compute_ms, single_ms, pass_flops in (
                    ("forward", fwd, c_fwd, single[0] if fits and single else None, flops),
                    ("backward", both - fwd, c_both - c_fwd, single[1] - single[0] if fits and single else None,
                     BACKWARD_FLOPS * flops)):
                row = dict(kernel="ring_attention", family="ring", dtype=str(dtype).replace("torch.", ""), head_dim=d,
                           seqlen=n, causal=causal, layout=layout, ranks=world, direction=name, heads=args.heads,
                           kv_heads=kv_heads, ms=ring_ms, tflops_per_gpu=pass_flops / world / ring_ms / 1e9,
                           compute_only_ms=compute_ms, overlap=compute_ms / ring_ms if ring_ms > 0 else None,
                           single_gpu_ms=single_ms,
                           efficiency=single_ms / (world * ring_ms) if single_ms and ring_ms > 0 else None,
                           single_gpu_fits=fits,
                           peers={"single_gpu_tiledsl_ms": single_ms, "compute_only_ring_ms": compute_ms,
                                  "link_gbps_one_way": gbps})
                if predicted is not None:
                    row["predicted"] = {"ring_ms": getattr(predicted, f"{name}_ms"),
                                        "efficiency": predicted.efficiency(name),
                                        "link_bound_steps": sum(s.bound == "link" for s in getattr(predicted, name))}
                rows.append(row)
                shown = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
                setup.say(f"{n} tokens {layout} {name}: ring {ring_ms:.2f} ms, compute-only {compute_ms:.2f} ms, "
                          f"one GPU {shown(single_ms, '.2f')} ms, efficiency {shown(row['efficiency'], '.2f')}, "
                          f"overlap {shown(row['overlap'], '.2f')}, link {shown(gbps, '.1f')} GB/s")
            q = k = v = do = None   # free this length's shards before the next
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    if setup.rank == 0:
        record(args.out, "torchrun --nproc-per-node {} bench/ring_bench.py {}".format(world, " ".join(sys.argv[1:])),
               rows, ranks=world, largest_single_gpu_seqlen=max((r["seqlen"] for r in rows if r["single_gpu_fits"]),
                                                                default=None))
    dist.destroy_process_group()
    return 0


def _all_flags(setup, flag: bool) -> list[float]:
    """Whether every rank's flag is set (a single-GPU run that ran out of memory on one rank counts for all)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=setup.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


if __name__ == "__main__":
    sys.exit(main())
