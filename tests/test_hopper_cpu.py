"""The Hopper warp-specialized family without a GPU: its consumers' barrier protocol, simulated op by
op from the plan for every schedule switch and tile count, and the bundled specs' PTX and ptxas
report (register reallocation honoured, TMA, mbarriers and wgmma present)."""
from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest

from tiledsl.codegen import nvcc
from tiledsl.families import lower
from tiledsl.frontend.parse import load_specs
from tiledsl.codegen.render import render
from tiledsl.spec import CopyVia, DType, KernelSpec, Mask, Mma, Problem, Schedule

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(ROOT.glob("specs/hopper_*.tile"))


def spec_for(consumers=2, stages=2, pingpong=False, intra=False, tile_kv=128):
    regs = {1: (56, 240), 2: (24, 240), 3: (32, 160)}[consumers]
    schedule = Schedule(tile_q=64 * consumers, tile_kv=tile_kv, stages=stages, copy=CopyVia.TMA, mma=Mma.WGMMA, producer_warpgroups=1,
                        producer_regs=regs[0], consumer_warpgroups=consumers, consumer_regs=regs[1], pingpong=pingpong,
                        intra_overlap=intra)
    return KernelSpec("h", Problem(64, 64, DType.BF16, Mask.NONE), schedule)


def consumer_trace(plan, tiles: int, consumer: int):
    """The events one consumer warpgroup's code performs over `tiles` kv tiles, as the template runs
    plan.prologue (tile 0), plan.loop_body (tiles loop_start..) and plan.epilogue (one past the last)."""
    events = []
    if tiles == 0:
        return events
    if plan.pingpong and consumer == plan_consumers(plan) - 1:
        events.append(("turn_arrive", 0))   # the last consumer gives the first its first turn

    def run(ops, it, last_turn):
        for op in ops:
            target = it - op.distance
            if op.kind == "turn_pass":
                if not (consumer == plan_consumers(plan) - 1 and last_turn):
                    events.append(("turn_arrive", (consumer + 1) % plan_consumers(plan)))
            elif op.kind == "turn_wait":
                events.append(("turn_sync", consumer))
            elif op.kind == "release_v":
                if op.distance <= 1 or it >= op.distance:
                    events.append(("release_v", target))
            elif op.kind in ("wait_v_full", "mma_pv"):
                events.append((op.kind, target))
            elif op.kind in ("wait_k_full", "mma_qk", "release_k"):
                events.append((op.kind, it))
            elif op.kind in ("wait_qk", "wait_pv"):
                events.append((op.kind, op.pending))
            else:
                events.append((op.kind, it))
    if plan.prologue:
        run(plan.prologue, 0, False)
    for it in range(plan.loop_start, tiles):
        run(plan.loop_body, it, not plan.epilogue and it == tiles - 1)
    if plan.epilogue:
        run(plan.epilogue, tiles, True)
    return events


def plan_consumers(plan) -> int:
    return next(c.value for c in plan.constants if c.name == "CONSUMERS")


SWITCHES = [(c, s, p, i) for c, s, p, i in itertools.product([1, 2, 3], [1, 2, 3], [False, True], [False, True])
            if not (p and c == 1)]   # ping-pong needs two consumers


@pytest.mark.parametrize("consumers,stages,pingpong,intra", SWITCHES)
def test_every_tile_is_waited_for_used_and_released_once_in_order(consumers, stages, pingpong, intra):
    plan = lower(spec_for(consumers, stages, pingpong, intra))
    for tiles in range(0, 6):
        events = consumer_trace(plan, tiles, 0)
        for kind in ("wait_k_full", "mma_qk", "release_k", "wait_v_full", "mma_pv", "release_v"):
            assert sorted(t for k, t in events if k == kind) == list(range(tiles)), (kind, tiles, events)
        pos = {e: i for i, e in enumerate(events) if e[0] not in ("wait_qk", "wait_pv", "turn_sync", "turn_arrive")}
        for t in range(tiles):
            assert pos[("wait_k_full", t)] < pos[("mma_qk", t)] < pos[("release_k", t)]
            assert pos[("wait_v_full", t)] < pos[("mma_pv", t)] < pos[("release_v", t)]
            # the wgmma reading the slot has been waited for before the slot is released
            waits = [i for i, e in enumerate(events) if e[0] == "wait_pv" and pos[("mma_pv", t)] < i < pos[("release_v", t)]]
            assert waits and events[waits[-1]][1] == 0, events
            assert pos[("mma_qk", t)] < pos[("mma_pv", t)]


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("intra", [False, True])
def test_pingpong_turns_balance_for_every_tile_count(consumers, intra):
    plan = lower(spec_for(consumers, 2, True, intra))
    for tiles in range(0, 6):
        syncs = {c: 0 for c in range(consumers)}
        arrivals = {c: 0 for c in range(consumers)}
        for c in range(consumers):
            for kind, target in consumer_trace(plan, tiles, c):
                if kind == "turn_sync":
                    syncs[target] += 1
                elif kind == "turn_arrive":
                    arrivals[target] += 1
        # each named barrier completes as often as its consumer waits on it: nothing left over
        assert syncs == arrivals, (tiles, syncs, arrivals)


def test_intra_overlap_keeps_p_v_in_flight_through_the_softmax():
    body = lower(spec_for(2, 2, False, True)).loop_body
    kinds = [op.kind for op in body]
    qk_wait = kinds.index("wait_qk")
    assert body[qk_wait].pending == 1 and kinds.index("mma_pv") < qk_wait < kinds.index("softmax")
    assert "wait_pv" not in kinds[qk_wait:], "P V is waited for at the top of the next trip, past the back edge"


nvcc_needed = pytest.mark.skipif(nvcc.nvcc_path() is None and os.environ.get("TILEDSL_REQUIRE_NVCC") != "1",
                                 reason="nvcc not on PATH")


@nvcc_needed
@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_bundled_specs_use_tma_mbarriers_wgmma_and_register_reallocation(path):
    spec = load_specs(str(path))[0]
    source = render(lower(spec))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, _ = nvcc.compile_to(source, spec.kernel_name, "ptx", Path(tmp))
        ptx = ptx_path.read_text()
        _, report = nvcc.compile_to(source, spec.kernel_name, "cubin", Path(tmp))
    for instruction in ("setmaxnreg.dec", "setmaxnreg.inc", "cp.async.bulk.tensor", "mbarrier.try_wait.parity",
                        "mbarrier.arrive.expect_tx", "wgmma.mma_async"):
        assert instruction in ptx, instruction
    assert "C7508" not in report, f"ptxas ignored setmaxnreg:\n{report}"
    assert "C7512" not in report and "serialized" not in report, f"wgmma serialised:\n{report}"
    res = nvcc.parse_ptxas(report)[spec.kernel_name]
    assert res.spill_stores == 0 and res.spill_loads == 0, report
