"""Every family's loop bodies are the scheduler graph's emission order, op by op, and the MMA
instruction the templates spell is the graph's; templates do no size arithmetic."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiledsl.schedule.ops import OpKind
from tiledsl.families import lower
from tiledsl.schedule.passes import emission_order, run_passes
from tiledsl.spec import Mma

from .test_codegen import generable_specs

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
# Graph ops whose CUDA a neighbouring step spells (V's load goes with K's; O's rescale is inside
# the online softmax): they lower to no step of their own.
COVERED = {OpKind.LOAD_V, OpKind.RESCALE_O, OpKind.LOOP}


@pytest.mark.parametrize("spec", generable_specs(), ids=lambda s: s.kernel_name)
def test_plan_loop_bodies_are_the_graphs_emission_order(spec):
    plan = lower(spec)
    graph = run_passes(spec, check_legality=False)
    order = emission_order(graph)
    for loop, body in plan.loop_bodies:
        children = [n for n in order if graph.op(n).loops and graph.op(n).loops[-1] == loop]
        lowered = [op.node for op in body]
        if spec.family.value == "hopper":   # the template spells the producer's loop; every consumer op is a step
            consumer = [n for n in children if graph.op(n).role.value == "consumer"]
            assert lowered == consumer
            # the trips peeled by lag: tile 0's lag-0 ops in order; past the last tile, the lagging ops
            assert [op.node for op in plan.prologue] == [n for n in consumer if plan.prologue and graph.op(n).lag == 0]
            assert {op.node for op in plan.epilogue} <= {n for n in consumer if graph.op(n).lag or graph.op(n).barrier == "turn"}
            assert bool(plan.prologue) == bool(plan.epilogue) == spec.schedule.intra_overlap
            continue
        # each step comes from an op of this loop, the steps follow the emission order, and every
        # op of the loop that is not covered by a neighbour has a step
        assert set(lowered) <= set(children)
        assert [children.index(n) for n in lowered] == sorted(children.index(n) for n in lowered)
        loads = [n for n in children if graph.op(n).kind is OpKind.LOAD_K]
        expected = {n for n in children if graph.op(n).kind not in COVERED | {OpKind.LOAD_K}}
        assert expected <= set(lowered), f"{loop}: ops without a CUDA step: {expected - set(lowered)}"
        assert set(lowered) - expected <= set(loads)   # K's load: where the one-stage pipeline issues it
        math = [op.kind for op in body if op.kind in ("mma_qk", "mask", "online_softmax", "mma_pv")]
        assert math in ([], ["mma_qk", "mask", "online_softmax", "mma_pv"])


@pytest.mark.parametrize("spec", generable_specs(), ids=lambda s: s.kernel_name)
def test_the_mma_instruction_comes_from_the_graph(spec):
    plan = lower(spec)
    graph = run_passes(spec, check_legality=False)
    qk, pv = graph.op("mma_qk"), graph.op("mma_pv")
    assert plan.mma == qk.mma == pv.mma == (Mma.WGMMA.value if spec.schedule.mma is Mma.WGMMA else Mma.SYNC.value)
    if plan.mma == "wgmma":
        assert (plan.wgmma_qk.n, plan.wgmma_pv.n) == (qk.mma_shape[1], pv.mma_shape[1]) == \
            (spec.schedule.tile_kv, spec.problem.head_dim_v)
        assert plan.wgmma_qk.after == (qk.mma_shape[1] // 2, qk.mma_shape[1] // 2 + 1, qk.mma_shape[1] // 2 + 2)
    else:
        assert qk.mma_shape == (16, 8, 16) and plan.wgmma_qk is None


def test_templates_do_no_size_arithmetic_or_string_building():
    for path in sorted(TEMPLATES.glob("*.j2")):
        text = re.sub(r"{% raw %}.*?{% endraw %}", "", path.read_text(), flags=re.S)
        for expr in re.findall(r"{{(.*?)}}|{%(.*?)%}", text):
            code = "".join(expr)
            assert "//" not in code, f"{path.name}: integer division in {code.strip()!r}"
            assert not re.search(r"[-+*]\s*\d+\s*$", code.strip()), f"{path.name}: size arithmetic in {code.strip()!r}"
        assert "wgmma_n_qk > 0" not in text and "% op.distance" not in text, path.name
