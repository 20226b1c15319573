"""A/B kept as the record of an experiment that did not pay (bench/NOTES.md, "Software-pipelined
wgmma loop"; results 2026-11-30-ab-wgmma-pipeline-{1,2}.json): the wgmma kernels with a wait
after each GEMM, whose generated CUDA was read from ab_old/ (written there by `tiledsl compile`
at 8f5a0be), against the software-pipelined template of that experiment, which was not kept.
To run it again, re-create the pipelined template and ab_old/; as it stands it only documents
the method. Usage: python bench/experiments/ab_wgmma_pipeline.py OUT.json"""
import sys
from pathlib import Path
import torch
from tiledsl.bench import attention_flops, prefill_shape, record, sdpa_peers, time_ms
from tiledsl.parse import load_spec
from tiledsl import compile
from tiledsl.validate import lse_error, reference_attention, relative_error

OLD = Path(__file__).resolve().parent / "ab_old"

def check(kernel):
    p = kernel.spec.problem
    out = []
    for b, h, nq, nk in ((3, 5, 700, 900), (2, 2, 17, 17), (1, 3, 1000, 300)):
        q = torch.randn(b, h, nq, p.head_dim_qk, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, nk, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o = torch.full_like(q, float("nan")); lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        kernel(q, k, v, out=o, lse=lse)
        ro, rl = reference_attention(p, q, k, v)
        out.append((relative_error(o, ro), lse_error(lse, rl)))
    return max(e[0] for e in out), max(e[1] for e in out)

import dataclasses
rows = []
VARIANTS = {"fa2_wgmma_d128": [("pipelined_s3", 3)], "fa2_wgmma_d128_causal": [("pipelined_s3", 3)],
            "fa2_wgmma_d64": [("pipelined_s3", 3), ("pipelined_s4", 4)],
            "fa2_wgmma_d64_causal": [("pipelined_s3", 3), ("pipelined_s4", 4)]}
for name, variants in VARIANTS.items():
    base = load_spec(f"specs/{name}.tile")
    old = compile(base)
    old.source = (OLD / f"{old.name}.cu").read_text()
    kernels = {"waits": old}
    for label, stages in variants:
        kernels[label] = compile(dataclasses.replace(base, schedule=dataclasses.replace(base.schedule, stages=stages)))
    p = base.problem
    causal = p.mask.value == "causal"
    errs = {label: check(kern) for label, kern in kernels.items()}
    print(name, "errors", errs, flush=True)
    for n in (1024, 4096, 16384):
        b, h = prefill_shape(n, p.head_dim_qk)
        q, k, v = (torch.randn(b, h, n, p.head_dim_qk, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fl = attention_flops(b, h, n, n, p.head_dim_qk, causal)
        for rep in range(2):
            peers = {key: fl / t / 1e9 for key, t in sdpa_peers(q, k, v, causal).items() if isinstance(t, float)}
            res = {label: fl / time_ms(lambda: kern(q, k, v)) / 1e9 for label, kern in kernels.items()}
            rows.append({"kernel": name, "seqlen": n, "rep": rep, "tflops": res, "peers": peers, "errors": errs})
            print(f"{name:24s} N={n:5d} rep{rep} " + "  ".join(f"{k2} {v2:6.1f}" for k2, v2 in res.items())
                  + "  " + "  ".join(f"{k2} {v2:6.1f}" for k2, v2 in peers.items()), flush=True)
record(sys.argv[1], "python scratch/ab_wgmma_pipeline.py OUT", rows)
