"""What each rank computes at each step of the ring: plain data, shared by the forward, the backward, the
tests (which check that the blocks of all steps cover the full mask exactly once) and explain.

The forward passes K/V shards to the next rank (rank r receives from r - 1), so at step s rank r holds the
shard of rank (r - s) mod W; the backward runs the other way (rank r receives K/V and the dK/dV sums travelling
with them from r + 1), holding (r + s) mod W. Step 0 is always the rank's own shard: the diagonal block.

A block is a rectangle of the local queries against the held keys:
  no mask:            every query x every key
  causal, contiguous: own shard: causal (square, so bottom-right = top-left); an earlier shard: all of it;
                      a later one: nothing (the rank idles that step)
  causal, zigzag:     own shard: causal over both chunks (they are in global order, and chunk r's queries
                      see nothing of chunk 2W-1-r); source s < r: every query x the source's first chunk
                      (its second lies after both of ours); s > r: our second chunk x all of the source's
                      keys (our first lies before both of its chunks). Every step costs every rank half a
                      shard-pair, so no rank waits on another."""
from __future__ import annotations

from dataclasses import dataclass

from .shards import check_layout

FORWARD, BACKWARD = 1, -1   # which way K/V move: toward rank + 1, or toward rank - 1


@dataclass(frozen=True)
class Block:
    """Queries [q_start, q_stop) of the local shard against keys [kv_start, kv_stop) of the held shard."""
    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool

    @property
    def queries(self) -> int:
        return self.q_stop - self.q_start

    @property
    def keys(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def pairs(self) -> int:
        """(query, key) pairs the block computes (the causal diagonal included)."""
        q, k = self.queries, self.keys
        return q * (q + 1) // 2 + q * (k - q) if self.causal else q * k

    @property
    def all_queries(self) -> bool:
        return self.q_start == 0

    def describe(self) -> str:
        return f"{self.queries} x {self.keys} {'causal' if self.causal else 'none'}"


def source_rank(rank: int, world: int, step: int, direction: int) -> int:
    """The rank whose K/V shard rank `rank` holds at `step`."""
    return (rank - direction * step) % world


def block(rank: int, source: int, world: int, local_len: int, layout: str, causal: bool) -> Block | None:
    """What `rank` computes against `source`'s K/V shard (None: nothing)."""
    check_layout(layout)
    if not causal:
        return Block(0, local_len, 0, local_len, False)
    if source == rank:
        return Block(0, local_len, 0, local_len, True)
    if layout == "contiguous":
        return Block(0, local_len, 0, local_len, False) if source < rank else None
    half = local_len // 2
    return Block(0, local_len, 0, half, False) if source < rank else Block(half, local_len, 0, local_len, False)


def step_blocks(world: int, local_len: int, layout: str, causal: bool, step: int,
                direction: int = FORWARD) -> list[Block | None]:
    """Every rank's block at `step` (index: rank)."""
    return [block(r, source_rank(r, world, step, direction), world, local_len, layout, causal) for r in range(world)]
