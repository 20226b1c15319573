"""First-call latency: `import tiledsl`, spec -> CUDA, and the first `tiledsl.attention` call of a
process (torch tensors: through the autograd op) with a cold disk cache (front end, NVRTC compile,
load, launch) and with a warm one (the warm record and cubin the cold call left: tiledsl/runtime/warm.py), per
kernel family; the first training step (forward + backward), cold and warm; then `tiledsl warmup`'s
wall time. Each measurement runs in a fresh Python process so nothing is cached in memory.

    python bench/first_call.py OUT.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import record

CALL = """
import time, json, sys
t0 = time.perf_counter()
import torch, tiledsl
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
d, causal, q_len = {d}, {causal}, {q_len}
q = torch.randn(1, 8, q_len, d, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
t2 = time.perf_counter()
tiledsl.attention(q, k, v, causal=causal); torch.cuda.synchronize()
t3 = time.perf_counter()
tiledsl.attention(q, k, v, causal=causal); torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps({{"first_call_s": t3 - t2, "second_call_s": t4 - t3}}))
"""

# The first training step: forward and backward through the autograd op (tiledsl/dispatch/autograd.py).
TRAIN_CALL = """
import time, json
import torch, tiledsl
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
d, causal = {d}, {causal}
q, k, v = (torch.randn(1, 8, 4096, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
def step():
    tiledsl.attention(q, k, v, causal=causal).sum().backward(); torch.cuda.synchronize()
t0 = time.perf_counter(); step(); t1 = time.perf_counter(); step(); t2 = time.perf_counter()
print(json.dumps({{"first_call_s": t1 - t0, "second_call_s": t2 - t1}}))
"""

CASES = [("hopper", 128, True, 4096), ("hopper", 64, False, 4096), ("fa2 (autoschedule)", 96, False, 4096),
         ("decode", 128, False, 1)]


def run(code: str, cache: str) -> dict:
    env = {**os.environ, "TILEDSL_CACHE_DIR": cache, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    out = sys.argv[1]
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tiledsl"], check=True, env=env)
    python_only = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
    bare = time.perf_counter() - t
    rows.append({"what": "import tiledsl (process wall minus a bare interpreter)", "s": python_only - bare})
    spec_to_cuda = run("""
import time, json
t0 = time.perf_counter()
import tiledsl
k = tiledsl.compile(open("specs/hopper_d128_causal.tile").read())
t1 = time.perf_counter()
k2 = tiledsl.compile(open("specs/hopper_d128.tile").read())
t2 = time.perf_counter()
print(json.dumps({"first_s": t1 - t0, "second_s": t2 - t1}))
""", tempfile.mkdtemp())
    rows.append({"what": "spec text -> CUDA via tiledsl.compile (first in process, incl. imports)", "s": spec_to_cuda["first_s"]})
    rows.append({"what": "spec text -> CUDA via tiledsl.compile (second)", "s": spec_to_cuda["second_s"]})
    cupy_import = run("""
import time, json
import torch
torch.zeros(1, device="cuda")
t0 = time.perf_counter()
import cupy
t1 = time.perf_counter()
print(json.dumps({"s": t1 - t0}))
""", tempfile.mkdtemp())
    rows.append({"what": "import cupy (after torch, CUDA up): part of every first attention call", "s": cupy_import["s"]})
    for family, d, causal, q_len in CASES:
        cache = tempfile.mkdtemp(prefix="tiledsl-cold-")
        cold = run(CALL.format(d=d, causal=causal, q_len=q_len), cache)
        warm = run(CALL.format(d=d, causal=causal, q_len=q_len), cache)   # same cache: the cubin is on disk now
        for label, r in (("cold disk cache", cold), ("warm disk cache", warm)):
            rows.append({"kernel": f"attention d{d} {'causal' if causal else 'none'} q_len {q_len}", "family": family,
                         "dtype": "bf16", "head_dim": d, "seqlen": q_len, "causal": causal, "peers": {},
                         "what": f"first attention call, {label}", "s": r["first_call_s"], "second_call_s": r["second_call_s"]})
            print(family, d, causal, label, f"{r['first_call_s']:.3f} s first, {r['second_call_s'] * 1e3:.2f} ms second", flush=True)
    for d, causal in ((128, True), (64, False)):
        cache = tempfile.mkdtemp(prefix="tiledsl-cold-train-")
        for label in ("cold disk cache", "warm disk cache"):
            r = run(TRAIN_CALL.format(d=d, causal=causal), cache)
            rows.append({"kernel": f"attention forward+backward d{d} {'causal' if causal else 'none'} seqlen 4096",
                         "family": "autograd op (tuned forward + backward module)", "dtype": "bf16", "head_dim": d,
                         "seqlen": 4096, "causal": causal, "peers": {}, "what": f"first training step, {label}",
                         "s": r["first_call_s"], "second_call_s": r["second_call_s"]})
            print("train step", d, causal, label, f"{r['first_call_s']:.3f} s first, {r['second_call_s'] * 1e3:.2f} ms second", flush=True)
    cache = tempfile.mkdtemp(prefix="tiledsl-warmup-")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tiledsl.cli", "warmup", "--dtype", "bf16", "--head-dim", "128"],
                          capture_output=True, text=True,
                          env={**env, "TILEDSL_CACHE_DIR": cache}, timeout=600)
    after = run(CALL.format(d=128, causal=True, q_len=4096), cache)
    rows.append({"what": "first attention call after that warmup (hopper d128 causal bf16)", "s": after["first_call_s"]})
    rows.append({"what": "tiledsl warmup --dtype bf16 --head-dim 128 (2 kernels, cold cache)", "s": time.perf_counter() - t,
                 "rc": done.returncode, "tail": (done.stdout + done.stderr)[-400:]})
    for r in rows:
        if "kernel" not in r:
            print(r["what"], f"{r['s']:.3f} s", flush=True)
    record(out, "python bench/first_call.py " + " ".join(sys.argv[2:]), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
