"""Which tokens each rank of a context-parallel ring holds, and the helpers that cut a batch into the
ranks' shards and put it back together.

A sequence of N tokens over W ranks is cut into equal chunks. `contiguous`: W chunks, rank r holds chunk r.
`zigzag`: 2W chunks, rank r holds chunks r and 2W-1-r, in that order. Under a causal mask the query chunk i
sees about i + 1/2 chunks of keys, so a contiguous rank r does r + 1/2 chunk-pairs of work and the last rank
W times the first's; every zigzag rank's pair of chunks adds up to the same 2W (TransformerEngine's p2p
context parallelism and ring-flash-attention's zigzag cut the sequence the same way). Shards are equal on
every rank: the ring exchanges whole shards, and a rank with fewer tokens would receive a shard that does
not fit its buffers."""
from __future__ import annotations

from ..errors import RuntimeInputError

LAYOUTS = ("zigzag", "contiguous")
SEQUENCE_DIM = 2   # (batch, heads, seqlen, head_dim), as tiledsl.attention takes them


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"ring layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if check_layout(layout) == "zigzag" else 1


def rank_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its shard stores them."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a ring of {world}")
    return (rank, 2 * world - 1 - rank) if chunks_per_rank(layout) == 2 else (rank,)


def chunk_length(seqlen: int, world: int, layout: str, what: str = "the sequence") -> int:
    """Tokens per chunk; RuntimeInputError when `seqlen` does not cut into equal chunks."""
    chunks = world * chunks_per_rank(layout)
    if seqlen % chunks:
        raise RuntimeInputError(
            f"{what}: {seqlen} tokens do not split into {chunks} equal chunks ({layout} over {world} ranks: "
            f"{chunks_per_rank(layout)} per rank); pad the sequence to a multiple of {chunks}")
    return seqlen // chunks


def token_positions(rank: int, world: int, seqlen: int, layout: str) -> list[int]:
    """The global positions of rank `rank`'s tokens, in its shard's order (tests and explain)."""
    c = chunk_length(seqlen, world, layout)
    return [i for chunk in rank_chunks(rank, world, layout) for i in range(chunk * c, (chunk + 1) * c)]


def _take(x, dim: int, start: int, stop: int):
    return x[(slice(None),) * dim + (slice(start, stop),)]


def _concatenate(parts: list, dim: int):
    if type(parts[0]).__module__.startswith("torch"):
        import torch
        return torch.cat(parts, dim=dim)
    import numpy as np
    return np.concatenate(parts, axis=dim)


def shard(x, rank: int, world: int, layout: str = "zigzag", dim: int = SEQUENCE_DIM):
    """Rank `rank`'s shard of the full sequence `x` (a torch tensor or NumPy array; the sequence along
    `dim`): a new contiguous array of seqlen / world tokens, its chunks in rank_chunks order."""
    c = chunk_length(x.shape[dim], world, layout, f"shard: dim {dim} of an array of shape {tuple(x.shape)}")
    return _concatenate([_take(x, dim, i * c, (i + 1) * c) for i in rank_chunks(rank, world, layout)], dim)


def unshard(shards: list, layout: str = "zigzag", dim: int = SEQUENCE_DIM):
    """The full sequence from every rank's shard (in rank order): the inverse of `shard`."""
    world, per_rank = len(shards), chunks_per_rank(layout)
    if not world:
        raise ValueError("unshard: no shards")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1 or next(iter(lengths)) % per_rank:
        raise RuntimeInputError(f"unshard: shards must have equal lengths divisible by {per_rank} along dim {dim}, "
                                f"got {[s.shape[dim] for s in shards]}")
    c = lengths.pop() // per_rank
    pieces = {}
    for rank, s in enumerate(shards):
        for slot, chunk in enumerate(rank_chunks(rank, world, layout)):
            pieces[chunk] = _take(s, dim, slot * c, (slot + 1) * c)
    return _concatenate([pieces[i] for i in range(world * per_rank)], dim)
