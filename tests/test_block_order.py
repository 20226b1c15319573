"""The FA2 launch order (tiledsl/runtime/block_order.py): every (query tile, pair) is launched exactly
once, groups are equal and in order, the longest tiles of a group go first, and the group count
follows the rule the H200 measurements set."""
import random

import pytest

from tiledsl.runtime.block_order import block_coordinates, group_bounds, order_groups
from tiledsl.device_limits import H200
from tiledsl.device_limits import resident_blocks as blocks_and_limit
from tiledsl.spec import Mask


@pytest.mark.parametrize("seed", range(40))
def test_every_tile_of_every_pair_is_launched_once(seed):
    rng = random.Random(seed)
    q_tiles, pairs = rng.randint(1, 40), rng.randint(1, 300)
    groups = rng.randint(1, pairs)
    seen = [block_coordinates(b, q_tiles, pairs, groups) for b in range(q_tiles * pairs)]
    assert sorted(seen) == sorted((t, p) for t in range(q_tiles) for p in range(pairs))


@pytest.mark.parametrize("q_tiles, pairs, groups", [(8, 256, 3), (32, 64, 3), (128, 16, 3), (5, 7, 7), (5, 7, 1), (1, 9, 4)])
def test_groups_run_in_order_longest_tiles_first(q_tiles, pairs, groups):
    order = [block_coordinates(b, q_tiles, pairs, groups) for b in range(q_tiles * pairs)]
    group_of = {p: g for g in range(groups) for p in range(*group_bounds(g, groups, pairs))}
    assert [group_of[p] for _, p in order] == sorted(group_of[p] for _, p in order)
    for g in range(groups):
        tiles = [t for t, p in order if group_of[p] == g]
        assert tiles == sorted(tiles, reverse=True)


def test_group_sizes_differ_by_at_most_one():
    for pairs in range(1, 60):
        for groups in range(1, pairs + 1):
            sizes = [b - a for a, b in (group_bounds(g, groups, pairs) for g in range(groups))]
            assert sum(sizes) == pairs and max(sizes) - min(sizes) <= 1


def test_one_group_per_pair_without_a_mask():
    assert order_groups(Mask.NONE, 256, 8, 264) == 256
    assert order_groups(Mask.CAUSAL, 1, 8, 264) == 1


@pytest.mark.parametrize("pairs, q_tiles, expected", [
    (256, 8, 3),     # d128 N=1k: 264 slots want ~88 pairs per group
    (64, 32, 3),     # d128 N=4k
    (16, 128, 3),    # d128 N=16k: groups of 5-6 pairs
    (512, 8, 6),     # d64 N=1k
    (2, 128, 1),     # fewer pairs than one group wants: one global longest-first list
])
def test_causal_groups_give_each_slot_one_and_a_half_longest_blocks(pairs, q_tiles, expected):
    assert order_groups(Mask.CAUSAL, pairs, q_tiles, 264) == expected
    assert order_groups(Mask.WINDOW, pairs, q_tiles, 264) == expected


def resident_blocks(smem_bytes, threads, registers, smem_per_sm):
    """At least one block, as the launch order counts slots."""
    assert smem_per_sm == H200.shared_per_sm
    return max(1, blocks_and_limit(H200, registers, threads, smem_bytes)[0])


def test_resident_blocks_are_limited_by_registers_smem_and_threads():
    assert resident_blocks(98304, 128, 255, 233472) == 2          # the bundled d128 FA2 kernel
    assert resident_blocks(102400, 128, 178, 233472) == 2         # decode: shared memory binds
    assert resident_blocks(1024, 128, 32, 233472) == 16           # threads bind: 2048 / 128
    assert resident_blocks(300000, 128, 32, 233472) == 1          # never below one


def test_explain_states_the_launch_order():
    from pathlib import Path

    from tiledsl.cli.report import explain
    from tiledsl.frontend.parse import load_spec
    specs = Path(__file__).resolve().parent.parent / "specs"
    causal = explain(load_spec(str(specs / "fa2_d128_causal.tile")), batch=16, heads=16, seqlen_q=1024)
    assert "launch order: 256 (batch, head) pairs x 8 q tiles on 264 resident blocks, in 3 group(s) of 85-86 pairs" in causal
    plain = explain(load_spec(str(specs / "fa2_d128.tile")), batch=1, heads=16, seqlen_q=4096)
    assert "one pair after another (no mask: every block costs the same)" in plain


def test_runtime_counts_slots_once_per_device_from_the_compiled_registers(monkeypatch):
    from types import SimpleNamespace

    from tiledsl.runtime import device
    from tiledsl.frontend.parse import load_spec
    from tiledsl import compile
    from tiledsl.runtime.inputs import Shapes
    from pathlib import Path
    monkeypatch.setitem(device._DEVICE_LIMITS, 0, H200)
    spec = load_spec(str(Path(__file__).resolve().parent.parent / "specs" / "fa2_d128_causal.tile"))
    kernel = compile(spec)
    kernel._functions[0] = {kernel.name: SimpleNamespace(num_regs=255)}   # what ptxas gave the bundled kernel
    assert kernel.slots(0) == 132 * 2
    assert kernel.order_groups_for(Shapes(16, 16, 16, 1024, 1024), 0) == 3
    kernel._functions[0] = {kernel.name: SimpleNamespace(num_regs=64)}    # not read again: slots are per device
    assert kernel.slots(0) == 264
    kernel.order_groups = 7
    assert kernel.order_groups_for(Shapes(16, 16, 16, 1024, 1024), 0) == 7
