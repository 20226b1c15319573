"""Mask geometry: which keys each query sees, and which (q tile, kv tile) pairs see anything.

Masks are aligned to the bottom-right corner (spec.Mask): with off = kv_len - q_len, causal shows
key j to query i iff j <= i + off, a window iff i + off - left <= j <= i + off + right. The
reference, the traffic model and the tuner's model all read these two functions."""
from __future__ import annotations

import numpy as np

from ..spec import Mask


def key_bounds(rows, q_len: int, kv_len, mask: Mask | str, left: int = 0, right: int = 0):
    """[lo, hi) of the keys that query `rows` see (broadcast over rows and kv_len); hi == lo when
    a row sees none. Both bounds never decrease with the row, so rows [a, b) together see
    [lo(a), hi(b - 1)) when that is not empty."""
    mask = Mask(mask)
    rows, kv_len = np.asarray(rows), np.asarray(kv_len)
    diagonal = rows + (kv_len - q_len)
    lo = np.zeros(np.broadcast(rows, kv_len).shape, dtype=np.int64)
    hi = np.broadcast_to(kv_len, lo.shape).astype(np.int64)
    if mask is Mask.CAUSAL:
        hi = np.minimum(hi, diagonal + 1)
    elif mask is Mask.WINDOW:
        lo = np.maximum(lo, diagonal - left)
        hi = np.minimum(hi, diagonal + right + 1)
    return lo, np.maximum(hi, lo)


def tiles_visible(q_starts, q_stops, k_starts, k_stops, q_len, kv_len, mask, left=0, right=0):
    """Whether any query of each q tile sees any key of each kv tile: a (q tiles, kv tiles) array."""
    lo, _ = key_bounds(np.asarray(q_starts), q_len, kv_len, mask, left, right)
    _, hi = key_bounds(np.asarray(q_stops) - 1, q_len, kv_len, mask, left, right)
    first = np.maximum(lo[:, None], np.asarray(k_starts)[None, :])
    last = np.minimum(hi[:, None], np.asarray(k_stops)[None, :])
    return first < last
