"""Context-parallel (ring) attention: each rank holds a shard of the sequence's queries, keys and values, the
K/V shards travel around the ring, and each rank attends its queries to every shard as it passes, merging
the partial (O, LSE) pairs exactly (merge.py). The backward passes K/V the other way with the dK/dV sums of
each shard travelling beside it; dQ stays local. Which block each rank computes at each step is steps.py's.

    o = ring_attention(q, k, v, causal=True)            # q, k, v: this rank's shards (shards.shard)

`ring_forward` and `ring_backward` are the two passes without autograd (a ring of threads on one GPU calls
them directly: torch's autograd runs every CUDA backward on one worker thread, which would serialize them)."""
from __future__ import annotations

from ..errors import RuntimeInputError
from .blocks import blocks_for
from .shards import check_layout, chunks_per_rank
from .steps import BACKWARD, FORWARD, block, source_rank

SHAPE_FIELDS = ("batch", "heads", "kv_heads", "tokens", "head_dim", "head_dim_v")


def check_shards(q, k, v, ring, layout: str, check_ranks: bool = True) -> None:
    """Refuse, naming the tensor, what the ring cannot run: shapes that disagree with each other or with
    another rank's, a zigzag shard of odd length, mixed dtypes or devices."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise RuntimeInputError(f"ring_attention: {name} must be 4-d (batch, heads, seqlen, head_dim), "
                                    f"got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise RuntimeInputError(f"ring_attention: {name} is {x.dtype} on {x.device}, q {q.dtype} on {q.device}")
    batch, heads, tokens, d = q.shape
    if k.shape[0] != batch or k.shape[2] != tokens or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise RuntimeInputError(f"ring_attention: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                f"v {tuple(v.shape)} (a rank's q, k and v shards cover the same tokens)")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise RuntimeInputError(f"ring_attention: {heads} query heads are not a multiple of {k.shape[1]} kv heads")
    if tokens % chunks_per_rank(layout):
        raise RuntimeInputError(f"ring_attention: q has {tokens} tokens on rank {ring.rank}; a zigzag shard holds "
                                f"two equal chunks (tiledsl.distributed.shard cuts them)")
    if not check_ranks or ring.world == 1:
        return
    mine = [batch, heads, k.shape[1], tokens, d, v.shape[3]]
    everyone = ring.all_equal(mine, q.device)
    for field, i in zip(SHAPE_FIELDS, range(len(mine))):
        values = [shape[i] for shape in everyone]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(values))
            hint = (" (uneven shards: cut the sequence with tiledsl.distributed.shard, after padding it to a "
                    "multiple of 2 x ranks for zigzag)" if field == "tokens" else "")
            raise RuntimeInputError(f"ring_attention: the ranks' shards differ in {field} ({listed}); every rank "
                                    f"must hold an equal shard{hint}")


def ring_forward(q, k, v, ring, causal: bool = False, layout: str = "zigzag", scale=None, blocks=None):
    """(O accumulator, LSE) of this rank's queries over the whole ring, in the engine's accumulator dtype
    (fp32 for kernels, float64 for the reference)."""
    import torch
    blocks = blocks_for(q, blocks)
    rank, world, tokens = ring.rank, ring.world, q.shape[2]
    o_acc = lse_acc = None
    kv = (k, v)
    for step in range(world):
        incoming = ring.exchange(kv, FORWARD, "kv") if step + 1 < world else None
        work = block(rank, source_rank(rank, world, step, FORWARD), world, tokens, layout, causal)
        if work is not None:
            o, lse = blocks.forward(q[:, :, work.q_start:work.q_stop], kv[0][:, :, work.kv_start:work.kv_stop],
                                    kv[1][:, :, work.kv_start:work.kv_stop], work.causal, scale)
            if o_acc is None:   # step 0, the diagonal block: every query row
                o_acc = o.to(blocks.accumulator_dtype(torch)).contiguous()
                lse_acc = lse.to(blocks.accumulator_dtype(torch)).contiguous()
            else:
                blocks.merge(o_acc, lse_acc, o, lse, work.q_start)
        if incoming is not None:
            kv = incoming.wait()
    return o_acc, lse_acc


def ring_backward(q, k, v, o, lse, do, ring, causal: bool = False, layout: str = "zigzag", scale=None,
                  blocks=None):
    """(dQ, dK, dV) of this rank's shards, in the engine's accumulator dtype. o and lse are the forward's
    final ones (o in q's dtype, as the forward returned it)."""
    import torch
    blocks = blocks_for(q, blocks)
    rank, world, tokens = ring.rank, ring.world, q.shape[2]
    acc = blocks.accumulator_dtype(torch)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, sums = (k, v), None
    for step in range(world):
        incoming = ring.exchange(kv, BACKWARD, "kv") if step + 1 < world else None
        work = block(rank, source_rank(rank, world, step, BACKWARD), world, tokens, layout, causal)
        grads = None
        if work is not None:
            rows, keys = slice(work.q_start, work.q_stop), slice(work.kv_start, work.kv_stop)
            grads = blocks.backward(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], o[:, :, rows],
                                    lse[:, :, rows], do[:, :, rows], work.causal, scale)
        # the held shard's dK, dV sums so far: zeros at step 0 (own shard), else from the rank before
        dk, dv = ((torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
                  if sums is None else sums.wait())
        if grads is not None:
            dq[:, :, rows] += grads[0]
            dk[:, :, keys] += grads[1]
            dv[:, :, keys] += grads[2]
        sums = ring.exchange((dk, dv), BACKWARD, "dkv")   # on to the next holder; the last hop brings it home
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = sums.wait()
    return dq, dk, dv


def _ring_of(group):
    if hasattr(group, "exchange"):   # a LocalRing endpoint (or another ring object)
        return group
    from .comm import TorchRing
    return TorchRing(group)


def _autograd_function(torch):
    class RingAttention(torch.autograd.Function):
        """ring_forward, saving q, k, v, O and the LSE; ring_backward (the LSE is a constant)."""

        @staticmethod
        def forward(ctx, q, k, v, ring, causal, layout, scale, blocks):
            o_acc, lse = ring_forward(q, k, v, ring, causal, layout, scale, blocks)
            o = o_acc.to(q.dtype)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.settings = (ring, causal, layout, scale, blocks)
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, do, _lse_grad):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = ring_backward(q, k, v, o, lse, do.contiguous(), *ctx.settings)
            return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * len(ctx.settings)
    return RingAttention


