"""Passes: dependency order, promises kept, budgets, legality refusals at the DSL line."""
from __future__ import annotations

import itertools

import networkx as nx
import pytest

from tiledsl.device_limits import H200
from tiledsl.errors import SpecError
from tiledsl.schedule.ops import OpKind
from tiledsl.schedule.graph import build_graph
from tiledsl.schedule.passes import (DEFAULT_PASSES, EmissionOrder, Pass, PassError, PassManager, ShapeInference,
    emission_order, run_passes)
from tiledsl.spec import AUTO, Axis, CopyVia, DType, KernelSpec, LoopOrder, Mask, Problem, Schedule, Span

TEXT = """attention k {
    head_dim = 256
    schedule {
        tile     q = 256, kv = 256
        warps    4 along q
        pipeline 3 stages via cp.async
    }
}
"""


def spanned(problem: Problem, schedule: Schedule) -> KernelSpec:
    """A spec whose settings point at lines of TEXT (head_dim 2, tile 4, warps 5, pipeline 6)."""
    spans = tuple((key, Span("k.tile", line, 9, line, 30)) for key, line in
                  (("head_dim", 2), ("tile", 4), ("warps", 5), ("pipeline", 6)))
    return KernelSpec("k", problem, schedule, source_file="k.tile", source_text=TEXT, spans=spans,
                      span=Span("k.tile", 1, 1, 8, 2))


SPECS = [
    KernelSpec("fa2", Problem(128, 128, mask=Mask.CAUSAL), Schedule(tile_q=128, tile_kv=64, warps=4)),
    KernelSpec("fa1", Problem(64, 64), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, tile_kv=128, warp_axis=Axis.KV)),
    KernelSpec("fa3", Problem(128, 128), Schedule(tile_q=128, tile_kv=128, producer_warpgroups=1, producer_regs=24,
                                                  consumer_warpgroups=2, consumer_regs=240, copy=CopyVia.TMA)),
    KernelSpec("dec", Problem(128, 128, queries_per_seq=1), Schedule(tile_q=16, tile_kv=128, warp_axis=Axis.KV,
                                                                     split_kv=AUTO)),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_pass_manager_orders_by_facts_not_by_list_order(spec):
    want = run_passes(spec)
    for passes in itertools.permutations(DEFAULT_PASSES):
        order = [p.name for p in PassManager(passes).schedule({"graph"})]
        position = {name: i for i, name in enumerate(order)}
        assert position["shape_inference"] < position["pipelining"] < position["legality"]
        assert position["shape_inference"] < position["warp_roles"] < position["legality"]
        g = PassManager(passes).run(build_graph(spec))
        assert g.facts >= {"graph", "shapes", "stages", "roles", "legal", "order"}
        assert (g.sizes, g.layout, g.order) == (want.sizes, want.layout, want.order)


def test_missing_provider_and_broken_promise_are_compiler_errors():
    class NeedsMagic(Pass):
        name = "needs_magic"
        requires = frozenset({"magic"})

    with pytest.raises(PassError, match="magic"):
        PassManager([ShapeInference, NeedsMagic]).run(build_graph(SPECS[0]))

    class Liar(EmissionOrder):
        def run(self, graph, limits):
            graph.order = tuple(reversed(emission_order(graph)))

    with pytest.raises(PassError, match="broke its promise"):
        PassManager([Liar]).run(build_graph(SPECS[0]))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_passes_annotate_every_op(spec):
    g = run_passes(spec)
    assert g.sizes["Br"] == spec.schedule.tile_q and g.sizes["Bc"] == spec.schedule.tile_kv
    for name in g.names():
        op = g.op(name)
        if op.shape:
            assert len(op.sizes) == len(op.shape) and op.bytes > 0
    for load in ("load_k", "load_v"):
        assert g.op(load).stages == spec.schedule.stages and g.op(load).buffer == f"j % {spec.schedule.stages}"
    assert g.layout.smem_bytes == max(b.offset + b.bytes for b in g.layout.buffers) <= H200.max_shared_per_block
    assert g.layout.accumulator_registers <= g.layout.register_limit


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_emission_order_is_topological_deterministic_and_keeps_loops_contiguous(spec):
    g = run_passes(spec)
    order = emission_order(g)
    assert order == emission_order(run_passes(spec)) == list(g.order)
    pos = {n: i for i, n in enumerate(order)}
    assert sorted(order) == sorted(g.dag.nodes)
    assert all(pos[u] < pos[v] for u, v in g.dag.edges)
    for loop in g.names(OpKind.LOOP):
        body = sorted(pos[n] for n in g.names() if loop in g.op(n).loops)
        assert body == list(range(pos[loop] + 1, pos[loop] + 1 + len(body)))
    # ties are broken by insertion order, as lexicographical_topological_sort would on the flat DAG
    # whenever the flat sort already keeps loops contiguous (FA2 without extra loops does)
    if spec.name == "fa2":
        assert order == list(nx.lexicographical_topological_sort(g.dag, key=g.seq))


