"""The tuner's results store (tiledsl/tune/store.py): keys, round trip, corrupted and foreign
files moved aside with a warning, atomic writes, merging with another writer."""
from __future__ import annotations

import json
import os

import pytest

from tiledsl.tune import store as tune_store
from tiledsl.tune.store import TuneStore, entry_key

CONFIG = {"config_hash": "abc"}
SHAPE = {"batch": 4, "heads": 16, "seqlen_q": 4096, "seqlen_kv": 4096}
TOOLCHAIN = {"nvrtc": [13, 0], "cuda_runtime": 13000, "driver": 13000, "arch": "sm_90a"}
KEY = entry_key(CONFIG, SHAPE, "NVIDIA H200", TOOLCHAIN)
ENTRY = {"kernel": "fa2_x", "valid": True, "ms": 1.25, "tflops": 321.5}


def test_key_changes_with_every_ingredient():
    variants = [entry_key({"config_hash": "abd"}, SHAPE, "NVIDIA H200", TOOLCHAIN),
                entry_key(CONFIG, {**SHAPE, "seqlen_q": 8192}, "NVIDIA H200", TOOLCHAIN),
                entry_key(CONFIG, SHAPE, "NVIDIA H100", TOOLCHAIN),
                entry_key(CONFIG, SHAPE, "NVIDIA H200", {**TOOLCHAIN, "nvrtc": [12, 8]}),
                entry_key(CONFIG, SHAPE, "NVIDIA H200", TOOLCHAIN, version="0.2.0")]
    assert len({KEY, *variants}) == 6
    assert KEY == entry_key(dict(CONFIG), dict(reversed(list(SHAPE.items()))), "NVIDIA H200", TOOLCHAIN)
    assert len(KEY) == 64


def test_round_trip(tmp_path):
    path = tmp_path / "sub" / "tune.json"
    store = TuneStore(path)
    assert len(store) == 0 and store.get(KEY) is None
    store.put(KEY, ENTRY)
    store.save()
    again = TuneStore(path)
    assert again.get(KEY) == ENTRY and KEY in again
    data = json.loads(path.read_text())
    assert data["format"] == tune_store.FORMAT and data["version"] == tune_store.FORMAT_VERSION


def test_env_var_and_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv(tune_store.ENV_VAR, str(tmp_path / "elsewhere.json"))
    assert TuneStore().path == tmp_path / "elsewhere.json"
    monkeypatch.delenv(tune_store.ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tune_store.default_path() == tmp_path / ".cache" / "tiledsl" / "tune.json"


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("\x00\x01garbage", "not valid JSON"),
    ('{"format": "tiledsl-tune-store", "version": 1, "entries": {"k": ', "not valid JSON"),
    ('[1, 2, 3]', "not a tiledsl tune store"),
    ('{"some": "other tool"}', "not a tiledsl tune store"),
    ('{"format": "tiledsl-tune-store", "version": 99, "entries": {}}', "format version 99"),
    ('{"format": "tiledsl-tune-store", "version": 1, "entries": {"k": 3}}', "malformed entries"),
])
def test_corrupt_or_foreign_file_is_moved_aside(tmp_path, capsys, content, why):
    path = tmp_path / "tune.json"
    path.write_text(content)
    store = TuneStore(path)
    assert len(store) == 0 and not path.exists()
    aside = list(tmp_path.glob("tune.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and aside[0].name in err[0]
    store.put(KEY, ENTRY)
    store.save()
    assert TuneStore(path).get(KEY) == ENTRY


def test_two_corrupt_files_in_the_same_second_both_kept(tmp_path, capsys):
    path = tmp_path / "tune.json"
    for text in ("bad one", "bad two"):
        path.write_text(text)
        TuneStore(path)
    assert sorted(p.read_text() for p in tmp_path.glob("tune.json.corrupt-*")) == ["bad one", "bad two"]


def test_atomic_write_leaves_the_old_file_when_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    store = TuneStore(path)
    store.put(KEY, ENTRY)
    store.save()
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tune_store.os, "replace", broken_replace)
    store.put("other", {"kernel": "y"})
    with pytest.raises(OSError):
        store.save()
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tune.json"]   # no temporary file left


def test_save_writes_through_a_temporary_file_then_replaces(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    calls = []
    real = os.replace

    def spy(src, dst):
        calls.append((os.path.dirname(src), os.path.basename(src), str(dst)))
        return real(src, dst)
    monkeypatch.setattr(tune_store.os, "replace", spy)
    store = TuneStore(path)
    store.put(KEY, ENTRY)
    store.save()
    assert len(calls) == 1 and calls[0][0] == str(tmp_path) and calls[0][1] != "tune.json" and calls[0][2] == str(path)


def test_save_merges_entries_written_by_another_process(tmp_path):
    path = tmp_path / "tune.json"
    first, second = TuneStore(path), TuneStore(path)
    first.put("a", {"kernel": "a"})
    first.save()
    second.put("b", {"kernel": "b"})
    second.save()
    merged = TuneStore(path)
    assert merged.get("a") == {"kernel": "a"} and merged.get("b") == {"kernel": "b"}


class _FakeBench:
    """A Workbench without a GPU: every kernel compiles, the one named `wrong` fails its check,
    and time is the model's prediction (so the tuner's bookkeeping runs on CPU)."""
    from tiledsl.device_limits import H200 as limits
    arch, gpu, toolchain = "sm_90a", "Fake GPU", {"nvrtc": [0, 0]}

    def __init__(self, wrong: str = ""):
        self.wrong, self.timed = wrong, []

    def compile(self, specs):
        return {}

    def check(self, spec):
        return (spec.kernel_name != self.wrong, {"o": 0.0}, "wrong result" if spec.kernel_name == self.wrong else "")

    def time_ms(self, spec, shape):
        self.timed.append(spec.kernel_name)
        return 1.0 + len(spec.kernel_name) / 1000


def test_tune_rerun_answers_from_the_store_and_never_picks_a_wrong_kernel(tmp_path, monkeypatch):
    from pathlib import Path
    from tiledsl.cli.tune import load_space
    from tiledsl.tune.search import plan_candidates, tune
    from tiledsl.schedule.cost import Shape
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")
    space = load_space(str(Path(__file__).resolve().parent.parent / "specs" / "fa2_space_d64.tile"), None)
    shape = Shape(1, 4, 1024, 1024)
    planned, _, budget = plan_candidates(space, shape, use_nvcc=False)
    fastest = min((c for c in planned if c.status == "pending"), key=lambda c: len(c.name))
    bench = _FakeBench(wrong=fastest.name)
    store = TuneStore(tmp_path / "tune.json")
    first = tune(space, shape, store=store, bench=bench, progress=False)
    assert first.timed == budget and first.from_store == 0 and len(bench.timed) == budget - 1
    assert first.winner is not None and first.winner.name != fastest.name
    assert {c.name: c.status for c in first.candidates}[fastest.name] == "failed"
    again = tune(space, shape, store=TuneStore(tmp_path / "tune.json"), bench=_FakeBench(), progress=False)
    assert again.timed == 0 and again.from_store == budget and again.winner.name == first.winner.name
    full = tune(space, shape, exhaustive=True, store=TuneStore(tmp_path / "tune.json"), bench=bench, progress=False)
    assert full.from_store == budget and full.timed == len(full.candidates) - budget
