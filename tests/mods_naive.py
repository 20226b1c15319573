"""Textbook attention with score and mask modifications, written apart from tiledsl's (one (batch, head)
at a time, the whole score matrix, each modification spelled out): what the float64 reference and the
tile classes are checked against, and what finite differences differentiate."""
from __future__ import annotations

import math

import numpy as np


def ids_from_bounds(bounds, length: int) -> np.ndarray:
    """Document id of each key position from cu_seqlens-like bounds; -1 outside every document."""
    out = np.full((len(bounds), length), -1, dtype=np.int64)
    for b, row in enumerate(bounds):
        for d in range(len(row) - 1):
            for t in range(int(row[d]), int(row[d + 1])):
                out[b, t] = d
    return out


def visible(b, h, nq, nk, kv_len, *, mask="none", window=(0, 0), documents=None, prefix=None, blocks=None,
            mask_fn=None) -> np.ndarray:
    """(nq, nk) booleans: which keys each query sees."""
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    off = kv_len - nq
    seen = np.broadcast_to(j < kv_len, (nq, nk)).copy()
    if mask == "causal":
        seen &= j <= i + off
    elif mask == "window":
        seen &= (j >= i + off - window[0]) & (j <= i + off + window[1])
    if documents is not None:
        pos = i + off
        query_doc = np.where((pos >= 0) & (pos < nk), documents[b][np.clip(pos, 0, nk - 1)], -2)
        seen &= (query_doc == documents[b][j]) & (documents[b][j] >= 0)
    if prefix is not None:
        seen &= (j <= i + off) | (j < prefix)
    if blocks is not None:
        table, block_q, block_kv = blocks
        seen &= table[min(b, table.shape[0] - 1), min(h, table.shape[1] - 1)][i // block_q, j // block_kv] != 0
    if mask_fn is not None:
        seen &= np.broadcast_to(mask_fn(b, h, i, j), (nq, nk))
    return seen


def attention(q, k, v, *, scale=None, kv_lens=None, softcap=None, slopes=None, score_fn=None, sinks=None,
              keep=None, **masks):
    """(o, lse) in float64. slopes (batch, heads): ALiBi; score_fn(s, b, h, i, j); sinks (heads,); keep
    (batch, heads, nq, nk): dropout's scaled keep mask; masks: visible()'s keywords."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, nq, d = q.shape
    nk, group = k.shape[2], heads // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    lens = [nk] * batch if kv_lens is None else list(kv_lens)
    o, lse = np.zeros((batch, heads, nq, v.shape[3])), np.full((batch, heads, nq), -np.inf)
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    for b in range(batch):
        off = lens[b] - nq
        for h in range(heads):
            s = scale * (q[b, h] @ k[b, h // group].T)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[b][h] * np.abs(i + off - j)
            if score_fn is not None:
                s = np.broadcast_to(score_fn(s, b, h, i, j), s.shape)
            s = np.where(visible(b, h, nq, nk, lens[b], **masks), s, -np.inf)
            top = s.max(axis=1)
            if sinks is not None:
                top = np.maximum(top, sinks[h])
            top = np.where(np.isfinite(top), top, 0.0)
            weights = np.exp(s - top[:, None])
            total = weights.sum(axis=1) + (np.exp(sinks[h] - top) if sinks is not None else 0.0)
            p = np.divide(weights, total[:, None], out=np.zeros_like(weights), where=total[:, None] > 0)
            if keep is not None:
                p = p * keep[b, h]
            o[b, h] = p @ v[b, h // group]
            lse[b, h] = np.where(total > 0, top + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return o, lse


def finite_difference_grads(loss, arrays, step=1e-6):
    """d loss / d each array by central differences (float64; loss of the arrays as given)."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        flat, gflat = x.reshape(-1), g.reshape(-1)
        for n in range(flat.size):
            keep = flat[n]
            flat[n] = keep + step
            up = loss()
            flat[n] = keep - step
            down = loss()
            flat[n] = keep
            gflat[n] = (up - down) / (2 * step)
        grads.append(g)
    return grads
