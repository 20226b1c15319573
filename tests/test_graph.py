"""The scheduler graph: FA1, FA2, Hopper and split-KV decode are different graphs, not flags."""
from __future__ import annotations

import dataclasses

import networkx as nx
import pytest

from tiledsl.schedule.ops import EdgeKind, GraphError, Op, OpKind, Role, Space
from tiledsl.schedule.graph import ScheduleGraph, build_graph
from tiledsl.schedule.passes import emission_order
from tiledsl.spec import AUTO, Axis, CopyVia, KernelSpec, LoopOrder, Mask, Problem, Schedule


def fa1(**kw):
    return KernelSpec("fa1", Problem(64, 64), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, tile_kv=64, **kw))


def fa2(mask=Mask.NONE, **kw):
    return KernelSpec("fa2", Problem(128, 128, mask=mask), Schedule(tile_q=128, tile_kv=64, **kw))


def hopper():
    return KernelSpec("fa3", Problem(128, 128), Schedule(tile_q=128, tile_kv=128, producer_warpgroups=1, producer_regs=24,
                                                         consumer_warpgroups=2, consumer_regs=240, copy=CopyVia.TMA))


def decode(split=AUTO):
    return KernelSpec("dec", Problem(128, 128, queries_per_seq=1),
                      Schedule(tile_q=16, tile_kv=128, warps=4, warp_axis=Axis.KV, split_kv=split))


ALL = [fa1(), fa1(warps=4, warp_axis=Axis.KV), fa2(), fa2(Mask.CAUSAL), hopper(), decode(), decode(1), decode(8)]


def loops_of(g: ScheduleGraph, kind: OpKind) -> tuple[str, ...]:
    (name,) = g.names(kind)
    return g.loop_vars(name)


def test_fa1_and_fa2_have_different_loop_nests():
    g1, g2 = build_graph(fa1()), build_graph(fa2())
    # FA1: kv outer, q inner; Q and the O/m/l state are moved at every (kv, q) step
    assert loops_of(g1, OpKind.LOAD_Q) == ("kv", "q")
    assert loops_of(g1, OpKind.LOAD_K) == ("kv",)
    # (inside the row passes of the q tile, as the kernel runs them)
    assert loops_of(g1, OpKind.LOAD_O_STATE) == ("kv", "q", "rows")
    assert loops_of(g1, OpKind.STORE_O_STATE) == ("kv", "q", "rows")
    assert not g1.has(OpKind.NORMALIZE_O) and not g1.has(OpKind.STORE_O)
    # O is kept normalised between kv steps: in HBM, not on chip
    assert g1.op("store_o_state").variant == "normalized" and g1.op("rescale_o").variant == "unnormalized"
    assert g1.op("loop_kv").init_space is Space.HBM
    # FA2: q outer, kv inner; O stays on chip and is divided by l once, after the kv loop
    assert loops_of(g2, OpKind.LOAD_Q) == ("q",)
    assert loops_of(g2, OpKind.LOAD_K) == ("q", "kv")
    assert loops_of(g2, OpKind.NORMALIZE_O) == ("q",)
    assert loops_of(g2, OpKind.STORE_LSE) == ("q",)
    assert not g2.has(OpKind.LOAD_O_STATE) and not g2.has(OpKind.STORE_O_STATE)
    assert g2.op("rescale_o").variant == "unnormalized"
    assert g2.op("loop_kv").init_space is Space.REGISTERS
    assert g2.op("loop_q").grid and not g1.op("loop_q").grid
    # the running state of FA2 is carried across kv trips, outside the DAG
    assert {(c.src, c.value) for c in g2.carried} == {("online_softmax", "m, l"), ("rescale_o", "O")}


@pytest.mark.parametrize("spec", ALL, ids=lambda s: s.kernel_name)
def test_every_graph_is_a_dag_with_known_loops(spec):
    g = build_graph(spec)
    assert nx.is_directed_acyclic_graph(g.dag)
    assert "graph" in g.facts
    for name in g.names():
        op = g.op(name)
        assert isinstance(op, Op) and isinstance(op.kind, OpKind)
        for loop in op.loops:
            assert g.op(loop).kind is OpKind.LOOP
        if op.kind is OpKind.LOOP:
            assert op.var in ("q", "kv", "split", "rows")
    for _, _, data in g.edges():
        assert data["kind"] in (EdgeKind.DATA, EdgeKind.SYNC)
    # an op's enclosing loops are themselves nested in that order
    for name in g.names():
        loops = g.op(name).loops
        for outer, inner in zip(loops, loops[1:]):
            assert g.op(inner).loops[-1] == outer


