"""Float64 references for the serving layouts: a paged KV cache and variable-length (packed) batches.

Tensors are token-major, as serving frameworks hold them:
  paged   q (batch, queries, heads, d); k_cache (pages, page_size, kv_heads, d) and v_cache
          (..., dv); block_table int32 (batch, max pages per sequence); kv_lens int32 (batch,).
          Key t of sequence b is k_cache[block_table[b, t // page_size], t % page_size].
  varlen  q (total_q, heads, d), k (total_k, kv_heads, d), v (total_k, kv_heads, dv);
          cu_seqlens_q, cu_seqlens_k int32 (batch + 1,): sequence b is rows cu[b] : cu[b + 1].
Masks are aligned bottom-right per sequence (off = kv_len - q_len: causal shows key j to query
i iff j <= i + off), GQA query head h reads kv head h // (heads / kv_heads), and a query that
sees no key gets O = 0, LSE = -inf. The index tensors go through serving_checks first.

The score loop here is written apart from reference.naive_attention (one sequence at a time,
token-major, its own mask and softmax), so the tests that compare the two on gathered / padded
inputs compare two implementations.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..runtime.serving_checks import check_paged, check_varlen, host
from ..spec import Mask

QUERY_CHUNK = 256   # queries scored at a time: a 4k x 4k sequence stays a few MB per head


def gather_pages(cache, table_row, length: int) -> np.ndarray:
    """Keys (or values) 0..length-1 of one sequence, (length, kv_heads, dim), read through its
    block-table row: key t lies in page table_row[t // page_size] at slot t % page_size."""
    positions = np.arange(length)
    page_size = cache.shape[1]
    return np.asarray(cache, dtype=np.float64)[table_row[positions // page_size], positions % page_size]


def _visible(rows, keys: int, queries: int, mask: Mask, left: int, right: int):
    """(rows, keys) booleans: which keys each query row sees, bottom-right aligned."""
    diagonal = rows[:, None] + (keys - queries)
    cols = np.arange(keys)[None, :]
    if mask is Mask.CAUSAL:
        return cols <= diagonal
    if mask is Mask.WINDOW:
        return (cols >= diagonal - left) & (cols <= diagonal + right)
    return np.ones((len(rows), keys), dtype=bool)


def attend(q, k, v, mask: Mask | str = Mask.NONE, window_left: int = 0, window_right: int = 0,
           scale: float | None = None):
    """One sequence, token-major: q (nq, heads, d), k (nk, kv_heads, d), v (nk, kv_heads, dv) ->
    (o (nq, heads, dv), lse (nq, heads)) in float64."""
    mask = Mask(mask)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, heads, d = q.shape
    nk, kv_heads = k.shape[:2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = heads // kv_heads
    k = np.repeat(k, group, axis=1).transpose(1, 2, 0)   # (heads, d, nk)
    v = np.repeat(v, group, axis=1).transpose(1, 0, 2)   # (heads, nk, dv)
    q = q.transpose(1, 0, 2)                             # (heads, nq, d)
    o, lse = np.zeros((nq, heads, v.shape[2])), np.full((nq, heads), -np.inf)
    for r0 in range(0, nq if nk else 0, QUERY_CHUNK):
        rows = np.arange(r0, min(r0 + QUERY_CHUNK, nq))
        scores = (q[:, rows] @ k) * scale              # (heads, rows, nk)
        scores[:, ~_visible(rows, nk, nq, mask, window_left, window_right)] = -np.inf
        top = scores.max(axis=-1)
        top = np.where(np.isfinite(top), top, 0.0)     # a row that sees nothing: exp(-inf) = 0, no NaN
        weights = np.exp(scores - top[..., None])
        total = weights.sum(axis=-1)                   # (heads, rows)
        seen = total > 0
        acc = weights @ v
        o[rows] = np.where(seen[..., None], acc / np.where(seen, total, 1.0)[..., None], 0.0).transpose(1, 0, 2)
        lse[rows] = np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf).T
    return o, lse


def query_positions(trees, offset: int):
    """The tree decode's q_idx stands for in the expressions `trees`: query i's position i + offset (offset =
    kv_len - queries), read at 0 below it where an expression reads an aux tensor (the kernel's clamp, so a read
    stays in the table the launch checked; only a sequence shorter than its queries has such positions)."""
    from ..mods.expr import Aux, Const, Var, apply, reads
    at = apply("add", Var("q_idx"), Const(offset))
    if any(e is not None and reads(e, Aux) for e in trees):
        at = apply("max", at, Const(0))
    return at


# The built-in aux tensors whose first dimension is the batch: one sequence reads its own row.
_PER_SEQUENCE = ("document_ids", "document_bounds", "block_mask", "alibi_slopes")


def attend_modified(q, k, v, mods, b: int, aux: dict | None, mask: Mask | str = Mask.NONE, window_left: int = 0,
                    window_right: int = 0, scale: float | None = None, positions: bool = False):
    """attend() with score and mask modifications (mods/model.py) for sequence b of a batch: the
    modifications' `b` is this sequence's index, the batch-major aux tensors give it their row b, and
    the float64 graph executor (reference/forward.py) runs it as a batch of one. `positions`: the
    expressions' q_idx is each query's position in the sequence (query_positions), as decode gives it."""
    from ..mods.expr import Const, substitute
    from ..spec import KernelSpec, Problem, Schedule
    from .forward import reference_attention
    one = {"score_mod": mods.score_mod, "mask_mod": mods.mask_mod}
    mods = replace(mods, **{k: substitute(e, "b", Const(b)) for k, e in one.items() if e is not None})
    if positions:
        one = {"score_mod": mods.score_mod, "mask_mod": mods.mask_mod}
        at = query_positions(one.values(), k.shape[0] - q.shape[0])
        mods = replace(mods, **{k: substitute(e, "q_idx", at) for k, e in one.items() if e is not None})
    aux = dict(aux or {})
    for name in _PER_SEQUENCE:
        if name in aux and np.ndim(aux[name]) >= 2 and np.shape(aux[name])[0] > 1:
            aux[name] = np.asarray(aux[name])[b:b + 1]
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    problem = Problem(q.shape[2], v.shape[2], mask=Mask(mask), window_left=window_left, window_right=window_right,
                      softmax_scale=scale, mods=mods)
    spec = KernelSpec("sequence", problem, Schedule(tile_q=64, tile_kv=64))
    o, lse = reference_attention(spec, *(x.transpose(1, 0, 2)[None] for x in (q, k, v)), aux=aux)
    return o[0].transpose(1, 0, 2), lse[0].T


def paged_attention(q, k_cache, v_cache, block_table, kv_lens, mask: Mask | str = Mask.NONE,
                    window_left: int = 0, window_right: int = 0, scale: float | None = None, mods=None, aux=None):
    """Attention over a paged KV cache: (o (batch, queries, heads, dv), lse (batch, queries, heads)).
    `mods`, `aux`: score and mask modifications and their aux tensors (attend_modified); the expressions'
    q_idx is a query's position in its sequence (kv_len - queries + i: the queries are the sequence's last)."""
    q = np.asarray(host(q, "q"), dtype=np.float64)
    k_cache, v_cache = host(k_cache, "k_cache"), host(v_cache, "v_cache")
    if k_cache.ndim != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must be (pages, page size, kv heads, dim); got {k_cache.shape}, "
                         f"{v_cache.shape}")
    table, lens = check_paged(block_table, kv_lens, k_cache.shape[0], k_cache.shape[1])
    if q.ndim != 4 or q.shape[0] != table.shape[0]:
        raise ValueError(f"q must be (batch = {table.shape[0]}, queries, heads, d), got {q.shape}")
    batch, nq, heads, _ = q.shape
    o, lse = np.zeros((batch, nq, heads, v_cache.shape[3])), np.full((batch, nq, heads), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        keys, values = gather_pages(k_cache, table[b], n), gather_pages(v_cache, table[b], n)
        if mods is not None and mods.active:
            o[b], lse[b] = attend_modified(q[b], keys, values, mods, b, aux, mask, window_left, window_right, scale,
                                           positions=True)
        else:
            o[b], lse[b] = attend(q[b], keys, values, mask, window_left, window_right, scale)
    return o, lse


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, mask: Mask | str = Mask.NONE, window_left: int = 0,
                     window_right: int = 0, scale: float | None = None, mods=None, aux=None):
    """Attention over packed sequences: (o (total_q, heads, dv), lse (total_q, heads)). `mods`, `aux`:
    score and mask modifications and their aux tensors, b the sequence's index (attend_modified)."""
    q, k, v = (np.asarray(host(x, name), dtype=np.float64) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    check_varlen(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    cu_q, cu_k = host(cu_seqlens_q, "cu_seqlens_q"), host(cu_seqlens_k, "cu_seqlens_k")
    o, lse = np.zeros((q.shape[0], q.shape[1], v.shape[2])), np.full(q.shape[:2], -np.inf)
    for b in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if mods is not None and mods.active:
            o[rows], lse[rows] = attend_modified(q[rows], k[keys], v[keys], mods, b, aux, mask, window_left,
                                                 window_right, scale)
        else:
            o[rows], lse[rows] = attend(q[rows], k[keys], v[keys], mask, window_left, window_right, scale)
    return o, lse
