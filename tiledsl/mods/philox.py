"""Dropout's random numbers: Philox4x32-10 (Salmon et al., Random123), counter-based, so the backward
regenerates the forward's keep mask from (seed, offset) instead of storing it.

The weight of query i on key j in head h of batch entry b is dropped iff word j % 4 of
philox(key = (seed mod 2^32, seed div 2^32), counter = (j div 4, i, b * heads + h, offset mod 2^32))
is below p * 2^32 (rounded down); a kept weight is scaled by 1 / (1 - p). The kernels compute the same
words from the same counters; this module is their NumPy statement (uint64 arithmetic, vectorised).
"""
from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57         # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85         # the key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def philox4x32(counter, key):
    """Four uint32 words per counter: counter a tuple of 4 uint32 arrays (broadcast together), key a
    tuple of 2 ints. Returns a tuple of 4 uint32 arrays."""
    c = [np.asarray(x, dtype=np.uint64) & MASK32 for x in np.broadcast_arrays(*counter)]
    k0, k1 = int(key[0]) & MASK32, int(key[1]) & MASK32
    for round_ in range(ROUNDS):
        p0 = np.uint64(M0) * c[0]
        p1 = np.uint64(M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(MASK32)
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        if round_ < ROUNDS - 1:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return tuple(x.astype(np.uint32) for x in c)


def drop_threshold(p: float) -> int:
    """Words below this (uint32) drop their weight."""
    return min(int(p * 4294967296.0), MASK32)


def keep_mask(p: float, seed: int, offset: int, heads: int, b, h, rows, cols):
    """Booleans (broadcast of b, h, rows, cols): True where the weight of query `rows` on key `cols` of
    head h, batch entry b is kept."""
    b, h, rows, cols = (np.asarray(x, dtype=np.int64) for x in (b, h, rows, cols))
    words = philox4x32((cols >> 2, rows, b * heads + h, np.int64(offset) & MASK32),
                       (seed & MASK32, (seed >> 32) & MASK32))
    lane = (cols & 3)
    word = np.choose(np.broadcast_to(lane, np.broadcast(*words).shape), words)
    return word >= np.uint32(drop_threshold(p))
