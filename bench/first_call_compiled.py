"""A model's very first tiledsl.attention call inside torch.compile(fullgraph=True), in a fresh process (nothing of
tiledsl's dispatch imported before the trace), unmodified and with softcap + sinks, forward and backward:

    python bench/first_call_compiled.py [softcap]

Prints "ok" with the gradients' finiteness; a trace that breaks raises."""
import sys

import torch

import tiledsl


def main(argv) -> int:
    modified = "softcap" in argv[1:]
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    keywords = dict(softcap=20.0, sinks=sinks) if modified else {}

    @torch.compile(fullgraph=True)
    def loss(q, k, v):
        return tiledsl.attention(q, k, v, causal=True, **keywords).float().square().sum()
    loss(q, k, v).backward()
    grads = [q.grad, k.grad, v.grad] + ([sinks.grad] if modified else [])
    print("ok", all(bool(torch.isfinite(g).all()) for g in grads))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
