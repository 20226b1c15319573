"""`tiledsl tune --dry-run` over backward spaces (choices inside `backward { }`), on the CPU."""
from __future__ import annotations

import json

import pytest

from tiledsl.cli.main import main
from tiledsl.frontend.parse import parse_text
from tiledsl.tune.backward import is_backward_space, plan_backward_candidates, store_key
from tiledsl.schedule.cost import Shape
from tiledsl.tune.store import entry_key

SPACE = """attention bwd_space {{
    head_dim = {d}
    dtype    = bf16
    mask     = causal
    schedule {{
        order    q, kv
        tile     q = 128, kv = 64
        warps    4 along q
        pipeline 2 stages via cp.async
    }}
    backward {{
        order    kv, q
        tile     q in {{32, 64, 128}}, kv in {{64, 128}}
        warps    in {{4, 8}}
        pipeline 2 stages
        dq accumulate atomic
    }}
}}
"""


def space(d=64):
    (s,) = parse_text(SPACE.format(d=d))
    return s


def test_backward_space_is_recognised():
    assert is_backward_space(space())
    forward_only = SPACE.format(d=64).replace("tile     q = 128, kv = 64", "tile     q in {64, 128}, kv = 64") \
        .replace("q in {32, 64, 128}, kv in {64, 128}", "q = 64, kv = 128").replace("warps    in {4, 8}", "warps    8")
    (s,) = parse_text(forward_only)
    assert not is_backward_space(s)


def test_candidates_rank_and_budget_without_nvcc():
    shape = Shape(2, 16, 1024, 1024)
    candidates, rejected, budget = plan_backward_candidates(space(), shape, budget=2, use_nvcc=False)
    assert len(candidates) + len(rejected) == 12 and rejected   # w4 with kv = 128 splits rows 32 per warp, etc.
    assert budget == 2 and sum(c.status == "pending" for c in candidates) == 2
    ranks = sorted(c.model_rank for c in candidates if c.model_rank)
    assert ranks == list(range(1, len(ranks) + 1))
    best = min((c for c in candidates if c.model_rank), key=lambda c: c.model_rank)
    assert (best.spec.backward.tile_q, best.spec.backward.tile_kv, best.spec.backward.warps) == (128, 128, 8)
    assert len({c.spec.backward for c in candidates}) == len(candidates)   # one per backward module


def test_store_keys_separate_backward_from_forward():
    spec = plan_backward_candidates(space(), Shape(1, 1, 128, 128), use_nvcc=False)[0][0].spec
    shape = Shape(1, 1, 128, 128)
    forward = entry_key({"config_hash": spec.config_hash}, shape.key(), "gpu", {})
    assert store_key(spec, shape, "gpu", {}) != forward


@pytest.mark.parametrize("d", [64, 128])
def test_dry_run_lists_members_with_ptxas(tmp_path, capsys, d):
    path = tmp_path / "space.tile"
    path.write_text(SPACE.format(d=d))
    assert main(["tune", str(path), "--seqlen", "2048", "--dry-run", "--json", "--exhaustive"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] == 12 and out["legal"] >= 3
    rows = out["rows"]
    assert all(r["config"].startswith("backward q") for r in rows)
    timed = [r for r in rows if r["status"] == "pending"]
    assert len(timed) == out["budget"]
    from tiledsl.tune.search import nvcc_available
    if nvcc_available():
        assert all(r["resources_from"] == "ptxas" and r["registers"] <= 255 for r in timed)


def test_dry_run_table(tmp_path, capsys):
    path = tmp_path / "space.tile"
    path.write_text(SPACE.format(d=64))
    assert main(["tune", str(path), "--seqlen", "1024", "--dry-run", "--budget", "1"]) == 0
    text = capsys.readouterr().out
    assert "backward: batch" in text and "would time 1" in text and "backward q128 kv128 w8 s2 atomic" in text


def test_both_tuners_share_one_search_loop_and_one_check(tmp_path):
    """The backward tuner's GPU half is run_trials with the backward's Trial: a module that fails to
    build or to check never wins, stored entries say `"pass": "backward"`, and the check's verdict is
    judge's (CHECK_TOLERANCE, a NaN is wrong)."""
    import math
    from types import SimpleNamespace
    from tiledsl.tune import backward as tune_backward
    from tiledsl.tune import search
    from tiledsl.tune.search import CHECK_TOLERANCE, Trial, judge, run_trials
    from tiledsl.tune.store import TuneStore
    assert tune_backward.CHECK_SHAPE is search.CHECK_SHAPE and not hasattr(tune_backward, "CHECK_TOLERANCE")
    assert judge({"dq": 0.0, "dk": 1e-3, "dv": CHECK_TOLERANCE["dv"]})[0]
    ok, _, why = judge({"dq": math.nan, "dk": 0.0, "dv": 0.5})
    assert not ok and why.startswith("wrong result: dq error nan") and "dv error 5.00e-01" in why
    shape = Shape(1, 2, 1024, 1024)
    planned, rejected, budget = plan_backward_candidates(space(), shape, use_nvcc=False)
    pending = [c for c in planned if c.status == "pending"]
    broken, wrong = pending[0].name, pending[1].name
    trial = Trial(lambda cs: {broken: "compile: no"}, lambda c: (c.name != wrong, {"dq": 0.0}, "wrong"),
                  lambda c: 1.0 + len(c.name) / 1000, lambda c: 1e12, lambda c: store_key(c.spec, shape, "G", {}),
                  {"pass": "backward"})
    bench = SimpleNamespace(gpu="G", toolchain={})
    store = TuneStore(tmp_path / "t.json")
    result = run_trials(space(), shape, planned, rejected, budget, bench, trial, store, False, False, 0.0)
    status = {c.name: c.status for c in result.candidates}
    assert status[broken] == status[wrong] == "failed" and result.winner.name not in (broken, wrong)
    entries = json.loads((tmp_path / "t.json").read_text())
    assert entries and all(e["pass"] == "backward" for e in (entries.get("entries") or entries).values())
