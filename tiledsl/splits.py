"""Split-KV: how many splits, and which kv tiles each split owns.

Decode has few queries per sequence, so a kernel with one block per (sequence, kv head) leaves
most SMs idle while each block walks the whole KV cache alone. Split-KV cuts every sequence's
cache into slices (work items that any block may take) and merges the partial (O, LSE) afterwards. The heuristic below picks the
number of splits for `split kv = auto`; the reference executor, the traffic model and the
lowering all share `split_ranges`, so they agree on which keys each split sees.
"""
from __future__ import annotations

import math

# Work items per resident block that `split kv = auto` aims for: the decode kernel's blocks are
# persistent and claim (kv group, split) items from a counter, so a block on a fast SM takes more
# of them. SMs of one H200 stream K/V at rates up to 20% apart (per-block timeline,
# bench/results/2026-11-30-decode-timeline-1.json); with one fixed share per block the slowest
# SM's blocks set the time. More items balance finer but add partials to write and merge.
ITEMS_PER_SLOT = 8
MAX_AUTO_SPLITS = 128      # the merge reads splits x dv floats per output row: keep it a short tail
MIN_TILES_PER_SPLIT = 2    # a split of one tile would pay an item's combine for every tile


def choose_splits(batch: int, kv_heads: int, kv_len: int, tile_kv: int, sm_count: int,
                  blocks_per_sm: int = 1) -> tuple[int, str]:
    """(number of splits, one-line reason) for a decode launch.

    `kv_heads` counts kv groups per sequence (kv heads x row tiles). The kernel runs one
    persistent block per resident slot (sm_count * blocks_per_sm) over batch * kv_heads * splits
    work items; aim for ITEMS_PER_SLOT items per slot, with at least MIN_TILES_PER_SPLIT kv tiles
    per split and at most MAX_AUTO_SPLITS splits. No split when the kv groups alone give that many
    items."""
    groups = max(batch * kv_heads, 1)
    tiles = max(math.ceil(kv_len / tile_kv), 1)
    slots = sm_count * max(blocks_per_sm, 1)
    wanted = ITEMS_PER_SLOT * slots // groups
    splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT, MAX_AUTO_SPLITS))
    reason = (f"{groups} kv groups on {slots} resident blocks ({sm_count} SMs x {blocks_per_sm}); "
              f"aim for {ITEMS_PER_SLOT} work items per block")
    if splits == 1:
        return 1, reason + (": the groups alone are enough, no split" if wanted <= 1 else
                            f", but {tiles} kv tiles of {tile_kv} keys are too few to split")
    if splits < wanted:
        limit = (f"{MIN_TILES_PER_SPLIT}+ of the {tiles} kv tiles per split" if splits == tiles // MIN_TILES_PER_SPLIT
                 else f"at most {MAX_AUTO_SPLITS} splits")
        reason += f", capped at {limit}"
    return splits, reason + f": {splits} splits -> {groups * splits} items"


def split_ranges(num_tiles: int, splits: int) -> list[tuple[int, int]]:
    """Half-open kv-tile ranges [start, stop) of each split: balanced (sizes differ by at most one
    tile), in order, covering every tile once. More splits than tiles leaves some splits empty."""
    if splits < 1:
        raise ValueError(f"split count must be >= 1, got {splits}")
    return [(s * num_tiles // splits, (s + 1) * num_tiles // splits) for s in range(splits)]
