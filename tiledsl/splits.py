"""Split-KV: how many splits, and which kv tiles each split owns.

Decode has few queries per sequence, so a kernel with one block per (sequence, kv head) leaves
most SMs idle while each block walks the whole KV cache alone. Split-KV gives every block a
slice of the cache and merges the partial (O, LSE) afterwards. The heuristic below picks the
number of splits for `split kv = auto`; the reference executor, the traffic model and the
lowering all share `split_ranges`, so they agree on which keys each split sees.
"""
from __future__ import annotations

import math

# Aim for this many waves of blocks over the SMs: one wave leaves a ragged tail idle.
TARGET_WAVES = 2


def choose_splits(batch: int, kv_heads: int, kv_len: int, tile_kv: int, sm_count: int) -> tuple[int, str]:
    """(number of splits, one-line reason) for a decode launch.

    One block per (sequence, kv head, split). No split when batch·kv_heads blocks already fill
    the SMs; otherwise enough splits for about TARGET_WAVES waves, never more than there are
    kv tiles (a split without a tile would only write an empty partial)."""
    blocks = max(batch * kv_heads, 1)
    tiles = max(math.ceil(kv_len / tile_kv), 1)
    if blocks >= sm_count:
        return 1, (f"batch*kv_heads = {batch}*{kv_heads} = {blocks} blocks already fill the "
                   f"{sm_count} SMs: no split")
    wanted = math.ceil(TARGET_WAVES * sm_count / blocks)
    splits = max(1, min(wanted, tiles))
    waves = blocks * splits / sm_count
    reason = (f"batch*kv_heads = {blocks} blocks < {sm_count} SMs; {wanted} splits would give "
              f"{TARGET_WAVES} waves")
    if splits < wanted:
        reason += f", capped at the {tiles} kv tiles of {tile_kv} keys"
    return splits, reason + f": {splits} splits -> {blocks * splits} blocks = {waves:.2f} waves"


def split_ranges(num_tiles: int, splits: int) -> list[tuple[int, int]]:
    """Half-open kv-tile ranges [start, stop) of each split: balanced (sizes differ by at most one
    tile), in order, covering every tile once. More splits than tiles leaves some splits empty."""
    if splits < 1:
        raise ValueError(f"split count must be >= 1, got {splits}")
    return [(s * num_tiles // splits, (s + 1) * num_tiles // splits) for s in range(splits)]