_FUNCTION = None


def ring_attention(q, k, v, group=None, causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                   return_lse: bool = False, blocks=None, check_ranks: bool = True):
    """Attention of this rank's query shard over the whole sequence, its keys and values spread over the
    ranks of `group` (a torch.distributed process group; None: the default group; or a LocalRing endpoint).

    q (batch, heads, tokens, d), k and v (batch, kv_heads, tokens, d / dv): this rank's shards, cut with
    tiledsl.distributed.shard in `layout` order ("zigzag": chunks r and 2W-1-r, balanced under a causal mask;
    "contiguous": chunk r), the same length on every rank. `causal` masks by global position; heads a multiple
    of kv_heads (GQA). Returns O (q's dtype; differentiable), or (O, LSE) with return_lse (LSE of the full
    rows, natural log, a constant). CUDA tensors (fp16 / bf16) run tiledsl's kernels per block and the
    generated merge; CPU tensors run the float64 reference (`blocks` picks: "kernels" / "reference").
    `check_ranks` gathers every rank's shapes once per call to refuse uneven shards (one small all-gather)."""
    global _FUNCTION
    import torch
    check_layout(layout)
    ring = _ring_of(group)
    check_shards(q, k, v, ring, layout, check_ranks)
    engine = blocks_for(q, blocks)
    if _FUNCTION is None:
        _FUNCTION = _autograd_function(torch)
    o, lse = _FUNCTION.apply(q, k, v, ring, bool(causal), layout, None if scale is None else float(scale), engine)
    return (o, lse) if return_lse else o
