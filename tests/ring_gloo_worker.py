"""One rank of the gloo ring tests (tests/test_ring_cpu.py spawns `world` of these): runs each case's ring
forward and backward on its shards with the float64 reference blocks and saves what it got for the parent to
check against full attention; an uneven case saves the error it raised."""
from __future__ import annotations

import datetime


def run_rank(rank: int, world: int, init_file: str, seed: int, cases: list, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from tests.ring_cases import global_inputs
    from tiledsl.distributed import ring_attention, shard
    from tiledsl.errors import RuntimeInputError
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        results = []
        for i, case in enumerate(cases):
            q, k, v, do = global_inputs(torch, case, seed + i)
            q, k, v, do = (shard(x, rank, world, case.layout) for x in (q, k, v, do))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            o, lse = ring_attention(q, k, v, causal=case.causal, layout=case.layout, scale=case.scale,
                                    return_lse=True)
            o.backward(do)
            results.append({"o": o.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad})
        # uneven shards: rank 0 holds two tokens more than the others
        q = torch.randn(1, 2, 8 + (2 if rank == 0 else 0), 16, dtype=torch.float64)
        try:
            ring_attention(q, q[:, :1], q[:, :1], causal=True)
            uneven = "no error"
        except RuntimeInputError as err:
            uneven = str(err)
        torch.save({"results": results, "uneven": uneven}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
