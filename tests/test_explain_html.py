"""`tiledsl explain --html`: the step trace (schedule/trace.py) against the graph and the traffic model, and the
page (cli/html.py) it draws: one step per op instance, counters that end at explain's HBM traffic for every
bundled spec and family, FA1's O/m/l round trips against FA2's single pass, split-KV partials and their merge, the
backward's dQ accumulation, Hopper's overlapped wgmmas, skipped tiles, no external URL in the file, the search-space
figure, and the CLI."""
from __future__ import annotations

import html
import json
import re
from collections import Counter

import numpy as np
import pytest

from tiledsl.cli.html import step_seqlen
from tiledsl.cli.main import main
from tiledsl.frontend.parse import load_specs, parse_text
from tiledsl.schedule.backward import build_backward_graph
from tiledsl.schedule.masks import tiles_visible
from tiledsl.schedule.ops import OpKind
from tiledsl.schedule.passes import run_passes
from tiledsl.schedule.trace import backward_trace, forward_trace, small_seqlen
from tiledsl.schedule.traffic import hbm_traffic, tile_bounds, traffic_by_tensor

from .conftest import SPEC_FILES

# Families and settings no bundled spec has: paged KV (fa2 chunked prefill, decode), a fixed split, a window
# mask, an FP8 KV cache, FA1 with a causal mask, head_dim_v != head_dim, fp32 (the graph model's layout), and
# the backward's other dQ strategies.
VARIANTS = """
attention paged_prefill {
    head_dim = 64
    mask     = window(left = 100, right = 0)
    kv_cache = paged(page = 16)
    schedule {
        tile     q = 64, kv = 64
        warps    4 along q
    }
}
attention paged_decode {
    head_dim = 128
    queries  = 4
    mask     = causal
    kv_cache = paged(page = 16)
    schedule {
        tile     q = 16, kv = 64
        warps    4 along kv
        split    kv = 2
    }
}
attention fp8_decode {
    head_dim = 128
    queries  = 1
    kv_dtype = e4m3
    schedule {
        tile     q = 16, kv = 128
        warps    4 along kv
        pipeline 1 stages via cp.async
        split    kv = auto
    }
}
attention fa1_causal_splitk {
    head_dim = 64
    mask     = causal
    schedule {
        order    kv, q
        tile     q = 64, kv = 128
        warps    4 along kv
    }
}
attention fa1_window {
    head_dim = 64
    mask     = window(left = 40, right = 8)
    schedule {
        order    kv, q
        tile     q = 64, kv = 64
        warps    4 along q
    }
}
attention fa2_dv {
    head_dim   = 128
    head_dim_v = 64
    mask       = window(left = 64, right = 16)
    schedule {
        tile     q = 64, kv = 64
        warps    4 along q
    }
}
attention backward_separate {
    head_dim = 64
    mask     = causal
    schedule {
        tile     q = 128, kv = 64
    }
    backward {
        order    kv, q
        tile     q = 64, kv = 128
        warps    8
        dq accumulate separate
    }
}
attention backward_q_outer {
    head_dim = 64
    schedule {
        tile     q = 128, kv = 64
    }
    backward {
        order    q, kv
        tile     q = 64, kv = 64
        warps    4
    }
}
"""


def all_specs():
    specs = [spec for path in SPEC_FILES for spec in load_specs(path)]
    # fp32 has no template (check refuses it at `dtype`): a spec built in Python still gets the graph model
    from tiledsl.spec import DType, KernelSpec, Problem, Schedule
    fp32 = KernelSpec("fp32_model", Problem(64, 64, DType.FP32), Schedule(tile_q=64, tile_kv=64, warps=4))
    return specs + parse_text(VARIANTS, filename="variants.tile") + [fp32]


SPECS = {spec.kernel_name: spec for spec in all_specs()}


def shape_of(spec, seqlen):
    return (spec.problem.queries_per_seq or seqlen), seqlen


def traces(spec, seqlen, seqlen_q=None):
    """(graph, trace) of the forward and, when the spec has one, the backward (`seqlen_q`: fewer queries than
    keys, where early kv tiles can lie outside every query's window)."""
    graph = run_passes(spec)
    nq, nk = shape_of(spec, seqlen)
    nq = seqlen_q if seqlen_q and spec.problem.queries_per_seq is None else nq
    out = [(graph, forward_trace(graph, nq, nk))]
    if spec.backward is not None:
        out.append((build_backward_graph(spec), backward_trace(spec, nq, seqlen)))
    return out


