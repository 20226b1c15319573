"""The modifications of mods/model.py elementwise, in NumPy float64: what the float64 reference
(reference/forward.py, backward.py) and the tile classification (schedule/tiles.py) compute.

A grid is the (b, h, q_idx, kv_idx) coordinates of a block of scores as arrays that broadcast to
(batch, heads, rows, cols), with kv_len per batch entry and q_len; `aux` holds the aux tensors as
mods/checks.prepare_aux leaves them (float64 / int64 NumPy arrays, ALiBi slopes (batch, heads)).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .expr import Aux, Const, Expr, Type, Var
from .model import AUX_BLOCK_MASK, AUX_DOCUMENT_IDS, AUX_DROPOUT, Modifications
from .philox import keep_mask


@dataclass(frozen=True)
class Grid:
    b: np.ndarray          # (batch, 1, 1, 1)
    h: np.ndarray          # (1, heads, 1, 1)
    q_idx: np.ndarray      # (1, 1, rows, 1)
    kv_idx: np.ndarray     # (1, 1, 1, cols)
    kv_len: np.ndarray     # (batch, 1, 1, 1)
    q_len: int

    @property
    def heads(self) -> int:
        return self.h.shape[1]

    def env(self) -> dict:
        return {"b": self.b, "h": self.h, "q_idx": self.q_idx, "kv_idx": self.kv_idx, "kv_len": self.kv_len,
                "q_len": np.int64(self.q_len)}


def grid(batch: int, heads: int, rows, cols, kv_lens, q_len: int) -> Grid:
    """The grid of query rows `rows` and keys `cols` (index arrays) over every batch entry and head."""
    return Grid(np.arange(batch).reshape(-1, 1, 1, 1), np.arange(heads).reshape(1, -1, 1, 1),
                np.asarray(rows, dtype=np.int64).reshape(1, 1, -1, 1),
                np.asarray(cols, dtype=np.int64).reshape(1, 1, 1, -1),
                np.asarray(kv_lens, dtype=np.int64).reshape(-1, 1, 1, 1), int(q_len))


_UNARY = {"neg": np.negative, "abs": np.abs, "floor": np.floor, "ceil": np.ceil, "tanh": np.tanh, "exp": np.exp,
          "log": np.log, "sqrt": np.sqrt, "sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)), "not": np.logical_not}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
           "floordiv": np.floor_divide, "mod": np.mod, "min": np.minimum, "max": np.maximum,
           "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
           "ge": np.greater_equal, "and": np.logical_and, "or": np.logical_or}


def evaluate(expr: Expr, env: dict, aux: dict):
    """The tree's value at every point of `env` (name -> array; all broadcast together). Ints are
    int64 here (the checks refuse launches whose ints could leave int32); an aux read outside its
    tensor is an IndexError, never a wrapped read."""
    if isinstance(expr, Const):
        return np.float64(expr.value) if expr.type is Type.FLOAT else np.asarray(expr.value)
    if isinstance(expr, Var):
        return env[expr.name]
    if isinstance(expr, Aux):
        table = aux[expr.name]
        indices = [np.asarray(evaluate(i, env, aux), dtype=np.int64) for i in expr.indices]
        for axis, (index, size) in enumerate(zip(indices, table.shape)):
            if index.size and (index.min() < 0 or index.max() >= size):
                raise IndexError(f"{expr.name}[...] index {axis} reaches {index.min()}..{index.max()}; the tensor "
                                 f"has {size} there")
        return table[tuple(np.broadcast_arrays(*indices))]
    args = [evaluate(a, env, aux) for a in expr.args]
    if expr.op == "int":
        return np.trunc(args[0]).astype(np.int64)
    if expr.op == "where":
        return np.where(args[0], args[1], args[2])
    if expr.op in _UNARY:
        with np.errstate(divide="ignore", invalid="ignore"):
            return _UNARY[expr.op](args[0])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _BINARY[expr.op](args[0], args[1])


def modified_scores(mods: Modifications, scores, g: Grid, aux: dict):
    """Scores after softcap, ALiBi and score_mod (the scaled scores `scores` when none is set)."""
    expr = mods.score_expression()
    if expr is None:
        return scores
    out = evaluate(expr, {**g.env(), "score": scores}, aux)
    return np.broadcast_to(np.asarray(out, dtype=np.float64), np.broadcast(scores, out).shape)


def score_derivative(mods: Modifications, scores, g: Grid, aux: dict):
    """d(modified score) / d(scaled score) at `scores` (1 where the scores are not modified)."""
    expr = mods.score_derivative()
    if expr is None:
        return np.ones_like(scores)
    out = evaluate(expr, {**g.env(), "score": scores}, aux)
    return np.broadcast_to(np.asarray(out, dtype=np.float64), np.broadcast(scores, out).shape)


def query_positions(g: Grid):
    """Each query's position among the keys (bottom-right alignment): i + kv_len - q_len."""
    return g.q_idx + (g.kv_len - g.q_len)


