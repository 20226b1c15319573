"""The Hopper family's barriers and consumer loop as graph ops: every wait has its arrive, each full
barrier's transaction bytes are the bytes its tile loads bring (shape inference vs the layout), the
consumer's loop order and lags, and what explain shows of roles and barriers."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiledsl.cli.report import explain, to_dot
from tiledsl.schedule.ops import EdgeKind, OpKind, Role
from tiledsl.families import layout_of
from tiledsl.frontend.parse import load_specs
from tiledsl.schedule.passes import run_passes

from .test_hopper_cpu import SWITCHES, spec_for

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = sorted(ROOT.glob("specs/hopper_*.tile"))


def specs():
    return [load_specs(str(p))[0] for p in BUNDLED] + [spec_for(c, s, p, i) for c, s, p, i in SWITCHES]


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.kernel_name)
def test_barriers_balance_and_full_barriers_carry_the_bytes_of_their_loads(spec):
    g = run_passes(spec)
    fp8 = spec.problem.fp8
    sync_ops = [n for n in g.names() if g.op(n).kind in (OpKind.ARRIVE, OpKind.WAIT)]
    arrives = {g.op(n).barrier for n in sync_ops if g.op(n).kind is OpKind.ARRIVE}
    waits = {g.op(n).barrier for n in sync_ops if g.op(n).kind is OpKind.WAIT}
    assert arrives == waits == set(g.barriers)
    assert ("turn" in g.barriers) == spec.schedule.pingpong
    lay = layout_of(spec)
    expected = {"q_full": lay.buffer("Q").bytes, "k_full": lay.buffer("K").stage_bytes, "v_full": lay.buffer("V").stage_bytes}
    for name, nbytes in expected.items():
        bar = g.barriers[name]
        (arrive,) = bar.arrive
        loads = [u for u, v, d in g.edges(EdgeKind.SYNC) if v == arrive and g.op(u).kind.value.startswith("load")]
        assert bar.tx_bytes == g.op(arrive).tx_bytes == nbytes == sum(g.op(n).bytes for n in loads) > 0, name
        # FP8: V lands for the producer's transposing warps, which write V^T for the consumers
        waiter = "transposer" if fp8 and name == "v_full" else "consumer"
        assert (bar.count, bar.arrive_role, bar.wait_role) == (1, "producer", waiter)
    for name in ("q_empty", "k_empty", "v_empty"):   # one arrival per consumer warp
        assert g.barriers[name].count == 4 * spec.schedule.consumer_warpgroups
        waiter = "transposer" if fp8 and name == "v_empty" else "producer"   # FP8: V^T's slot
        assert (g.barriers[name].arrive_role, g.barriers[name].wait_role) == ("consumer", waiter)
    if fp8:   # every transposing thread arrives; the consumers' P V and the producer's next V copy wait
        vt = g.barriers["vt_full"]
        assert (vt.count, vt.tx_bytes, vt.arrive_role, vt.wait_role) == (96, 0, "transposer", "consumer/producer")
        assert g.barriers["v_full"].stages == lay.buffer("V").stages and vt.stages == spec.schedule.stages


@pytest.mark.parametrize("consumers,stages,pingpong,intra", SWITCHES)
def test_consumer_loop_order_and_lags(consumers, stages, pingpong, intra):
    g = run_passes(spec_for(consumers, stages, pingpong, intra))
    body = [n for n in g.order if g.op(n).loops[-1:] == ("loop_kv",) and g.op(n).role is Role.CONSUMER]
    lag = {n: g.op(n).lag for n in body}
    if not intra:
        assert set(lag.values()) == {0} and body.index("wait_s") < body.index("mma_pv") < body.index("wait_pv")
        assert g.op("wait_s").pending == 0
        return
    # tile j's Q K^T, then tile j-1's P V; S is waited for with P V in flight; P V's wait tops the next trip
    assert body.index("mma_qk") < body.index("mma_pv") < body.index("wait_s") < body.index("online_softmax")
    assert body[0] == "wait_pv" and g.op("wait_s").pending == 1
    assert (lag["mma_qk"], lag["mma_pv"], lag["pack_p"], lag["rescale_o"], lag["wait_pv"], lag["arrive_v_empty"]) == (0, 1, 1, 1, 2, 2)
    # the P and alpha of tile j-1 reach this trip's ops as loop-carried values, not DAG edges
    carried = {(c.src, c.dst) for c in g.carried}
    assert {("online_softmax", "pack_p"), ("online_softmax", "rescale_o")} <= carried
    assert not g.dag.has_edge("online_softmax", "pack_p") and g.dag.has_edge("mma_qk", "mma_pv")


def test_explain_shows_roles_register_budgets_and_barriers():
    spec = load_specs(str(ROOT / "specs" / "hopper_d128_causal.tile"))[0]
    text = explain(spec)
    s = spec.schedule
    assert f"producer  1 warpgroup(s), 128 threads, setmaxnreg {s.producer_regs} registers" in text
    assert f"consumer  {s.consumer_warpgroups} warpgroup(s), {128 * s.consumer_warpgroups} threads, setmaxnreg {s.consumer_regs}" in text
    tx = layout_of(spec).buffer("K").stage_bytes
    lines = {line.split()[0]: line for line in text[text.index("barriers ("):text.index("ops in emission")].splitlines()[2:] if line.strip()}
    assert lines["k_full"].split()[1:4] == ["mbarrier", "1", str(tx)]
    assert "arrive_k_full (producer) -> wait_k_full (consumer)" in lines["k_full"]
    assert lines["turn"].split()[1:3] == ["named", "256"]
    assert "consumer (tile j-1): O += P_{j-1} V_{j-1}" in text and "(wgmma.wait_group 1)" in text
    dot = to_dot(run_passes(spec))
    assert '"turn_pass" -> "turn_wait"' in dot and '"wait_k_full" -> "mma_qk" [label="", style=dashed]' in dot
    assert f"+{tx} B tx" in dot
