"""The fa2 paged kernel's block-table ring (layout.fa2_page_ring) without a GPU: its sizes, where
the layout, the plan and the graph show it, and a model of the template's schedule (fa2.cu.j2 and
macros.j2's issue_kv_tile) that checks every tile's entries are in their slot, copied and behind a
barrier, before any thread reads them, and that no copy overwrites a slot a thread may still read."""
from __future__ import annotations

import pytest

from tiledsl.layout.base import FA2_PAGE_RING_MIN
from tiledsl.layout.fa2 import fa2_page_ring
from tiledsl.families import layout_of, lower
from tiledsl.schedule.passes import run_passes
from tiledsl.serving.prefill import prefill_spec
from tiledsl.spec import DType, Mask


@pytest.mark.parametrize("page, tile_kv, stages, want", [
    (16, 64, 2, (2, 4)), (64, 64, 2, (2, 1)), (256, 64, 2, (2, 1)), (16, 64, 3, (4, 4)), (32, 128, 4, (6, 4)),
    (32, 48, 2, (2, 3)),   # a 48-key tile starts mid-page: one more entry than 48 / 32 rounds to
    (64, 48, 2, (2, 2)),
    (None, 64, 2, (0, 0)), (16, 64, 1, (0, 0)), (FA2_PAGE_RING_MIN // 2, 64, 2, (0, 0)),
])
def test_ring_sizes(page, tile_kv, stages, want):
    assert fa2_page_ring(page, tile_kv, stages) == want


def _model(stages: int, slots: int, tiles: int) -> None:
    """Run the template's schedule for `tiles` kv tiles (tile_begin 0) and assert its invariants.
    Epochs are the spans between block barriers: the prologue's plain copies end with one; the
    loop's wait_k(t) waits for the cp.async groups up to K(t) and ends with one."""
    slot_of = {}          # slot -> tile whose entries it holds
    ready = {}            # tile -> epoch from which its entries are readable
    read_in = {}          # tile -> epoch in which its loads read the entries
    in_group = {}         # K group (its tile) -> tile whose entries the group copies
    epoch = 0

    def write(tile, ready_epoch):
        slot = tile % slots
        held = slot_of.get(slot)
        if held is not None:   # overwriting: the held tile was read, by every thread, in an earlier epoch
            assert held in read_in and read_in[held] < epoch, f"slot {slot}: tile {tile} overwrites tile {held}"
        slot_of[slot] = tile
        ready[tile] = ready_epoch

    def issue(tile):
        assert slot_of.get(tile % slots) == tile and ready.get(tile, 1 << 30) <= epoch, f"tile {tile} read too early"
        read_in[tile] = epoch
        if tile + stages - 1 < tiles:
            in_group[tile] = tile + stages - 1
            write(tile + stages - 1, ready_epoch=1 << 30)   # in flight until its group is waited

    for t in range(min(stages - 1, tiles)):   # copy_tile_pages<false>, then __syncthreads
        write(t, ready_epoch=1)
    epoch = 1
    for s in range(min(stages - 1, tiles)):   # the prologue's issue_kv_tile, no barrier between
        issue(s)
    for t in range(tiles):
        epoch += 1                                # wait_k(t): groups up to K(t) done, then a barrier
        for g, copied in in_group.items():
            if g <= t and ready[copied] > epoch:
                ready[copied] = epoch
        if t + stages - 1 < tiles:
            issue(t + stages - 1)


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("tiles", [1, 2, 3, 5, 12])
def test_schedule_reads_only_copied_entries_and_never_clobbers(stages, tiles):
    slots, _ = fa2_page_ring(16, 64, stages)
    _model(stages, slots, tiles)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_model_catches_a_ring_one_slot_short(stages):
    slots, _ = fa2_page_ring(16, 64, stages)
    with pytest.raises(AssertionError):
        _model(stages, slots - 1, 12)


def test_layout_plan_and_graph_show_the_ring():
    spec = prefill_spec("sm_90", DType.BF16, 128, 128, Mask.CAUSAL, 16)
    ring = layout_of(spec).buffer("block-table entries")
    assert (ring.stages, ring.stage_bytes) == (2, 4 * 4)
    consts = {c.name: c.value for c in lower(spec).constants}
    assert consts["PAGE_RING"] == 2 and consts["TILE_PAGES"] == 4 and consts["PAGES_OFFSET"] == ring.offset
    lookup = run_passes(spec).op("page_lookup")
    assert lookup.space.value == "shared" and "shared ring" in lookup.text
    small = prefill_spec("sm_90", DType.BF16, 128, 128, Mask.CAUSAL, 4)   # under FA2_PAGE_RING_MIN: inline
    assert {c.name: c.value for c in lower(small).constants}["PAGE_RING"] == 0
    assert run_passes(small).op("page_lookup").space.value == "registers"
    assert not any(b.name == "block-table entries" for b in layout_of(small).buffers)
