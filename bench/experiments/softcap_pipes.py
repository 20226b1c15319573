"""Softcap's softmax numerator on the H200's pipes (a probe; its numbers go to bench/results, nothing here
ships): the five variants of bench/experiments/softcap_pipes.cu, each checked against float64 first,
then timed as scores per second with every SM busy.

    python bench/experiments/softcap_pipes.py OUT.json

Rows: variant, MUFU / FP32 / INT instructions per score (counted in the PTX), the largest relative error
of p against float64 over scores in [-400, 400] (cap 30, m the largest capped score), Gscores/s and the
ratio to variant 0 (no softcap) and to variant 1 (both on MUFU). tanh.approx's error (2^-11 relative,
times the cap in the exponent) is recorded beside the polynomial's; a variant over 5e-2 is recorded as
wrong and not timed.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import cupy
import numpy as np

from tiledsl.tune.bench import record

SOURCE = Path(__file__).with_suffix(".cu")
VARIANTS = {0: "no softcap: ex2 on MUFU", 1: "tanh and ex2 on MUFU", 2: "tanh on MUFU, 2^x on FMA",
            3: "tanh on MUFU, 2^x half MUFU half FMA", 4: "tanh on FMA, ex2 on MUFU"}
CAP, ROUNDS, THREADS, BLOCKS_PER_SM = 30.0, 4000, 256, 8
TOLERANCE = 5e-2


def op_counts(ptx: str, variant: int) -> dict:
    if f".entry throughput_{variant}(" not in ptx:
        return {}
    body = ptx.split(f".entry throughput_{variant}(")[1].split("\n}")[0]
    count = {"mufu": len(re.findall(r"ex2\.approx|tanh\.approx", body)),
             "fp32": len(re.findall(r"\b(fma\.rn|add|sub|mul|max|min|abs|copysign)\.f32", body)),
             "int": len(re.findall(r"\b(shl\.b32|add\.s32|sub\.s32)", body))}
    return {k: v / 32 for k, v in count.items()}   # 32 scores a round, the loop body once in the PTX


def main(out: str) -> int:
    source = SOURCE.read_text()
    module = cupy.RawModule(code=source, options=("-arch=sm_90a",))
    try:   # the PTX, for the instruction counts (optional)
        ptx = cupy.cuda.compiler.compile_using_nvrtc(source, options=("-arch=compute_90a",))
        ptx = ptx.decode() if isinstance(ptx, bytes) else str(ptx)
    except Exception:
        ptx = ""
    device = cupy.cuda.Device()
    sms = device.attributes["MultiProcessorCount"]
    s = np.concatenate([np.linspace(-400, 400, 200001), np.random.default_rng().normal(0, 40, 200000)])
    rows, rates = [], {}
    for variant, what in VARIANTS.items():
        s32 = s.astype(np.float32).astype(np.float64)   # float64 of the scores the kernel sees
        logits = s32 if variant == 0 else CAP * np.tanh(s32 / CAP)
        m = float(logits.max())
        s_gpu, p_gpu = cupy.asarray(s32, dtype=cupy.float32), cupy.empty(len(s), dtype=cupy.float32)
        module.get_function(f"map_once_{variant}")(((len(s) + 255) // 256,), (256,),
                                                   (s_gpu, p_gpu, np.int32(len(s)), np.float32(CAP), np.float32(m)))
        p = cupy.asnumpy(p_gpu).astype(np.float64)
        want = np.exp(logits - m)
        big = want > 1e-30
        error = float(np.abs(p[big] / want[big] - 1).max())
        row = {"kernel": f"softcap_pipes_{variant}", "mod": "softcap", "variant": variant, "what": what,
               "cap": CAP, "max_rel_error": error, **(op_counts(ptx, variant) if ptx else {})}
        if error > TOLERANCE:
            row["status"] = "wrong"
            rows.append(row)
            continue
        fn = module.get_function(f"throughput_{variant}")
        blocks = sms * BLOCKS_PER_SM
        sink = cupy.empty(blocks * THREADS, dtype=cupy.float32)
        args = (sink, np.int32(ROUNDS), np.float32(CAP), np.float32(1.0))
        fn((blocks,), (THREADS,), args)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(7):
            start.record()
            fn((blocks,), (THREADS,), args)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        seconds = sorted(times)[3]
        rates[variant] = blocks * THREADS * 32 * ROUNDS / seconds
        row.update(status="timed", gscores_per_s=rates[variant] / 1e9, seconds=seconds)
        rows.append(row)
    for row in rows:
        if row.get("status") == "timed":
            row["vs_no_softcap"] = rates[row["variant"]] / rates[0] if 0 in rates else None
            row["vs_both_on_mufu"] = rates[row["variant"]] / rates[1] if 1 in rates else None
    record(Path(out), "python bench/experiments/softcap_pipes.py " + out, rows, sms=sms, peers={})
    for row in rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
