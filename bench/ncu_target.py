"""One attention call inside a CUDA profiler range, for Nsight Compute to capture the kernel alone.

    python bench/ncu_target.py {e4m3|bf16} HEAD_DIM SEQLEN {none|causal} [softcap=N]

16k tokens (batch 16384 / SEQLEN), 16 heads, through tiledsl.attention (e4m3: quantize_fp8 per tensor first).
The call runs once outside the range (compiles), then once inside: run it under
`ncu --profile-from-start off --set full -o REPORT python bench/ncu_target.py ...`.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__)
        return 2
    import torch
    import tiledsl
    dtype, d, seqlen, causal = argv[1], int(argv[2]), int(argv[3]), argv[4] == "causal"
    extra = dict(a.split("=") for a in argv[5:])
    batch, heads = 16384 // seqlen, 16
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda").to(torch.bfloat16) for _ in range(3))
    if dtype == "e4m3":
        q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)

        def call():
            return tiledsl.attention(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
    elif "softcap" in extra:
        cap = float(extra["softcap"])

        def call():
            return tiledsl.attention(q, k, v, causal=causal, softcap=cap)
    else:
        def call():
            return tiledsl.attention(q, k, v, causal=causal)
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
