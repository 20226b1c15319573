"""The Python cost of a warm call, on the CPU: every public entry point called back to back on the fake
torch tensors of tests/host_stubs.py, whose cuLaunchKernel records and returns (so what is timed is
tiledsl's own work between the call and the launch: the cache lookup, pointers, alignment checks,
output allocation by the fake torch, parameter packing). The fake torch's attribute reads cost about
what real torch's do; its allocations cost less. No GPU, no CuPy, no torch needed.

    python bench/host_path_cpu.py [--calls N] [OUT.json]

Prints one line per call kind (median of 5 rounds of N calls, microseconds per call) and writes them
through tiledsl.tune.bench.record when OUT is given.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cases(dev):
    """name -> (shape description, a no-argument warm call)."""
    import numpy as np

    import tiledsl
    t = dev.tensor
    q, k, v = t((1, 16, 128, 128)), t((1, 16, 128, 128)), t((1, 16, 128, 128))
    qd, kd, vd = t((8, 32, 1, 128)), t((8, 8, 1024, 128)), t((8, 8, 1024, 128))
    k8, v8 = t((8, 8, 1024, 128), "float8_e4m3fn"), t((8, 8, 1024, 128), "float8_e4m3fn")
    scale = t((8,), "float32")
    table = dev.index(np.arange(8 * 64).reshape(8, 64))
    lens = dev.index([1024] * 8)
    kc, vc = t((8 * 64, 16, 8, 128)), t((8 * 64, 16, 8, 128))
    qp, qc = t((8, 1, 32, 128)), t((8, 64, 32, 128))
    cu = dev.index([0, 100, 228, 356])
    qv, kv = t((356, 16, 128)), t((356, 4, 128))
    o, lse, do = t((1, 16, 128, 128)), t((1, 16, 128), "float32"), t((1, 16, 128, 128))
    rows = {
        "attention prefill": ("b1 h16 128 tokens d128", lambda: tiledsl.attention(q, k, v, causal=True)),
        "attention decode": ("8 seqs x 1k, 32/8 heads", lambda: tiledsl.attention(qd, kd, vd)),
        "attention decode FP8 KV": ("8 seqs x 1k", lambda: tiledsl.attention(qd, k8, v8, k_scale=scale,
                                                                             v_scale=scale)),
        "paged_attention decode": ("8 x 1k, page 16", lambda: tiledsl.paged_attention(qp, kc, vc, table, lens,
                                                                                     validate=False)),
        "paged_attention chunked prefill": ("8 x 64 queries", lambda: tiledsl.paged_attention(
            qc, kc, vc, table, lens, causal=True, validate=False)),
        "varlen_attention (max given)": ("3 seqs, 356 tokens", lambda: tiledsl.varlen_attention(
            qv, kv, kv, cu, cu, 128, 128, causal=True)),
        "attention_backward": ("b1 h16 128 tokens d128", lambda: tiledsl.attention_backward(q, k, v, o, lse, do,
                                                                                         causal=True)),
    }
    try:
        from tiledsl.serving.plan import PagedAttention
    except ImportError:
        return rows
    planned = PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=8 * 64, dtype="bfloat16",
                             device=qp.device, max_batch=8, max_pages=64)
    planned.plan(np.arange(8 * 64, dtype=np.int32).reshape(8, 64), np.full(8, 1024, np.int32))
    out = t((8, 1, 32, 128))
    rows["paged run (planned, out=)"] = ("8 x 1k, page 16", lambda: planned.run(qp, kc, vc, out=out))
    return rows


def measure(calls: int) -> list[dict]:
    from tests.host_stubs import stub_device
    rows = []
    with tempfile.TemporaryDirectory() as tmp, stub_device(Path(tmp)) as dev:
        for name, (shape, call) in cases(dev).items():
            call()   # the cold call: builds, checks, prepares
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                rounds.append((time.perf_counter() - start) / calls * 1e6)
            us = statistics.median(rounds)
            print(f"{name:36s} {shape:26s} {us:7.1f} us/call", flush=True)
            rows.append({"api": name, "shape": shape, "host_us": round(us, 2), "calls": calls})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write the rows as JSON here")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    rows = measure(args.calls)
    if args.out:
        from tiledsl.tune.bench import record
        record(Path(args.out), " ".join(["python", *sys.argv]), rows, device="CPU (launches stubbed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