def test_shared_memory_refusal_names_bytes_needed_and_available_at_the_tile_line():
    spec = spanned(Problem(256, 256), Schedule(tile_q=256, tile_kv=256, warps=4, stages=3))
    with pytest.raises(SpecError) as err:
        run_passes(spec)
    e = err.value
    assert e.span.line == 4                                           # the `tile` line
    assert "917504 bytes needed" in e.message and "232448 available on sm_90" in e.message
    assert "Q 131072 + K 3x131072 + V 3x131072" in e.message
    assert "tile     q = 256" in e.render()


def test_too_many_stages_points_at_the_pipeline_line():
    spec = spanned(Problem(128, 128), Schedule(tile_q=128, tile_kv=128, warps=8, stages=5))
    with pytest.raises(SpecError) as err:
        run_passes(spec)
    assert err.value.span.line == 6 and "at most 3 stages fit" in err.value.hint
    needed = 128 * 128 * 2 * (1 + 2 * 5)
    assert f"{needed} bytes needed" in err.value.message


def test_register_refusal():
    spec = spanned(Problem(128, 128), Schedule(tile_q=128, tile_kv=128, warps=4, stages=1))
    with pytest.raises(SpecError, match=r"registers: ~296 per thread .* > 255"):
        run_passes(spec)


@pytest.mark.parametrize("problem, schedule, line, text", [
    (Problem(72, 72), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, tile_kv=64), 2, "head dim"),   # fa2 pads 72 on chip; fa1 does not
    (Problem(36, 36), Schedule(tile_q=64, tile_kv=64), 2, "head dim"),
    (Problem(64, 64), Schedule(tile_q=64, tile_kv=64, warps=8), 5, "rows each"),
    (Problem(64, 64), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, tile_kv=32, warps=4, warp_axis=Axis.KV), 5,
     "not a multiple of 16"),
    (Problem(64, 64), Schedule(tile_q=64, tile_kv=40), 4, "not a multiple of 16"),
])
def test_mma_divisibility(problem, schedule, line, text):
    with pytest.raises(SpecError, match=text) as err:
        run_passes(spanned(problem, schedule))
    assert err.value.span.line == line


def test_tf32_steps_by_8_and_hopper_needs_64_rows_per_consumer():
    run_passes(KernelSpec("f", Problem(40, 40, dtype=DType.FP32), Schedule(tile_q=64, tile_kv=24, warps=4)))
    with pytest.raises(SpecError, match="64 rows per consumer"):
        run_passes(KernelSpec("h", Problem(128, 128), Schedule(tile_q=64, tile_kv=128, producer_warpgroups=1,
                                                               consumer_warpgroups=2, copy=CopyVia.TMA)))


def test_roles_and_threads():
    g = run_passes(SPECS[2])
    assert g.roles["producer"] == {"warpgroups": 1, "threads": 128, "registers": 24}
    assert g.roles["consumer"]["threads"] == 256 and g.sizes["threads"] == 384
    assert g.layout.register_limit == 240
    assert run_passes(SPECS[0]).roles["all"]["threads"] == 128


def test_legality_can_be_left_out_for_the_reference():
    spec = KernelSpec("t", Problem(8, 8), Schedule(tile_q=3, tile_kv=5))
    with pytest.raises(SpecError):
        run_passes(spec)
    g = run_passes(spec, check_legality=False)
    assert "legal" not in g.facts and g.order is not None


def test_fa1_split_kv_is_refused():
    with pytest.raises(SpecError, match="split kv needs the q-outer order"):
        run_passes(KernelSpec("x", Problem(64, 64), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, split_kv=4)))
