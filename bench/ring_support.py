"""Helpers of the torchrun scripts bench/ring_check.py and bench/ring_bench.py: the process group (NCCL on
the GPUs, or gloo on the CPU with the float64 reference blocks for --dry-run), one agreed timing across ranks,
and a ring with no link (each exchange hands back the rank's own tensors) for the compute-only time."""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Setup:
    rank: int
    world: int
    device: object
    dry_run: bool

    @property
    def blocks(self) -> str:
        return "reference" if self.dry_run else "kernels"

    def dtype(self, torch):
        return torch.float64 if self.dry_run else torch.bfloat16

    def say(self, *parts) -> None:
        if self.rank == 0:
            print(*parts, flush=True)


def init(dry_run: bool) -> Setup:
    """The default process group from torchrun's environment: NCCL, one GPU per local rank; or gloo on the CPU."""
    import datetime

    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --nproc-per-node 2 " + " ".join(sys.argv))
    if dry_run:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    return Setup(dist.get_rank(), dist.get_world_size(), device, dry_run)


def synchronize(setup: Setup) -> None:
    import torch
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)


def all_max(setup: Setup, values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=setup.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_ms(setup: Setup, fn, rep_ms: float, collective: bool = True, max_reps: int = 10) -> float:
    """Median wall milliseconds of fn() (the slowest rank's, each rep started together when `collective`).
    The first call is timed to size the run (every rank agrees on the count) and then dropped, unless the
    count is 1 (a call of rep_ms or more: seconds long, nothing to warm up but the allocator)."""
    import torch.distributed as dist

    def once():
        if collective:
            dist.barrier()
        synchronize(setup)
        start = time.perf_counter()
        fn()
        synchronize(setup)
        return (time.perf_counter() - start) * 1e3
    first = all_max(setup, [once()])[0]
    reps = max(1, min(max_reps, math.floor(rep_ms / max(first, 1e-3))))
    times = all_max(setup, [once() for _ in range(reps)])
    return statistics.median(times)


class NoLinkRing:
    """A ring whose exchanges move nothing: each rank gets its own tensors back, so every step computes a block
    of the same shape and mask as in the real ring, without the link (the compute-only time)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def exchange(self, tensors, direction: int, channel: str):
        from tiledsl.distributed.comm import Received
        return Received(tuple(tensors))

    def all_equal(self, values, device):
        return [list(values)] * self.world


def link_gbps(setup: Setup, nbytes: int, rep_ms: float) -> float:
    """One-way GB/s of one ring exchange of `nbytes` (each rank sends to the next while receiving from the
    previous: what a ring step moves), through the same TorchRing the attention uses."""
    import torch

    from tiledsl.distributed.comm import TorchRing
    ring = TorchRing()
    buffer = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=setup.device)
    ms = time_ms(setup, lambda: ring.exchange((buffer,), 1, "kv").wait(), rep_ms)
    return nbytes / (ms * 1e-3) / 1e9
