"""`tiledsl check`: output for kernels and spaces, --json, and bad specs exiting 2 with a
file:line:col message and a caret, in-process and as a real `python -m tiledsl.cli` process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiledsl import load_specs
from tiledsl.cli.main import main

# Not imported from conftest: tests/ may or may not be a package.
ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted((ROOT / "specs").glob("*.tile"))

BAD_SPECS = {
    # name: (text, the expected "line:col: error: message" start)
    "typo_key": ("attention k {\n    head_dim = 64\n    schedule {\n        tiles q = 64\n    }\n}\n",
                 "4:9: error: unknown key 'tiles'; did you mean 'tile'?"),
    "bad_value": ("attention k {\n    head_dim = 64\n    schedule {\n        pipeline 9 stages\n    }\n}\n",
                  "4:18: error: pipeline stages must be an integer in 1..4, got 9"),
    "syntax": ("attention k {\n    head_dim 64\n}\n", "2:14: error: expected '=' after 'head_dim', found '64'"),
}


def test_check_prints_every_bundled_kernel(capsys):
    assert main(["check", "--verbose", *map(str, SPEC_FILES)]) == 0
    out = capsys.readouterr().out
    for path in SPEC_FILES:   # names come from the specs: their schedules get tuned
        for spec in load_specs(path):
            assert f"{spec.kernel_name}  ({spec.family.value}, from '{spec.name}')" in out or "legal" in out
    (fa1, _) = load_specs(SPEC_FILES[0].with_name("fa1_d64.tile"))
    assert f"{fa1.kernel_name}  (fa1, from 'fa1_d64')" in out
    assert "schedule: order=kv, q tile_q=" in out and "copy=cp.async" in out
    assert "space 'fa2_space_d64': 72 configs, 45 legal, 27 rejected" in out
    assert out.count("      legal     fa2_d64_fp16_") == 45
    assert "rejected  tile_q=64 tile_kv=32 warps=8 stages=1 mma=mma.sync: 8 warps along q" in out


def test_check_json(capsys):
    paths = [str(SPEC_FILES[0].with_name(n)) for n in ("fa1_d64.tile", "fa2_space_d128.tile")]
    assert main(["check", "--json", *paths]) == 0
    items = json.loads(capsys.readouterr().out)
    assert [item["type"] for item in items] == ["kernel", "kernel", "space"]
    assert items[0]["family"] == "fa1" and items[0]["schedule"]["order"] == "kv, q"
    assert (items[2]["size"], items[2]["legal_count"], len(items[2]["rejected"])) == (72, 42, 30)
    assert items[2]["choices"]["tile_kv"] == [32, 64, 128]
    assert items[2]["rejected"][0]["config"] == {"tile_q": 64, "tile_kv": 32, "warps": 8, "stages": 1, "mma": "mma.sync"}


@pytest.mark.parametrize("name", sorted(BAD_SPECS))
def test_bad_spec_exits_2_in_process(name, write_spec, capsys):
    text, expected = BAD_SPECS[name]
    path = write_spec(text, f"{name}.tile")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{expected}")
    assert "^" in err and "Traceback" not in err


@pytest.mark.parametrize("name", sorted(BAD_SPECS))
def test_bad_spec_exits_2_as_a_process(name, write_spec):
    text, expected = BAD_SPECS[name]
    path = write_spec(text, f"{name}.tile")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "tiledsl.cli", "check", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"{path}:{expected}")
    assert "^" in done.stderr and "Traceback" not in done.stderr


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.tile")]) == 2
    assert "no such file" in capsys.readouterr().err