def expected_instances(graph, trace, rows_per_pass):
    """Op instances counted from trip counts, apart from the walk: a (q, kv) op runs once per visible pair (per row
    pass inside FA1's pass loop), a kv-only op once per kv tile some query sees, a q op once per q tile (per split)."""
    p = graph.spec.problem
    q0, q1 = tile_bounds(trace.seqlen_q, trace.tile_q)
    k0, k1 = tile_bounds(trace.seqlen_kv, trace.tile_kv)
    seen = tiles_visible(q0, q1, k0, k1, trace.seqlen_q, trace.seqlen_kv, p.mask, p.window_left, p.window_right)
    counts = {}
    for name in graph.names():
        op = graph.op(name)
        if op.kind is OpKind.LOOP:
            continue
        loops = {graph.op(loop).var for loop in op.loops}
        if {"q", "kv"} <= loops:
            n = int(seen.sum()) * (-(-trace.tile_q // rows_per_pass) if "rows" in loops else 1)
        elif loops == {"kv"}:
            n = int(seen.any(axis=0).sum())
        else:
            assert loops <= {"q", "split"}, (name, loops)
            n = len(q0) * (trace.splits if "split" in loops else 1)
        counts[name] = n
    return counts


@pytest.mark.parametrize("name", sorted(SPECS))
def test_one_step_per_op_instance_and_counters_at_the_traffic_model(name):
    spec = SPECS[name]
    seqlen = small_seqlen([spec.schedule.tile_q, spec.schedule.tile_kv])
    check_trace(spec, seqlen)
    if spec.problem.mask.value != "none" or spec.name.startswith("fa1"):   # fewer queries than keys: a chunk
        check_trace(spec, seqlen + 13, seqlen_q=seqlen // 3)


def test_kv_tiles_outside_every_window_are_skipped_by_the_kv_outer_loop():
    spec = next(s for s in SPECS.values() if s.name == "fa1_window")
    trace = check_trace(spec, 330, seqlen_q=100)[0]
    # the first query (diagonal at key 230) sees keys 190..238: kv tiles 0 and 1 (keys 0..127) no query sees
    assert [skip.at for skip in trace.skips if len(skip.at) == 1] == [(("kv", j),) for j in range(2)]
    assert not [s for s in trace.steps if dict(s.at)["kv"] < 2]


def check_trace(spec, seqlen, seqlen_q=None):
    found = []
    for graph, trace in traces(spec, seqlen, seqlen_q):
        rows = graph.layout.rows_per_warp if graph.spec.family.value == "fa1" and graph.sizes.get(
            "kv_groups", 1) > 1 else trace.tile_q
        assert Counter(s.op for s in trace.steps) == Counter(expected_instances(graph, trace, rows)), trace.direction
        model = hbm_traffic(graph, 1, 1, trace.seqlen_q, trace.seqlen_kv)
        assert (trace.read_bytes, trace.write_bytes) == (model.read_bytes, model.write_bytes), trace.direction
        moved = Counter()
        for s in trace.steps:
            for x in s.transfers:
                moved[(x.tensor, x.mode)] += x.bytes
        assert dict(moved) == {k: v for k, v in traffic_by_tensor(model).items() if v}, trace.direction
        fetched = np.cumsum([sum(x.bytes for x in s.transfers if x.mode == "read") for s in trace.steps])
        assert [s.fetched for s in trace.steps] == fetched.tolist()
        found.append(trace)
    return found


def page(tmp_path, *spec_text_or_paths, args=()):
    paths = []
    for n, item in enumerate(spec_text_or_paths):
        if isinstance(item, str) and "attention" in item:
            path = tmp_path / f"spec{n}.tile"
            path.write_text(item)
            item = path
        paths.append(str(item))
    out = tmp_path / "page.html"
    assert main(["explain", *paths, "--html", str(out), *args]) == 0
    return out.read_text()


def figures(text):
    """id -> (the figure's step data, its <li data-k> items) for every kernel figure of a page."""
    out = {}
    for fid, body in re.findall(r'<section class="figure[^"]*" id="([^"]+)" data-kind="kernel".*?>(.*?)</section>',
                                text, re.S):
        data = json.loads(re.search(r'<script type="application/json" class="data">(.*?)</script>', body,
                                    re.S).group(1))
        out[fid] = (data, re.findall(r'<li data-k="(\d+)">', body))
    return out


def replay(data, upto=None):
    """Element id -> [class, text] after the page has applied steps 0..upto (as its script does)."""
    state = {k: list(v) for k, v in data["base"].items()}
    for step in data["steps"][: None if upto is None else upto + 1]:
        state.update(step["set"])
    return state


@pytest.mark.parametrize("path", [p for p in SPEC_FILES if "space" not in p.name], ids=lambda p: p.stem)
def test_the_page_holds_every_step_and_its_counters_end_at_the_model(tmp_path, path):
    text = page(tmp_path, path)
    found = figures(text)
    specs = load_specs(path)
    seqlen = step_seqlen(specs, None)
    expected = [t for spec in specs for _, t in traces(spec, seqlen)]
    assert len(found) == len(expected)
    for (fid, (data, items)), trace in zip(found.items(), expected):
        assert len(data["steps"]) == len(items) == len(trace.steps)
        assert [int(k) for k in items] == list(range(len(trace.steps)))
        end = replay(data)
        assert end[f"{fid}-fetched"][1] == f"fetched from HBM: {trace.read_bytes:,} B"
        assert end[f"{fid}-stored"][1] == f"stored to HBM: {trace.write_bytes:,} B"
        middle = len(trace.steps) // 2
        assert replay(data, middle)[f"{fid}-fetched"][1] == f"fetched from HBM: {trace.steps[middle].fetched:,} B"


def test_no_external_url_anywhere_in_the_page(tmp_path):
    text = page(tmp_path, *[p for p in SPEC_FILES if p.stem in ("fa1_d64", "hopper_d128_causal", "decode_d128",
                                                                "backward_d64")])
    assert not re.search(r"https?:|ftp:|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I)
    assert not re.search(r"<(link|img|iframe|object|embed)\b|\bsrc=|@import|url\((?!#)", text, re.I)
    assert "<script" in text and "<svg" in text   # self-contained: the script and the drawing are inline


def step_instances(trace, op):
    return [(i, s) for i, s in enumerate(trace.steps) if s.op == op]


def test_fa1_round_trips_o_m_l_per_outer_step_and_fa2_makes_one_pass(tmp_path):
    """The same shape for both (one page): FA1 reads and writes each q tile's O, m, l once per kv tile; FA2 writes
    each O tile once and reads none back."""
    fa1 = next(s for s in load_specs(SPEC_FILES[[p.stem for p in SPEC_FILES].index("fa1_d64")]) if
               s.name == "fa1_d64")
    fa2 = load_specs(SPEC_FILES[[p.stem for p in SPEC_FILES].index("fa2_d64")])[0]
    seqlen = small_seqlen([fa1.schedule.tile_q, fa1.schedule.tile_kv, fa2.schedule.tile_q, fa2.schedule.tile_kv])
    one, two = traces(fa1, seqlen)[0][1], traces(fa2, seqlen)[0][1]
    kv_tiles = len(tile_bounds(seqlen, fa1.schedule.tile_kv)[0])
    for tensor in ("O_state", "m", "l"):
        for mode in ("read", "write"):
            per_tile = Counter(x.tile for s in one.steps for x in s.transfers if (x.tensor, x.mode) == (tensor, mode))
            assert set(per_tile.values()) == {kv_tiles}, (tensor, mode)
    o_writes = Counter(x.tile for s in two.steps for x in s.transfers if x.tensor == "O" and x.mode == "write")
    assert set(o_writes.values()) == {1} and len(o_writes) == len(tile_bounds(seqlen, fa2.schedule.tile_q)[0])
    assert not [x for s in two.steps for x in s.transfers if x.tensor in ("O", "O_state") and x.mode == "read"]
    text = page(tmp_path, SPEC_FILES[[p.stem for p in SPEC_FILES].index("fa1_d64")],
                SPEC_FILES[[p.stem for p in SPEC_FILES].index("fa2_d64")])
    ends = {fid: replay(data) for fid, (data, _) in figures(text).items()}
    assert ends["f0"]["f0-c-O_state"][1].count(f"(<={kv_tiles}/tile)") == 2   # FA1: read and written per kv tile
    assert ends["f2"]["f2-c-O"][1].endswith("W 40.96 KB x3 (<=1/tile)")      # FA2: each O tile written once


def test_split_kv_partials_then_the_merge():
    spec = next(s for s in SPECS.values() if s.name == "paged_decode")
    trace = traces(spec, 320)[0][1]
    assert trace.splits == 2
    stores = [(i, x.copy) for i, s in enumerate(trace.steps) for x in s.transfers if x.tensor == "O_part"
              and x.mode == "write"]
    assert sorted(c for _, c in stores) == [0, 1]
    (merge, step), = step_instances(trace, "merge_splits")
    assert all(i < merge for i, _ in stores)
    assert sorted(x.copy for x in step.transfers if x.tensor == "O_part") == [0, 1]
    assert [x.tensor for s in trace.steps[merge:] for x in s.transfers if x.mode == "write"] == ["O", "lse"]


def test_backward_accumulates_dq_over_the_kv_tiles_then_converts_it():
    spec = next(s for s in SPECS.values() if s.name == "backward_d64")
    seqlen = 320
    trace = traces(spec, seqlen)[1][1]
    p = spec.problem
    q0, q1 = tile_bounds(seqlen, spec.backward.tile_q)
    k0, k1 = tile_bounds(seqlen, spec.backward.tile_kv)
    seen = tiles_visible(q0, q1, k0, k1, seqlen, seqlen, p.mask)
    adds = Counter(x.tile for s in trace.steps for x in s.transfers if (x.tensor, x.mode) == ("dQ_accum", "write"))
    assert adds == {i: int(seen[i].sum()) for i in range(len(q0))}
    converts = [i for i, s in enumerate(trace.steps) if any(x.tensor == "dQ_accum" and x.mode == "read"
                                                             for x in s.transfers)]
    last_add = max(i for i, s in enumerate(trace.steps) if any(x.tensor == "dQ_accum" and x.mode == "write"
                                                               for x in s.transfers))
    assert len(converts) == len(q0) and min(converts) > last_add
    assert [k.name for k in trace.kernels] == ["preprocess", "backward", "convert_dq"]


def test_hopper_intra_overlap_keeps_p_v_in_flight_over_the_next_softmax():
    spec = next(s for s in SPECS.values() if s.family.value == "hopper" and s.schedule.intra_overlap)
    trace = traces(spec, 320)[0][1]
    overlapped = 0
    for i, s in step_instances(trace, "mma_pv"):
        assert s.done is not None and trace.steps[s.done].op == "wait_pv"
        softmax = [j for j, t in step_instances(trace, "online_softmax") if i < j < s.done and t.block == s.block]
        overlapped += bool(softmax)
        tile = dict(s.at)["kv"]
        assert all(dict(trace.steps[j].at)["kv"] == tile + 1 for j in softmax)   # the next tile's softmax
    assert overlapped
    qk = [(i, s.done) for i, s in step_instances(trace, "mma_qk")]
    assert any(a < i < b for a, b in qk for i, _ in step_instances(trace, "mma_pv"))   # two wgmmas in flight


def test_tiles_no_query_sees_are_skipped_and_noted():
    spec = next(s for s in SPECS.values() if s.family.value == "fa2" and s.problem.mask.value == "causal")
    trace = traces(spec, 320)[0][1]
    skipped = {(i, j) for i, row in enumerate(trace.tile_map) for j, state in enumerate(row) if state == "skipped"}
    assert skipped and {tuple(v for _, v in skip.at) for skip in trace.skips} == skipped
    assert {dict(s.at)["q"] for s in trace.steps if s.op == "mask" and s.mask == "partial"} == set(range(
        len(trace.tile_map)))   # each q tile's diagonal tile is partly masked
    assert not [s for s in trace.steps if "kv" in dict(s.at) and (dict(s.at)["q"], dict(s.at)["kv"]) in skipped]


def test_a_search_space_draws_budgets_and_the_model_ranking(tmp_path, monkeypatch):
    from tiledsl.frontend.parse import parse_file
    from tiledsl.schedule.cost import Shape
    from tiledsl.tune.search import plan_candidates
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")   # the ranking from the plans' register estimates: no compiles
    path = next(p for p in SPEC_FILES if p.stem == "fa2_space_d64")
    text = page(tmp_path, path, args=("--seqlen", "2048"))
    space = parse_file(path)[0]
    candidates, rejected, budget = plan_candidates(space, Shape(1, 16, 2048, 2048))
    ranked = sorted((c for c in candidates if c.model_rank), key=lambda c: c.model_rank)
    section = re.search(r'id="f0" data-kind="space".*?</section>', text, re.S).group(0)
    ranks = [int(n) for n in re.findall(r">#(\d+) ", section)]
    assert ranks == list(range(1, len(ranked) + 1))
    refused = [int(n) for n in re.findall(r"refused \((\d+)\): ", section)]
    assert sum(refused) == len(rejected) and len(refused) == len({reason for _, reason in rejected})
    assert f"the model's pick is {ranked[0].name}" in html.unescape(section)
    assert f"{ranked[0].spec.name} · forward · {ranked[0].name}" in html.unescape(text)   # and it is stepped through
    assert len(figures(text)) == 1


def test_cli_says_where_the_page_is_and_refuses_a_folder(tmp_path, capsys):
    spec = next(p for p in SPEC_FILES if p.stem == "fa2_d64")
    out = tmp_path / "fa2.html"
    assert main(["explain", str(spec), "--html", str(out), "--html-seqlen", "200"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"step-through page: {out} (1 kernel(s), ") and "at seqlen 200" in last
    assert "stepped at seqlen q 200, kv 200" in out.read_text()
    assert main(["explain", str(spec), "--html", str(tmp_path)]) == 2
    assert "--html" in capsys.readouterr().err
    assert main(["explain", str(spec), "--html", str(tmp_path / "new" / "x.html")]) == 0   # folders are made
    assert main(["explain", str(spec), "--html", str(out), "--html-seqlen", "100000"]) == 2
    assert "tiles of 128 per axis; the page steps through at most 64" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert main(["explain", str(spec), "--html", str(tmp_path / "a_file" / "x.html")]) == 2
    assert "cannot write it" in capsys.readouterr().err
