"""Training check: a small GPT trained with tiledsl.attention and with SDPA gives the same loss curve.

    python bench/train_check.py OUT.json [--steps 50] [--warp-specialized]   # the warp-specialized backward

The model: token + position embeddings, 2 pre-norm blocks (LayerNorm, causal self-attention with 8
heads of 64, LayerNorm, 4x GELU MLP), d_model 512, a final norm and an untied head; fp32 weights
under bf16 autocast (q, k, v reach attention in bf16, as (batch, heads, seq, 64) views of one
projection). The data, seeded: token t is a fixed permutation of token t - 2 (every 4th token
random), so lowering the loss takes attention. Batch 8, seq 512, AdamW (lr 3e-3), the same initial
weights and batches for every run. Runs: tiledsl.attention (causal), SDPA (default backend), and
SDPA's math backend, whose distance to SDPA is the noise floor: how far two correct bf16
attentions drift apart over the steps.

Bound: max over steps of |loss(tiledsl) - loss(SDPA)| <= max(4 x floor, 0.02); 0.02 (0.4% of the
initial loss, about ln 128) covers a floor that happens to be tiny (on the CPU, float32 attention
against SDPA drifted 0.0003 in 50 steps of a smaller model of this script). It is a coarse check:
in that CPU model a backward that zeroes dK of 16 of 128 keys moved the curve 0.05 by step 50,
but a dQ 10% too large only 0.002 (AdamW normalizes); the sharp gradient checks are
tests/test_gpu_autograd.py. Writes the curves, floor, bound, whether each run learned (final loss
under 0.9 x the first) and the verdict to OUT.json; exits 1 when the check fails.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB, D_MODEL, HEADS, SEQ, BATCH, LAYERS, LR, NOISE, LAG = 128, 512, 8, 512, 8, 2, 3e-3, 4, 2
FLOOR_FACTOR, MIN_BOUND, LEARN_RATIO = 4.0, 0.02, 0.9


def build(torch, attend):
    """The GPT with `attend(q, k, v)` ((batch, heads, seq, 64) each) as its attention."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
            self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
            x = x + self.proj(attend(q, k, v).transpose(1, 2).reshape(b, n, D_MODEL))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))
    return GPT()


def batches(torch, steps: int, seed: int = 1234):
    """`steps` batches of the task, the same for every run: token t is a fixed random permutation
    of token t - LAG (so predicting it takes attention to LAG back), except every NOISE-th token,
    which is random."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    step = torch.randperm(VOCAB, device="cuda", generator=gen)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen)
        for t in range(1, SEQ):
            if t % NOISE and t >= LAG:
                tokens[:, t] = step[tokens[:, t - LAG]]
        yield tokens


def train(torch, attend, steps: int, seed: int = 0) -> list[float]:
    """Loss per step of the GPT with `attend`, from the weights of `seed`."""
    torch.manual_seed(seed)
    model = build(torch, attend).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(torch, steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def attentions(torch) -> dict:
    import tiledsl
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def math_backend(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa(q, k, v, is_causal=True)
    return {"tiledsl": lambda q, k, v: tiledsl.attention(q, k, v, causal=True),
            "sdpa": lambda q, k, v: sdpa(q, k, v, is_causal=True), "sdpa_math": math_backend}


def run(steps: int) -> dict:
    """Train each run; the curves, the floor, the bound and whether the check passes."""
    import torch
    started = time.time()
    curves = {name: train(torch, attend, steps) for name, attend in attentions(torch).items()}
    difference = max(abs(a - b) for a, b in zip(curves["tiledsl"], curves["sdpa"]))
    floor = max(abs(a - b) for a, b in zip(curves["sdpa"], curves["sdpa_math"]))
    bound = max(FLOOR_FACTOR * floor, MIN_BOUND)
    learned = {name: c[-1] < LEARN_RATIO * c[0] for name, c in curves.items()}
    finite = all(math.isfinite(x) for c in curves.values() for x in c)
    return {"steps": steps, "curves": curves, "max_abs_difference": difference, "floor_sdpa_vs_math": floor,
            "bound": bound, "learned": learned,
            "passed": bool(finite and difference <= bound),
            "seconds": round(time.time() - started, 1),
            "config": dict(vocab=VOCAB, d_model=D_MODEL, heads=HEADS, seq=SEQ, batch=BATCH, layers=LAYERS, lr=LR,
                           dtype="bf16 autocast, fp32 weights", task=f"token t = permutation(token t - {LAG}), every {NOISE}th random")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warp-specialized", action="store_true",
                        help="turn tiledsl.dispatch.backward.BACKWARD_WS on for this run")
    args = parser.parse_args(argv)
    if args.warp_specialized:
        from tiledsl.dispatch import backward
        backward.BACKWARD_WS = True
    from tiledsl.tune.bench import record
    result = run(args.steps)
    for i, losses in enumerate(zip(*result["curves"].values())):
        print(f"step {i:3d}  " + "  ".join(f"{name} {x:.4f}" for name, x in zip(result["curves"], losses)))
    print(f"max |tiledsl - sdpa| {result['max_abs_difference']:.4f} (bound {result['bound']:.4f}; "
          f"sdpa vs math {result['floor_sdpa_vs_math']:.4f}); learned {result['learned']}; "
          f"{'PASS' if result['passed'] else 'FAIL'}", flush=True)
    rows = [{"kind": "train_check", **result}]
    record(args.out, "python bench/train_check.py " + " ".join(sys.argv[1:]), rows)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
