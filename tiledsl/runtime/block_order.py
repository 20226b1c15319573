"""The order in which FA2 thread blocks are launched: equal groups of (batch, head) pairs, and
inside each group the longest query tiles first.

The GPU starts blocks in launch order, so the order decides two things:

* The tail. Under a causal mask query tile i sees i + 1 kv tiles, so the blocks' costs differ
  up to q_tiles-fold. If a long block starts near the end it runs alone while SMs idle.
  Inside a group the longest tiles go first (longest-processing-time-first list scheduling),
  so each group ends on its short tiles, and those overlap the next group's long ones.
* L2 reuse. All query tiles of one pair read the same K/V, so blocks running at the same time
  should come from few pairs. One global longest-first list (all pairs in one group) spreads
  the resident blocks over every pair and re-reads K/V from HBM; one pair at a time starts its
  longest tile late for the last pairs.

Measured on an H200 (bench/NOTES.md): groups whose blocks fill every resident slot with about 1
to 2 of the longest blocks beat both one pair at a time and one global list, and a short last
group costs time, so the pairs are cut into groups of equal size. Without a mask every block
costs the same: one pair at a time.
"""
from __future__ import annotations

from ..spec import Mask

# Longest-block durations a group gives every resident slot (see above: 1 to 2 measured best).
LONGEST_BLOCKS_PER_SLOT = 1.5


def order_groups(mask: Mask, pairs: int, q_tiles: int, slots: int) -> int:
    """How many launch-order groups to cut `pairs` (batch, head) pairs of `q_tiles` query tiles
    into, on `slots` resident blocks (SMs x blocks per SM). Group sizes differ by at most one.

    Under a mask that makes later tiles longer, a pair's tiles cost q_tiles (q_tiles + 1) / 2
    tile-steps and its longest q_tiles, so a group of G pairs gives each slot
    G (q_tiles + 1) / (2 slots) longest blocks; G is aimed at LONGEST_BLOCKS_PER_SLOT of them."""
    if pairs <= 1:
        return 1
    if mask is Mask.NONE:
        return pairs
    target = 2 * LONGEST_BLOCKS_PER_SLOT * slots / (q_tiles + 1)
    return min(pairs, max(1, round(pairs / max(target, 1))))


def group_bounds(group: int, groups: int, pairs: int) -> tuple[int, int]:
    """[first pair, last pair + 1) of a group: balanced, in order."""
    return group * pairs // groups, (group + 1) * pairs // groups


def block_coordinates(block: int, q_tiles: int, pairs: int, groups: int) -> tuple[int, int]:
    """(query tile, pair index) of launch-order block `block`: what fa2.cu.j2 computes on the
    GPU, in Python so tests can check that every (tile, pair) is launched exactly once."""
    pair_slot = block // q_tiles
    group = ((pair_slot + 1) * groups - 1) // pairs   # the last group starting at or before pair_slot
    start, stop = group_bounds(group, groups, pairs)
    in_group = block - start * q_tiles
    return q_tiles - 1 - in_group // (stop - start), start + in_group % (stop - start)


def describe(mask: Mask, pairs: int, q_tiles: int, slots: int) -> str:
    """One line for `tiledsl explain`: the launch order this shape gets, and why."""
    groups = order_groups(mask, pairs, q_tiles, slots)
    blocks = f"{pairs} (batch, head) pairs x {q_tiles} q tiles on {slots} resident blocks"
    if groups == pairs:
        why = "no mask: every block costs the same" if mask is Mask.NONE else "one pair per group"
        return f"launch order: {blocks}, one pair after another ({why})"
    low, high = pairs // groups, -(-pairs // groups)
    size = f"{low}" if low == high else f"{low}-{high}"
    return (f"launch order: {blocks}, in {groups} group(s) of {size} pairs, longest q tiles first inside each "
            f"(q tile i sees i+1 kv tiles; each group gives every resident block about "
            f"{LONGEST_BLOCKS_PER_SLOT:g} of the longest)")