def document_ids_from_bounds(bounds, kv_len: int):
    """(batch, kv_len) document id of every key position from cu_seqlens-like bounds (batch, documents
    + 1): position t is in document d iff bounds[b, d] <= t < bounds[b, d + 1]; positions before the
    first bound or from the last one on are in no document (-1)."""
    bounds = np.asarray(bounds, dtype=np.int64)
    positions = np.arange(kv_len)
    out = np.empty((bounds.shape[0], kv_len), dtype=np.int64)
    for b, row in enumerate(bounds):
        doc = np.searchsorted(row, positions, side="right") - 1
        inside = (positions >= row[0]) & (positions < row[-1])
        out[b] = np.where(inside, doc, -1)
    return out


def _documents_match(g: Grid, aux: dict):
    ids = np.asarray(aux[AUX_DOCUMENT_IDS], dtype=np.int64)   # bounds were turned into ids by prepare_aux
    nk = ids.shape[1]
    pos = query_positions(g)
    b = np.broadcast_to(g.b, np.broadcast(g.b, pos).shape)
    q_doc = np.where((pos >= 0) & (pos < nk), ids[b, np.clip(pos, 0, nk - 1)], -2)
    kv = np.broadcast_to(g.kv_idx, np.broadcast(g.b, g.kv_idx).shape)
    kv_doc = ids[np.broadcast_to(g.b, kv.shape), np.clip(kv, 0, nk - 1)]
    return (q_doc == kv_doc) & (kv_doc >= 0) & (kv < nk)


def visible(mods: Modifications, g: Grid, aux: dict):
    """Which (b, h, q_idx, kv_idx) the modifications' masks let through (True everywhere when they add
    none); the caller applies kv_len and the spec's none / causal / window mask."""
    seen = np.ones(np.broadcast(g.b, g.h, g.q_idx, g.kv_idx).shape, dtype=bool)
    if mods.document is not None:
        seen &= _documents_match(g, aux)
    if mods.prefix is not None:
        seen &= (g.kv_idx <= query_positions(g)) | (g.kv_idx < mods.prefix)
    if mods.blocks is not None:
        table = np.asarray(aux[AUX_BLOCK_MASK])
        block_q, block_kv = mods.blocks
        b = np.minimum(g.b, table.shape[0] - 1)   # a dimension of 1 serves every batch entry / head
        h = np.minimum(g.h, table.shape[1] - 1)
        seen &= table[b, h, g.q_idx // block_q, g.kv_idx // block_kv] != 0
    if mods.mask_mod is not None:
        seen &= np.asarray(evaluate(mods.mask_mod, g.env(), aux), dtype=bool)
    return seen


def dropout_keep(mods: Modifications, g: Grid, aux: dict):
    """Dropout's keep mask scaled by 1 / (1 - p) (mods/philox.py), or None without dropout."""
    if mods.dropout is None:
        return None
    seed, offset = aux[AUX_DROPOUT]
    keep = keep_mask(mods.dropout, seed, offset, g.heads, g.b, g.h, g.q_idx, g.kv_idx)
    return keep / (1.0 - mods.dropout)
