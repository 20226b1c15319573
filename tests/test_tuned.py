"""Tuned defaults (tiledsl/dispatch/tuned.py), the spec printer (tune.spec_to_dsl) and `tiledsl tune
--dry-run`: all CPU."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tiledsl.dispatch import tuned
from tiledsl.frontend.space import SpecSpace
from tiledsl.cli.main import main
from tiledsl.families import lower
from tiledsl.frontend.parse import load_spec, parse_file, parse_text
from tiledsl.schedule.passes import run_passes
from tiledsl.codegen.render import render
from tiledsl.spec import DType, KernelSpec, Mask, Problem, Schedule
from tiledsl.tune.search import spec_to_dsl

ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted((ROOT / "specs").glob("*.tile"))


def _concrete_specs():
    """Every concrete kernel in specs/: the written ones and every legal config of each space."""
    out = []
    for path in SPEC_FILES:
        for item in parse_file(path):
            out += item.expand()[0] if isinstance(item, SpecSpace) else [item]
    return out


# ---- printer ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", _concrete_specs(), ids=lambda s: s.kernel_name)
def test_printer_round_trips_every_bundled_spec(spec):
    text = spec_to_dsl(spec, comment="written by a test\nsecond line")
    (back,) = parse_text(text, "printed.tile")
    assert isinstance(back, KernelSpec)
    assert back == spec and back.kernel_name == spec.kernel_name
    assert text.startswith("# written by a test\n# second line\n")


@pytest.mark.parametrize("problem", [
    Problem(64, 64, DType.FP16, Mask.WINDOW, window_left=256, window_right=3),
    Problem(128, 64, DType.BF16, Mask.CAUSAL, softmax_scale=0.0625),
    Problem(64, 64, DType.BF16, Mask.NONE, softmax_scale=1e-05),
])
def test_printer_round_trips_problem_settings(problem):
    spec = KernelSpec("p", problem, Schedule(tile_q=64, tile_kv=32, warps=4, stages=1))
    back = load_spec(spec_to_dsl(spec))
    assert back == spec
    assert "pipeline 1 stage via" in spec_to_dsl(spec)


def test_printed_spec_passes_tiledsl_check(tmp_path, capsys):
    spec = _concrete_specs()[0]
    path = tmp_path / "winner.tile"
    path.write_text(spec_to_dsl(spec, "winner", "tuned"))
    assert main(["check", str(path)]) == 0


# ---- the tuned table ----------------------------------------------------------------------------------

def test_table_covers_sm90_dtypes_head_dims_and_masks():
    wanted = {("sm_90", dtype, d, mask) for dtype in ("bf16", "fp16") for d in (64, 128, 256) for mask in ("none", "causal")}
    assert wanted <= set(tuned.TUNED)


ENTRIES = [(key, False) for key in sorted(tuned.TUNED)] + [(key, True) for key in sorted(tuned.TUNED_LONG)]


@pytest.mark.parametrize("key,long_kv", ENTRIES, ids=lambda k: "-".join(map(str, k)) if isinstance(k, tuple) else
                         ("long" if k else "short"))
def test_every_entry_is_what_the_checker_makes_of_its_dsl_and_lowers(key, long_kv):
    # The table holds Schedule objects; written out as DSL and read back they are the same schedule.
    arch, dtype, d, mask = key
    spec, found = tuned.tuned_spec(arch + "a", DType(dtype), d, Mask(mask), long_kv=long_kv)
    assert found and spec.schedule == (tuned.TUNED_LONG if long_kv else tuned.TUNED)[key]
    assert load_spec(spec_to_dsl(spec)) == spec
    run_passes(spec)
    assert "__global__" in render(lower(spec))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("key,long_kv", [e for e in ENTRIES if e[0][1] == "bf16"],
                         ids=lambda k: "-".join(map(str, k)) if isinstance(k, tuple) else ("long" if k else "short"))
def test_every_bf16_entry_compiles_without_spills(key, long_kv):
    from tiledsl.codegen import nvcc
    arch, dtype, d, mask = key
    spec, _ = tuned.tuned_spec(arch + "a", DType(dtype), d, Mask(mask), long_kv=long_kv)
    plan = lower(spec)
    res = nvcc.resources(render(plan), plan.kernel_name)
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res.report[-600:]


def test_a_warm_call_never_enters_the_front_end(monkeypatch):
    import tiledsl.frontend.parse as parse
    def refuse(*args, **kwargs):
        raise AssertionError("the front end was called")
    for name in ("load_spec", "load_specs", "parse_text", "parse_file"):
        monkeypatch.setattr(parse, name, refuse)
    tuned.tuned_spec.cache_clear()
    for key in tuned.TUNED:
        tuned.tuned_spec(key[0] + "a", DType(key[1]), key[2], Mask(key[3]))


def test_entries_are_todays_best_known_configs():
    def schedule(d, mask, long_kv=False):
        spec, _ = tuned.tuned_spec("sm_90a", DType.BF16, d, Mask(mask), long_kv=long_kv)
        s = spec.schedule
        return (spec.family.value, s.tile_q, s.tile_kv, s.consumer_warpgroups, s.pingpong, s.intra_overlap,
                s.launch and s.launch.value)
    # bench/results/2026-11-30-hopper-ablation-3.json (best hopper schedule per head dim and mask), and for d256
    # and d64 from 2k keys 2026-12-01-prefill-ab-1.json and -2.json
    assert schedule(64, "none") == schedule(64, "causal") == ("hopper", 192, 128, 3, False, True, None)
    assert schedule(64, "none", True) == schedule(64, "causal", True) == ("hopper", 192, 192, 3, False, False, None)
    assert schedule(128, "none") == schedule(128, "none", True) == ("hopper", 128, 128, 2, False, True, None)
    assert schedule(128, "causal") == ("hopper", 128, 128, 2, True, True, None)
    assert schedule(256, "none") == schedule(256, "causal") == ("hopper", 128, 80, 2, False, True, "grid")


def test_the_long_bucket_starts_at_long_kv_keys_and_never_takes_decode_or_modifications():
    from tiledsl.mods.model import Modifications
    assert tuned.LONG_KV == 2048
    spec, found = tuned.tuned_spec("sm_90a", DType.BF16, 64, Mask.CAUSAL, long_kv=True,
                                   mods=Modifications(softcap=30.0))
    assert found and spec.schedule.tile_kv == 128   # the modified kernels were built and measured on TUNED's tiles


def test_lookup_known_unknown_window_and_scale():
    spec, found = tuned.tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL)
    assert found and (spec.schedule.tile_kv, spec.schedule.consumer_warpgroups) == (128, 2)
    spec, found = tuned.tuned_spec("sm_100", DType.BF16, 128, Mask.CAUSAL)
    assert not found and spec.family.value == "fa2" and spec.schedule.mma.value == "mma.sync"   # no wgmma off sm_90
    run_passes(spec)
    spec, found = tuned.tuned_spec("sm_90", DType.FP16, 128, Mask.WINDOW, window=(256, 0), scale=0.1)
    assert found and spec.schedule.pingpong   # a window takes the causal entry's schedule (d128: ping-pong)
    assert (spec.problem.mask, spec.problem.window_left, spec.problem.softmax_scale) == (Mask.WINDOW, 256, 0.1)
    spec, found = tuned.tuned_spec("sm_90", DType.BF16, 64, Mask.NONE, head_dim_v=128)
    assert not found and spec.problem.head_dim_v == 128


def test_untabled_schedule_is_legal_for_common_head_dims():
    for d in (64, 128):
        for dtype in (DType.BF16, DType.FP16):
            spec, found = tuned.tuned_spec("sm_80", dtype, d, Mask.CAUSAL)
            assert not found
            run_passes(spec)
            lower(spec)


def test_hint_is_printed_once_per_key(capsys, monkeypatch):
    monkeypatch.setattr(tuned, "_hinted", set())
    spec, _ = tuned.tuned_spec("sm_100", DType.BF16, 96, Mask.NONE)
    for _ in range(3):
        tuned._hint_once(("sm_100", spec.problem), "sm_100", spec)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tiledsl tune" in err[0] and "sm_100" in err[0] and spec.kernel_name in err[0]


def test_attention_is_exported():
    import tiledsl
    from tiledsl import api
    assert tiledsl.attention is api.attention


# ---- tiledsl tune --dry-run -----------------------------------------------------------------------------

def test_cli_dry_run_json(capsys, monkeypatch):
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")
    assert main(["tune", str(ROOT / "specs" / "fa2_space_d64.tile"), "--seqlen", "4096", "--causal",
                 "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] == 72 and out["legal"] == 45
    pending = [r for r in out["rows"] if r["status"] == "pending"]
    assert 0 < len(pending) <= 0.3 * out["configs"]
    assert all(r["kernel"].startswith("fa2_d64_fp16_causal_") for r in out["rows"])
    assert [r["model_rank"] for r in pending] == list(range(1, len(pending) + 1))


def test_cli_no_causal_overrides_a_causal_space(capsys, monkeypatch):
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")
    assert main(["tune", str(ROOT / "specs" / "fa2_space_d128.tile"), "--seqlen", "1024", "--no-causal",
                 "--dry-run", "--budget", "3"]) == 0
    out = capsys.readouterr().out
    assert "fa2_space_d128 none" in out and "would time 3" in out


def test_cli_refuses_a_file_without_a_space(capsys):
    assert main(["tune", str(ROOT / "specs" / "fa2_d64.tile"), "--seqlen", "1024", "--dry-run"]) == 2
    assert "no search space" in capsys.readouterr().err
