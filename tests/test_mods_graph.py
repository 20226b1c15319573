"""The modifications in the scheduler graphs: score_mod between Q K^T and the mask, dropout between the
softmax and P V, sinks in the kv loop's starting state, the backward's chain rule, dropout and sink
gradient; none of them in a graph whose spec modifies nothing. And what explain says about them."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.cli.report import explain
from tiledsl.frontend.parse import load_spec
from tiledsl.schedule.backward import build_backward_graph
from tiledsl.schedule.ops import OpKind
from tiledsl.schedule.passes import emission_order, run_passes

SCHEDULES = {
    "fa2": "schedule {\n    }",
    "fa1": "schedule {\n        order kv, q\n    }",
    "decode": "schedule {\n        split kv = 4\n    }\n    queries = 1",
    "hopper": "schedule {\n        warpgroups producer 1, consumer 2\n    }",
    "hopper intra": "schedule {\n        warpgroups producer 1, consumer 2\n        overlap intra, pingpong\n    }",
}
HOPPER_128 = "schedule {\n        warpgroups producer 1, consumer 2\n        tile q = 128, kv = 128\n    }"


def spec(lines, family="fa2", backward=False):
    body = "".join(f"    {line}\n" for line in lines)
    bwd = "    backward {\n    }\n" if backward else ""
    schedule = SCHEDULES.get(family, HOPPER_128)
    return load_spec(f"attention t {{\n    head_dim = 64\n{body}    {schedule}\n{bwd}}}\n")


MODS = ["softcap = 30", "sinks = per_head", "dropout = 0.1", "mask = causal & document"]
NEW_KINDS = {OpKind.SCORE_MOD, OpKind.DROPOUT, OpKind.SCORE_MOD_GRAD, OpKind.SINK_GRAD}


@pytest.mark.parametrize("family", list(SCHEDULES))
def test_the_modifications_sit_between_their_neighbours(family):
    g = run_passes(spec(MODS, family), check_legality=False)
    order = emission_order(g)
    assert order.index("mma_qk") < order.index("score_mod") < order.index("mask")
    assert g.dag.has_edge("score_mod", "mask") and g.dag.has_edge("online_softmax", "dropout")
    following = "pack_p" if family.startswith("hopper") else "mma_pv"
    assert g.dag.has_edge("dropout", following) or any(c.src == "dropout" and c.dst == following for c in g.carried)
    assert ("m", "sink_h") in g.op("loop_kv").init   # FA1: the HBM state's, before the kernel


@pytest.mark.parametrize("family", list(SCHEDULES))
def test_a_spec_without_modifications_has_none_of_their_ops(family):
    g = run_passes(spec(["mask = causal"], family), check_legality=False)
    assert not any(g.op(n).kind in NEW_KINDS for n in g.names())
    assert ("m", "-inf") in g.op("loop_kv").init


def test_the_backward_graph_has_the_chain_rule_dropout_and_the_sink_gradient():
    g = build_backward_graph(spec(MODS, backward=True))
    kinds = {g.op(n).kind for n in g.names()}
    assert NEW_KINDS <= kinds
    assert g.dag.has_edge("softmax_grad", "score_mod_grad") and g.dag.has_edge("score_mod_grad", "mma_dk")
    assert g.dag.has_edge("dropout", "mma_dv") and g.dag.has_edge("sink_load_lse_d", "sink_grad")
    assert g.op("sink_loop_q").kernel == "sink_grad"   # its own kernel after the preprocess: a fixed-order sum


def test_a_bias_needs_no_chain_rule():
    g = build_backward_graph(spec(["score_mod = score + bias[h, kv_idx]"], backward=True))
    assert "score_mod" in g and "score_mod_grad" not in g


def test_explain_shows_the_modifications_their_aux_and_the_tile_classes():
    text = explain(spec(["mask_mod = kv_idx <= q_idx & q_idx - kv_idx < 300 | kv_idx < 64", "softcap = 20",
                         "score_mod = score + bias[h, kv_idx]"], "hopper 128"), seqlen_q=2048, heads=2)
    assert "S = 20 * tanh(S / 20); S = score + bias[h, kv_idx]" in text
    assert "aux bias: 2-d float32, read by score_mod" in text
    i, j = np.arange(2048)[:, None], np.arange(2048)[None, :]
    tiles = (((j <= i) & (i - j < 300)) | (j < 64)).reshape(16, 128, 16, 128).transpose(0, 2, 1, 3).reshape(256, -1)
    full, empty = int(tiles.all(1).sum()) * 2, int((~tiles.any(1)).sum()) * 2
    assert (f"tiles (batch 1 x heads 2 x q tiles x kv tiles = 512, Br=128 Bc=128): empty {empty} "
            f"({100 * empty / 512:.1f}%), full {full} ({100 * full / 512:.1f}%), partial {512 - full - empty}") in text
    assert "generated kernel (hopper.cu.j2): hopper_d64_bf16_softcap20_smod827103eb_mmod14cd2f16_" in text
    doc = explain(spec(["mask = causal & document"]), seqlen_q=1024)
    assert "decided per tile at run time from the aux data (partial above): document" in doc


def test_the_traffic_model_skips_the_tiles_the_modifications_empty():
    from tiledsl.schedule.traffic import hbm_traffic
    from tiledsl.schedule.tiles import EMPTY, Tiling, classify
    windowed = spec(["mask_mod = kv_idx <= q_idx & q_idx - kv_idx < 1024"], "hopper 128")
    plain = spec(["mask = causal"], "hopper 128")
    n = 8192
    t_mod = hbm_traffic(run_passes(windowed), 1, 4, n, n)
    t_plain = hbm_traffic(run_passes(plain), 1, 4, n, n)
    computed = int((classify(windowed.problem, Tiling(n, n, 128, 128), 1, 1) != EMPTY).sum())
    assert t_mod.flops_executed == 2 * 128 * 128 * 128 * computed * 4
    assert t_mod.bytes < t_plain.bytes / 3
    per_head = spec(["mask_mod = kv_idx <= q_idx & (h == 0 | kv_idx < 128)"], "hopper 128")
    t_head = hbm_traffic(run_passes(per_head), 1, 4, n, n)
    assert t_plain.flops_executed / 4 < t_head.flops_executed < t_plain.flops_executed / 2
