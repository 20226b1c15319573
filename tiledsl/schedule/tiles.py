"""Which (q tile, kv tile) pairs a spec's masks make empty, full or partial, per batch entry and head.

EMPTY tiles are skipped (no load, no MMA), FULL tiles run without per-element mask work, PARTIAL tiles
compute the mask element by element. A mask is the conjunction of kv_len, the spec's none / causal /
window, and the modifications' terms (mods/model.py); each term classifies a tile on its own and the
tile's class is the least of them (EMPTY < PARTIAL < FULL):
  kv_len, causal, window, prefix(n)   from the indices alone (masks.key_bounds: bounds rise with the row)
  mask_mod                            interval analysis of its expression over the tile's box (exact for
                                      sums and differences of indices against constants); aux reads from
                                      the tables' values over the box when they are given
  document, blocks                    from the aux tensors (per tile: the range of document ids of its
                                      queries and of its keys; the block_mask entries it covers)
Without the aux tensors (explain), the data-dependent terms are PARTIAL: decided per tile at run time.
Every class here is sound: a FULL tile has every element visible, an EMPTY one none (the float64
reference trusts them as the kernels do, so a wrong one shows up against the naive reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mods.expr import Aux, Var, reads
from ..mods.intervals import interval, truth
from ..mods.model import AUX_BLOCK_MASK, AUX_DOCUMENT_IDS, Modifications
from ..spec import Problem
from .masks import key_bounds

EMPTY, PARTIAL, FULL = 0, 1, 2
CLASS_NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}


@dataclass(frozen=True)
class Tiling:
    q_len: int
    kv_len: int            # keys per sequence as laid out (kv_lens may shorten each)
    tile_q: int
    tile_kv: int

    def q_tiles(self) -> np.ndarray:
        return np.arange(0, self.q_len, self.tile_q)

    def kv_tiles(self) -> np.ndarray:
        return np.arange(0, self.kv_len, self.tile_kv)


def classify(problem: Problem, tiling: Tiling, batch: int, heads: int, kv_lens=None, aux: dict | None = None):
    """(batch, heads, q tiles, kv tiles) int8 array of EMPTY / PARTIAL / FULL. `aux`: the prepared aux
    tensors (mods/checks.prepare_aux), or None to leave the data-dependent terms PARTIAL."""
    lens = np.full(batch, tiling.kv_len, dtype=np.int64) if kv_lens is None else np.asarray(kv_lens, np.int64)
    q0 = tiling.q_tiles()
    q1 = np.minimum(q0 + tiling.tile_q, tiling.q_len)
    k0 = tiling.kv_tiles()
    k1 = np.minimum(k0 + tiling.tile_kv, tiling.kv_len)
    classes = np.full((batch, heads, len(q0), len(k0)), FULL, dtype=np.int8)
    terms = [_base(problem, tiling, lens, q0, q1, k0, k1)[:, None]]
    mods = problem.mods
    if mods.prefix is not None:
        terms.append(_prefix(mods.prefix, tiling, lens, q0, q1, k0, k1)[:, None])
    if mods.mask_mod is not None:
        terms.append(_mask_mod(mods, tiling, lens, heads, q0, q1, k0, k1, aux))
    for name, term in ((AUX_DOCUMENT_IDS, _documents), (AUX_BLOCK_MASK, _blocks)):
        if (name == AUX_DOCUMENT_IDS and mods.document is None) or (name == AUX_BLOCK_MASK and mods.blocks is None):
            continue
        terms.append(term(mods, tiling, lens, q0, q1, k0, k1, aux[name]) if aux is not None
                     else np.full((1, 1, 1, 1), PARTIAL, dtype=np.int8))
    for term in terms:
        np.minimum(classes, term, out=classes)
    return classes


def _classes(full, empty) -> np.ndarray:
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


def _base(problem: Problem, tiling: Tiling, lens, q0, q1, k0, k1):
    """(batch, q tiles, kv tiles): kv_len and none / causal / window (rows' key bounds rise with the row)."""
    mask, left, right = problem.mask, problem.window_left, problem.window_right
    lo_first, hi_first = key_bounds(q0[None, :], tiling.q_len, lens[:, None], mask, left, right)
    lo_last, hi_last = key_bounds(q1[None, :] - 1, tiling.q_len, lens[:, None], mask, left, right)
    full = (lo_last[:, :, None] <= k0[None, None, :]) & (hi_first[:, :, None] >= k1[None, None, :])
    # every row's keys empty, or the tile outside [lo(first row), hi(last row))
    first = np.maximum(lo_first[:, :, None], k0[None, None, :])
    last = np.minimum(hi_last[:, :, None], k1[None, None, :])
    empty = first >= last
    return _classes(full, empty)


def _prefix(n: int, tiling: Tiling, lens, q0, q1, k0, k1):
    """prefix(n): key j is visible to the query at position p iff j <= p or j < n."""
    off = (lens - tiling.q_len)[:, None, None]
    first_pos, last_pos = q0[None, :, None] + off, q1[None, :, None] - 1 + off
    full = (k1[None, None, :] <= n) | (k1[None, None, :] - 1 <= first_pos)
    empty = (k0[None, None, :] >= n) & (k0[None, None, :] > last_pos)
    return _classes(full, empty)


def _per(expr, name: str) -> bool:
    return any(v.name == name for v in reads(expr, Var))


def _mask_mod(mods: Modifications, tiling: Tiling, lens, heads, q0, q1, k0, k1, aux):
    """Interval analysis of mask_mod over each tile's box, per batch entry and head where it reads them."""
    expr = mods.mask_mod
    per_b = _per(expr, "b") or _per(expr, "kv_len") or bool(reads(expr, Aux) and aux is not None)
    per_h = _per(expr, "h")
    batches = range(len(lens)) if per_b else [None]
    head_list = range(heads) if per_h else [None]
    out = np.empty((len(batches), len(head_list), len(q0), len(k0)), dtype=np.int8)
    for bi, b in enumerate(batches):
        lens_b = (int(lens.min()), int(lens.max())) if b is None else (int(lens[b]),) * 2
        for hi_, h in enumerate(head_list):
            env = {"b": (0, len(lens) - 1) if b is None else (b, b), "h": (0, heads - 1) if h is None else (h, h),
                   "q_len": (tiling.q_len, tiling.q_len), "kv_len": lens_b}
            for i, (a, z) in enumerate(zip(q0, q1)):
                for j, (c, e) in enumerate(zip(k0, k1)):
                    box = {**env, "q_idx": (int(a), int(z) - 1), "kv_idx": (int(c), int(e) - 1)}
                    answer = truth(interval(expr, box, _table_range(aux) if aux is not None else None))
                    out[bi, hi_, i, j] = {"always": FULL, "never": EMPTY}.get(answer, PARTIAL)
    return out


def _table_range(aux: dict):
    """aux_range for interval(): the min and max of an aux table over the index box (clipped to it)."""
    def value_range(node, index_ranges):
        table = aux[node.name]
        box = []
        for (lo, hi, *_), size in zip(index_ranges, table.shape):
            lo, hi = max(int(max(lo, 0)), 0), min(int(min(hi, size - 1)), size - 1)
            if lo > hi:
                return None
            box.append(slice(lo, hi + 1))
        part = table[tuple(box)]
        return (int(part.min()), int(part.max())) if part.size else None
    return value_range


def _documents(mods: Modifications, tiling: Tiling, lens, q0, q1, k0, k1, ids):
    """(batch, 1, q tiles, kv tiles) from each tile's range of document ids: FULL when its queries and
    keys all lie in one document, EMPTY when their id ranges are disjoint."""
    ids = np.asarray(ids, dtype=np.int64)
    batch, nk = ids.shape
    out = np.empty((batch, 1, len(q0), len(k0)), dtype=np.int8)
    for b in range(batch):
        off = int(lens[b]) - tiling.q_len
        key_lo = [ids[b, c:e].min() for c, e in zip(k0, k1)]
        key_hi = [ids[b, c:e].max() for c, e in zip(k0, k1)]
        for i, (a, z) in enumerate(zip(q0, q1)):
            pos = np.arange(a, z) + off
            inside = (pos >= 0) & (pos < nk)
            docs = np.where(inside, ids[b, np.clip(pos, 0, nk - 1)], -2)   # -2: in no document
            q_lo, q_hi = docs.min(), docs.max()
            for j in range(len(k0)):
                one = q_lo == q_hi == key_lo[j] == key_hi[j] and q_lo >= 0
                disjoint = q_hi < key_lo[j] or key_hi[j] < q_lo or key_hi[j] < 0
                out[b, 0, i, j] = FULL if one else EMPTY if disjoint else PARTIAL
    return out


def _blocks(mods: Modifications, tiling: Tiling, lens, q0, q1, k0, k1, table):
    """(batch or 1, heads or 1, q tiles, kv tiles) from the block_mask entries each tile covers."""
    table = np.asarray(table) != 0
    block_q, block_kv = mods.blocks
    out = np.empty(table.shape[:2] + (len(q0), len(k0)), dtype=np.int8)
    for i, (a, z) in enumerate(zip(q0, q1)):
        rows = slice(a // block_q, (z - 1) // block_q + 1)
        for j, (c, e) in enumerate(zip(k0, k1)):
            covered = table[:, :, rows, c // block_kv:(e - 1) // block_kv + 1]
            out[:, :, i, j] = _classes(covered.all(axis=(2, 3)), ~covered.any(axis=(2, 3)))
    return out


def counts(classes) -> dict[str, int]:
    """How many (batch, head, q tile, kv tile) are empty, partial and full."""
    return {CLASS_NAMES[c]: int((np.asarray(classes) == c).sum()) for c in (EMPTY, PARTIAL, FULL)}


def data_dependent(mods: Modifications) -> list[str]:
    """The mask terms whose classes come from aux data (PARTIAL without it)."""
    terms = [t for t, on in (("document", mods.document is not None), ("blocks", mods.blocks is not None)) if on]
    if mods.mask_mod is not None and reads(mods.mask_mod, Aux):
        terms.append("mask_mod's aux reads")
    return terms

