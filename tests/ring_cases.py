"""Shared by the ring tests (CPU threads, gloo processes) and bench/ring_check.py: one case's global inputs from
a seed, and the float64 full-attention answer the ring must reproduce."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    world: int
    layout: str = "zigzag"
    causal: bool = True
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    tokens: int = 48          # in the whole sequence
    head_dim: int = 16
    head_dim_v: int = 8
    scale: float | None = None

    def label(self) -> str:
        mask = "causal" if self.causal else "none"
        return (f"w{self.world}-{self.layout}-{mask}-b{self.batch}h{self.heads}kv{self.kv_heads}-n{self.tokens}"
                f"-d{self.head_dim}v{self.head_dim_v}" + (f"-s{self.scale}" if self.scale else ""))


def global_inputs(torch, case: Case, seed: int, dtype=None, device="cpu"):
    """q, k, v, do of the whole sequence (fresh normal values from `seed`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or torch.float64

    def make(heads, d):
        return torch.randn(case.batch, heads, case.tokens, d, generator=gen, dtype=dtype, device=device)
    return (make(case.heads, case.head_dim), make(case.kv_heads, case.head_dim), make(case.kv_heads, case.head_dim_v),
            make(case.heads, case.head_dim_v))


def full_attention(case: Case, q, k, v, do):
    """(O, LSE, dQ, dK, dV) of the whole sequence in float64 (tests/attention_reference.py: torch autograd)."""
    from tests import attention_reference as ref
    return ref.gradients(q, k, v, do, causal=case.causal, scale=case.scale)
