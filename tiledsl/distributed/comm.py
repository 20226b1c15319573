"""How shards move around the ring: `exchange(tensors, direction, channel)` sends this rank's tensors to its
neighbour in `direction` and receives the same shapes from the other neighbour, returning at once; `wait()`
on the result hands back the received tensors once they are there.

`TorchRing` runs on any torch.distributed process group with batch_isend_irecv. On CUDA the sends and
receives are issued from a side stream that first waits for the compute stream (so a send reads finished
data) and, at wait(), the compute stream waits for them: the kernels of the current block run while the next
shard is in flight. `LocalRing` is a ring of ranks that are threads of one process, exchanging through
queues: the protocol's tests (and a single-GPU run of the whole ring) use it with the same code.

Channels keep the K/V shards apart from the dK/dV sums travelling with them in the backward (both can be in
flight at once): gloo matches messages by tag, NCCL by the order the ranks issue them, the same on every
rank because every rank runs every step (a rank with no block that step still passes the shards on)."""
from __future__ import annotations

import queue
import threading

CHANNELS = ("kv", "dkv")
TAGS_PER_CHANNEL = 8   # tensors one exchange may carry


class Received:
    """An exchange in flight; `wait()` returns the received tensors (the inputs, for a ring of one)."""

    def __init__(self, tensors, works=(), stream=None):
        self.tensors, self.works, self.stream = tensors, works, stream

    def wait(self):
        for work in self.works:
            work.wait()
        if self.stream is not None:
            import torch
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return self.tensors


class TorchRing:
    """A ring over a torch.distributed process group (None: the default group)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ring_attention: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first, e.g. under torchrun)")
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._streams = {}

    def peer(self, offset: int) -> int:
        """The global rank `offset` places along the ring (P2POp takes global ranks)."""
        local = (self.rank + offset) % self.world
        return local if self.group is None else self.dist.get_global_rank(self.group, local)

    def backend(self) -> str:
        return str(self.dist.get_backend(self.group))

    def side_stream(self, device):
        import torch
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def exchange(self, tensors, direction: int, channel: str) -> Received:
        import contextlib

        import torch
        if self.world == 1:
            return Received(tuple(tensors))
        dist, base = self.dist, CHANNELS.index(channel) * TAGS_PER_CHANNEL
        received = tuple(torch.empty_like(t) for t in tensors)
        to, source = self.peer(direction), self.peer(-direction)
        ops = [dist.P2POp(dist.isend, t, to, self.group, base + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, source, self.group, base + i) for i, t in enumerate(received)]
        stream = self.side_stream(tensors[0].device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            works = dist.batch_isend_irecv(ops)
        return Received(received, works, stream)

    def all_equal(self, values: list[int], device) -> list[list[int]]:
        """Every rank's `values` (rank order): the shape check before the first exchange."""
        import torch
        on = device if self.backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=on)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        self.dist.all_gather(everyone, mine, group=self.group)
        return [t.tolist() for t in everyone]


class LocalRing:
    """`world` ranks as threads of one process: `LocalRing(world).run(fn)` calls fn(endpoint) on a thread
    per rank and returns their results in rank order (the first exception is raised after all stop)."""

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"a ring needs at least one rank, got {world}")
        self.world = world
        self.inboxes = {(r, d, c): queue.Queue() for r in range(world) for d in (1, -1) for c in CHANNELS}
        self.barrier = threading.Barrier(world)
        self.shapes: list = [None] * world

    def endpoint(self, rank: int) -> "LocalEndpoint":
        return LocalEndpoint(self, rank)

    def run(self, fn, timeout_s: float = 600.0) -> list:
        results, errors = [None] * self.world, [None] * self.world

        def body(rank):
            try:
                results[rank] = fn(self.endpoint(rank))
            except BaseException as err:   # re-raised below, after every thread has stopped
                errors[rank] = err
                self.barrier.abort()       # a rank waiting for the failed one must not hang
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"LocalRing: ranks still running after {timeout_s} s")
        return results


class LocalEndpoint:
    """One rank of a LocalRing (what ring_attention takes as `group` for a ring of threads)."""

    def __init__(self, ring: LocalRing, rank: int):
        self.ring, self.rank, self.world = ring, rank, ring.world

    def exchange(self, tensors, direction: int, channel: str) -> Received:
        if self.world == 1:
            return Received(tuple(tensors))
        to = (self.rank + direction) % self.world
        # The receiver gets the sender's tensors themselves: a rank never writes a tensor after sending it.
        self.ring.inboxes[(to, direction, channel)].put(tuple(tensors))
        inbox = self.ring.inboxes[(self.rank, direction, channel)]
        return _LocalReceived(inbox, self.ring.barrier)

    def all_equal(self, values: list[int], device) -> list[list[int]]:
        self.ring.shapes[self.rank] = list(values)
        self.ring.barrier.wait()
        everyone = [list(s) for s in self.ring.shapes]
        self.ring.barrier.wait()   # nobody overwrites its entry before every rank has read them all
        return everyone


class _LocalReceived(Received):
    def __init__(self, inbox, barrier):
        super().__init__(None)
        self.inbox, self.barrier = inbox, barrier

    def wait(self):
        while True:
            try:
                return self.inbox.get(timeout=0.5)
            except queue.Empty:
                if self.barrier.broken:   # another rank failed: stop instead of waiting forever
                    raise threading.BrokenBarrierError from None
