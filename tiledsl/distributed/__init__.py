"""Context parallelism: attention over a sequence whose tokens are spread over the ranks of a
torch.distributed group, one shard per rank, with K/V passed around a ring (ring.py), the partial results
merged exactly (merge.py), shards cut in zigzag or contiguous order (shards.py), and `explain_ring` telling
whether a ring will be compute- or link-bound (explain.py).

    from tiledsl.distributed import ring_attention, shard, unshard
    q_local = shard(q, rank, world)                     # zigzag: chunks rank and 2*world-1-rank
    o_local = ring_attention(q_local, k_local, v_local, causal=True)
"""
from __future__ import annotations

from .comm import LocalRing
from .explain import explain_ring
from .ring import ring_attention, ring_backward, ring_forward
from .shards import LAYOUTS, rank_chunks, shard, token_positions, unshard

__all__ = ["LAYOUTS", "LocalRing", "explain_ring", "rank_chunks", "ring_attention", "ring_backward", "ring_forward",
           "shard", "token_positions", "unshard"]