def test_ops_are_frozen_plain_data():
    op = build_graph(fa2()).op("load_q")
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.kind = OpKind.LOAD_K
    assert op.kind == "load_q" and op.space == "shared" and op.role == "all" and op.shape == ("Br", "d")
    assert op.key == "tile" and op.hbm[0].tensor == "Q"


def test_a_name_defined_twice_is_an_error():
    g = ScheduleGraph(fa2())
    g.add("x", Op(OpKind.LOOP, var="q"))
    with pytest.raises(GraphError, match="defined twice"):
        g.add("x", Op(OpKind.LOAD_Q))
    with pytest.raises(GraphError, match="not a loop"):
        g.add("y", Op(OpKind.MMA_QK, loops=("nowhere",)))
    with pytest.raises(GraphError, match="unknown node"):
        g.connect("x", "nowhere")


def test_decode_split_has_split_loop_partials_and_a_merge_in_the_same_launch():
    g = build_graph(decode(AUTO))
    assert loops_of(g, OpKind.MERGE_SPLITS) == ("q",)
    # the last split's block merges (an atomic ticket): no second kernel
    assert [g.op(n).kernel for n in g.names(OpKind.LOOP) if g.op(n).kernel] == ["attention"]
    assert emission_order(g).index("merge_splits") > emission_order(g).index("store_o_part")
    assert g.loop_vars("store_o_part") == ("q", "split")
    assert g.op("store_o_part").hbm[0].tensor == "O_part"
    assert g.op("store_lse_part").hbm[0].tensor == "lse_part"
    assert g.dag.has_edge("store_o_part", "merge_splits") and g.dag.has_edge("merge_splits", "store_o")
    assert {a.times for a in g.op("merge_splits").hbm} == {"splits"}
    assert g.loop_vars("mma_qk") == ("q", "split", "kv")
    # warps along kv: each warp keeps a running state over its own key slices, and loads and waits
    # for only that slice; the warps are merged on chip once, after the kv loop
    assert g.has(OpKind.COMBINE_WARPS) and g.op("online_softmax").variant == "running"
    assert g.loop_vars("combine_warps") == ("q", "split")
    assert {g.op(n).scope for n in ("load_k", "load_v", "wait_k", "wait_v")} == {"warp"}
    assert build_graph(fa1(warps=4, warp_axis=Axis.KV)).op("load_k").scope == "block"


def test_decode_without_split_has_no_merge():
    g = build_graph(decode(1))
    assert not g.has(OpKind.MERGE_SPLITS)
    assert "loop_split" not in g and g.op("store_o").hbm[0].tensor == "O"


def test_split_k_warps_add_a_combine_and_split_q_does_not():
    assert build_graph(fa1(warps=4, warp_axis=Axis.KV)).has(OpKind.COMBINE_WARPS)
    assert not build_graph(fa1(warps=4, warp_axis=Axis.Q)).has(OpKind.COMBINE_WARPS)
    assert not build_graph(fa2()).has(OpKind.COMBINE_WARPS)


def test_hopper_producer_and_consumer_meet_at_barriers():
    g = build_graph(hopper())
    for load in ("load_q", "load_k", "load_v"):
        assert g.op(load).role is Role.PRODUCER and g.op(load).via == "tma"
    for math in ("mma_qk", "online_softmax", "mma_pv", "rescale_o", "store_o"):
        assert g.op(math).role is Role.CONSUMER
    syncs = {(u, v) for u, v, _ in g.edges(EdgeKind.SYNC)}
    for t in ("q", "k", "v"):
        assert (f"arrive_{t}_full", f"wait_{t}_full") in syncs
        assert g.op(f"arrive_{t}_full").role is Role.PRODUCER and g.op(f"wait_{t}_full").role is Role.CONSUMER
    assert ("wait_k_full", "mma_qk") in syncs and ("wait_v_full", "mma_pv") in syncs
    # the consumer frees each slot for the producer's next trip: loop-carried, not a DAG edge
    released = {(c.src, c.dst) for c in g.carried if c.kind is EdgeKind.SYNC}
    assert released == {("arrive_k_empty", "wait_k_empty"), ("arrive_v_empty", "wait_v_empty"),
                        ("arrive_q_empty", "wait_q_empty"), ("wait_pv", "pack_p")}
    assert not build_graph(fa2()).has(OpKind.ARRIVE)


def test_graph_is_a_function_of_the_spec():
    a, b = build_graph(fa2(Mask.CAUSAL)), build_graph(fa2(Mask.CAUSAL))
    assert [(n, a.op(n)) for n in a.names()] == [(n, b.op(n)) for n in b.names()]
    assert sorted(a.dag.edges) == sorted(b.dag.edges)
    assert a.op("mask").variant == "causal"
