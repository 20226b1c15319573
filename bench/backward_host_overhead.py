"""Where the backward's time goes at small shapes (1k tokens per sequence, 16 sequences): the
module's kernels called directly (BackwardKernel), attention_backward (the public function: spec
lookup, input checks, launches), and torch.autograd through tiledsl.attention (the custom op),
each the median of tiledsl.tune.bench.time_ms; printed, and written as JSON when OUT is given.

    python bench/backward_host_overhead.py [OUT.json]
"""
from __future__ import annotations

import json
import sys


def main() -> int:
    import torch
    import tiledsl
    from tiledsl.dispatch.backward import attention_backward, chosen_backward_spec
    from tiledsl.dispatch.kernels import BACKWARD, kernel_for
    from tiledsl.tune.bench import time_ms
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    rows = []
    for d, causal in ((64, True), (128, True), (128, False)):
        heads, n, batch = 2048 // d, 1024, 16
        q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = tiledsl.attention(q, k, v, causal=causal, return_lse=True)
        kern = kernel_for(chosen_backward_spec(device_arch(), DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE),
                          BACKWARD)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = tiledsl.attention(qg, kg, vg, causal=causal)
        row = {"head_dim": d, "causal": causal, "seqlen": n, "batch": batch, "kernel": kern.name,
               "kernels_ms": time_ms(lambda: kern(q, k, v, o, lse, do)),
               "attention_backward_ms": time_ms(lambda: attention_backward(q, k, v, o, lse, do, causal=causal)),
               "autograd_backward_ms": time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
