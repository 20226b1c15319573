"""Block-sparse attention on the H200: tiledsl's block_mask against FlexAttention with the same BlockMask, same run.

    python bench/blocksparse_bench.py OUT.json [--seqlens 4096 16384] [--patterns random25 local_global]

Rows (tiledsl.tune.bench.record): mod "blocks", pattern (random25: each (batch, head) its own table, every
128 x 128 block kept with probability 0.25; local_global: one table for all, each q block sees its own and the
LOCAL_BLOCKS blocks before and after it, the first GLOBAL_BLOCKS kv blocks, and the first GLOBAL_BLOCKS q blocks
see everything), density (the kept share of blocks), pass (forward / backward), head_dim 128, seqlen, causal
false, bf16, tflops over the kept blocks' (query, key) pairs (4 d per pair forward, 2.5x that backward, the
backward's time that of forward + backward minus forward: FlashAttention's convention), and peers measured in the
same run: flex (torch.nn.attention.flex_attention compiled, given a BlockMask of the same blocks, all full: no
mask_mod evaluated), none (tiledsl's unmodified kernel at the shape, over its dense pairs), blockmask_input
(tiledsl given the Flex BlockMask itself: its device conversion to the table included; forward only).
tiledsl is timed with the int32 table. Before anything is timed each pattern's tiledsl forward and backward are
checked against the float64 reference (batch 1, heads 2, 1000 tokens, fresh inputs) and the BlockMask input
against the table's output; a failed check records `error` and the row is not timed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import tiledsl
from tiledsl.tune.bench import attention_flops, prefill_shape, record, time_ms

HEAD_DIM, BLOCK, DENSITY = 128, 128, 0.25
LOCAL_BLOCKS, GLOBAL_BLOCKS = 2, 1
PATTERNS = ("random25", "local_global")


def table_for(pattern: str, batch: int, heads: int, n: int, generator=None) -> torch.Tensor:
    """The int32 block table (batch or 1, heads or 1, q blocks, kv blocks) of `pattern` for n tokens."""
    blocks = -(-n // BLOCK)
    if pattern == "random25":
        return (torch.rand(batch, heads, blocks, blocks, device="cuda", generator=generator) < DENSITY).int()
    i = torch.arange(blocks, device="cuda")
    local = (i[:, None] - i[None, :]).abs() <= LOCAL_BLOCKS
    keep = local | (i[None, :] < GLOBAL_BLOCKS) | (i[:, None] < GLOBAL_BLOCKS)
    return keep.int()[None, None].contiguous()


def flex_block_mask(table: torch.Tensor, n: int):
    """A FlexAttention BlockMask whose blocks are the table's nonzero entries, every one full (noop mask_mod)."""
    from torch.nn.attention.flex_attention import BlockMask
    counts = table.sum(-1).to(torch.int32)
    indices = torch.argsort(table, dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(torch.zeros_like(counts), indices, counts, indices, BLOCK_SIZE=BLOCK,
                                    seq_lengths=(n, n))


def visible_pairs(table: torch.Tensor, batch: int, heads: int, n: int) -> float:
    """(query, key) pairs inside the kept blocks, the last block row and column clipped to n."""
    blocks = table.shape[-1]
    size = torch.full((blocks,), BLOCK, dtype=torch.float64, device=table.device)
    size[-1] = n - BLOCK * (blocks - 1)
    per = (table.double() * size[:, None] * size[None, :]).sum(dim=(-1, -2))   # per (batch or 1, heads or 1)
    return float(per.sum()) * (batch // table.shape[0]) * (heads // table.shape[1])


def check(pattern: str) -> str:
    """"" when tiledsl's forward, its backward and the BlockMask input match (the module docstring), else why."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    from tiledsl.spec import DType, Mask
    batch, heads, n = 1, 2, 1000
    q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    table = table_for(pattern, batch, heads, n)
    try:
        o = tiledsl.attention(q, k, v, block_mask=table)
        o.backward(do)
        with torch.no_grad():
            from_flex = tiledsl.attention(q, k, v, block_mask=flex_block_mask(table, n))
    except Exception as err:   # recorded, not timed
        return str(err).splitlines()[0][:300]
    if not torch.equal(o.detach(), from_flex):
        return "wrong: the BlockMask input's output differs from the table's"
    mods, _ = modifications("attention", block_mask=table)
    spec = chosen_backward_spec("sm_90a", DType.BF16, HEAD_DIM, Mask.NONE, HEAD_DIM, mods=mods)
    aux = {"block_mask": table.cpu().numpy()}
    inputs = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    o64, lse64 = reference_attention(spec, *inputs, aux=aux)
    ref = reference_backward(spec, *inputs, do.double().cpu().numpy(), o64, lse64, aux=aux)
    errors = [float(np.linalg.norm(g.detach().double().cpu().numpy() - r) / np.linalg.norm(r))
              for g, r in zip((o, q.grad, k.grad, v.grad), (o64, *ref))]
    return "" if max(errors) < 1e-2 else f"wrong: normwise O, dQ, dK, dV errors {errors} against float64"


def timed(fn, inputs, backward: bool = True):
    """(forward ms, forward + backward ms or None)."""
    with torch.no_grad():
        forward = time_ms(fn)
    if not backward:
        return forward, None
    grad = torch.randn_like(fn())

    def step():
        for x in inputs:
            x.grad = None
        fn().backward(grad)
    return forward, time_ms(step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    args = parser.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    checks = {pattern: check(pattern) for pattern in args.patterns}
    rows = []

    def save():
        record(Path(args.out), "python bench/blocksparse_bench.py " + " ".join(argv), rows, checks=checks)
    for n in args.seqlens:
        batch, heads = prefill_shape(n, HEAD_DIM)
        q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dense_flops = attention_flops(batch, heads, n, n, HEAD_DIM, False)
        dense = timed(lambda: tiledsl.attention(q, k, v), (q, k, v))
        for pattern in args.patterns:
            table = table_for(pattern, batch, heads, n)
            # Flex's BlockMask per (batch, head) for every pattern: one shape per seqlen, so one compile
            block_mask = flex_block_mask(table.expand(batch, heads, -1, -1).contiguous(), n)
            flops = 4.0 * HEAD_DIM * visible_pairs(table, batch, heads, n)
            times = {"flex": timed(lambda: flex(q, k, v, block_mask=block_mask), (q, k, v)),
                     "none": dense}
            if not checks[pattern]:
                times["tiledsl"] = timed(lambda: tiledsl.attention(q, k, v, block_mask=table), (q, k, v))
                times["blockmask_input"] = timed(lambda: tiledsl.attention(q, k, v, block_mask=block_mask), (),
                                                 backward=False)
            for pass_ in ("forward", "backward"):
                def tflops(name):
                    t = times.get(name)
                    if t is None or (pass_ == "backward" and t[1] is None):
                        return None
                    ms = t[0] if pass_ == "forward" else t[1] - t[0]
                    work = dense_flops if name == "none" else flops
                    return (work if pass_ == "forward" else 2.5 * work) / (ms * 1e-3) / 1e12
                rows.append({"kernel": f"tiledsl_blocks_{pattern}", "family": "hopper" if pass_ == "forward"
                             else "backward_ws", "dtype": "bf16", "mod": "blocks", "pattern": pattern,
                             "density": float(table.float().mean()), "pass": pass_, "head_dim": HEAD_DIM,
                             "seqlen": n, "causal": False, "batch": batch, "heads": heads,
                             "tflops": tflops("tiledsl"), "error": checks[pattern] or None,
                             "flops": "kept blocks' pairs (none: dense)",
                             "ms": {name: t[0] if pass_ == "forward" else (None if t[1] is None else t[1] - t[0])
                                    for name, t in times.items()},
                             "peers": {"flex": tflops("flex"), "none": tflops("none"),
                                       "blockmask_input": tflops("blockmask_input")}})
                print(rows[-1], flush=True)
                save()   # after every row: a run cut short keeps what it measured
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
