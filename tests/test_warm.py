"""Warm records (tiledsl/runtime/warm.py) without a GPU: a recorded kernel reads back in a fresh process with
its plan's fields, source and cubin path, without importing Lark, networkx or Jinja2; records of
other code (fingerprint), with a missing cubin or unreadable bytes are ignored."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiledsl.dispatch import tuned
from tiledsl.runtime import warm
from tiledsl.families import compile
from tiledsl.spec import DType, Mask

ROOT = Path(__file__).resolve().parent.parent
LOOKUPS = {"fa2": ("bf16", 40, "causal", 40, None, None, None), "hopper": ("bf16", 128, "causal", 128, None, None, None),
           "decode": ("bf16", 128, "none", 128, None, None, 1)}   # decode: runtime_decode imports no lowering


def _record(tmp_path, monkeypatch, which: str):
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    dtype, d, mask, dv, window, scale, decode_q = LOOKUPS[which]
    spec, found = tuned.tuned_spec("sm_90a", DType(dtype), d, Mask(mask), dv, window, scale, decode_q)
    kernel = compile(spec)
    kernel.cubin_path = tmp_path / "cubin" / f"{kernel.name}.cubin"
    kernel.cubin_path.parent.mkdir(parents=True)
    kernel.cubin_path.write_bytes(b"not really a cubin")
    warm.save("sm_90a", LOOKUPS[which], kernel, found)
    return kernel, found


@pytest.mark.parametrize("which", sorted(LOOKUPS))
def test_a_record_reads_back_in_a_fresh_process_without_the_front_end(tmp_path, monkeypatch, which):
    kernel, found = _record(tmp_path, monkeypatch, which)
    code = f"""
import json, sys
from tiledsl.runtime import warm
kernel, found = warm.load("sm_90a", {LOOKUPS[which]!r})
heavy = sorted(m for m in ("lark", "networkx", "jinja2") if m in sys.modules)
print(json.dumps({{"class": type(kernel).__name__, "name": kernel.name, "found": found, "heavy": heavy,
                  "launch": [kernel.plan.launch.threads, kernel.plan.launch.smem_bytes, kernel.plan.launch.tile_q],
                  "constants": {{c.name: c.value for c in kernel.plan.constants}}, "source": kernel.source,
                  "cubin": str(kernel.cubin_path), "spec": kernel.spec.kernel_name}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["heavy"] == []
    assert got["class"] == type(kernel).__name__ and got["name"] == kernel.name and got["found"] == found
    launch = kernel.plan.launch
    assert got["launch"] == [launch.threads, launch.smem_bytes, launch.tile_q]
    assert got["constants"] == {c.name: c.value for c in kernel.plan.constants}
    assert got["source"] == kernel.source and got["cubin"] == str(kernel.cubin_path)
    assert got["spec"] == kernel.spec.kernel_name


def test_records_of_other_code_a_missing_cubin_or_bad_bytes_are_ignored(tmp_path, monkeypatch):
    kernel, _ = _record(tmp_path, monkeypatch, "fa2")
    lookup = LOOKUPS["fa2"]
    assert warm.load("sm_90a", lookup) is not None
    assert warm.load("sm_80", lookup) is None
    monkeypatch.setattr(warm, "fingerprint", lambda: "other code")   # any file of tiledsl or its templates changed
    assert warm.load("sm_90a", lookup) is None
    monkeypatch.undo()
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    path = warm.record_path("sm_90a", lookup)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert warm.load("sm_90a", lookup) is None
    path.write_bytes(data)
    kernel.cubin_path.unlink()
    assert warm.load("sm_90a", lookup) is None


@pytest.mark.parametrize("changed", ["tiledsl/runtime/warm.py", "templates/hopper.cu.j2", "templates/paged_kv.cuh"])
def test_the_fingerprint_follows_the_package_files(changed):
    # a plain header is pasted into kernel sources as much as a template is rendered into them
    before = warm.fingerprint()
    warm.fingerprint.cache_clear()
    assert warm.fingerprint() == before
    target = ROOT / changed
    stat = target.stat()
    try:
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        warm.fingerprint.cache_clear()
        assert warm.fingerprint() != before
    finally:
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        warm.fingerprint.cache_clear()
