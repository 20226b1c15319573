"""The aux tensors of a spec's modifications, checked before anything reads them.

`check_aux` works from shapes and element kinds alone (no device sync): every tensor the spec reads is
given and no other, ranks and kinds match, the built-ins have their shapes, every index an expression
can form over the launch lies inside its tensor (interval analysis over b < batch, h < heads,
q_idx < q_len, kv_idx < kv_len: a table sized for causal's half is refused, since a partial tile
computes the expression before it masks), and no int the expression forms can leave int32.
`prepare_aux` also reads the data (document ids come in runs, one per document; document bounds must
start at >= 0, never decrease and end within the keys) and returns the NumPy arrays the float64
reference reads. Every refusal is a RuntimeInputError that names the tensor and says why.
"""
from __future__ import annotations

import numpy as np

from ..errors import RuntimeInputError
from .expr import Aux, Expr, Type, reads, source
from .intervals import INT32, interval
from .model import (AUX_ALIBI, AUX_BLOCK_MASK, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_DROPOUT, AUX_SINKS,
                    AlibiSlopes, Documents, Modifications, geometric_slopes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def launch_ranges(batch: int, heads: int, q_len: int, kv_len: int, kv_lens=None, positions: bool = False) -> dict:
    """The interval of every expression variable over one launch (bounds included). `positions`: q_idx is a
    query's position among the keys (decode's: kv_len - q_len + i, read at 0 below it where aux is read)."""
    lens = (kv_len, kv_len) if kv_lens is None or len(kv_lens) == 0 else (int(min(kv_lens)), int(max(kv_lens)))
    queries = (0, max(lens[1], 1) - 1) if positions else (0, q_len - 1)
    return {"b": (0, batch - 1), "h": (0, heads - 1), "q_idx": queries, "kv_idx": (0, kv_len - 1),
            "q_len": (q_len, q_len), "kv_len": lens, "score": (-np.inf, np.inf)}


def _builtin_shapes(mods: Modifications, batch: int, heads: int, q_len: int, kv_len: int) -> dict:
    """name -> (accepted shapes, what they are) of the built-in aux tensors the spec reads."""
    shapes = {}
    if mods.alibi is AlibiSlopes.GIVEN:
        shapes[AUX_ALIBI] = ([(heads,), (batch, heads)], "(heads,) or (batch, heads)")
    if mods.sinks:
        shapes[AUX_SINKS] = ([(heads,)], "(heads,)")
    if mods.document is Documents.IDS:
        shapes[AUX_DOCUMENT_IDS] = ([(batch, kv_len)], "(batch, kv_len)")
    if mods.blocks is not None:
        blocks = (_ceil_div(q_len, mods.blocks[0]), _ceil_div(kv_len, mods.blocks[1]))
        shapes[AUX_BLOCK_MASK] = ([(b, h) + blocks for b in (batch, 1) for h in (heads, 1)],
                                  (f"(batch or 1, heads or 1, {blocks[0]}, {blocks[1]}): one entry per "
                                   f"{mods.blocks[0]} x {mods.blocks[1]} block of queries x keys"))
    return shapes


def check_aux(mods: Modifications, given: dict, batch: int, heads: int, q_len: int, kv_len: int, kv_lens=None,
              where: str = "attention", value_ranges: dict | None = None, positions: bool = False) -> None:
    """Refuse aux tensors that don't fit the spec and the launch. `given` maps each name to
    (shape, is_float) (the dropout rng to any value); `value_ranges` each int tensor's (min, max) where
    the data has been read: ints formed from its values are then checked against int32 too (without,
    they are the caller's to keep in range: reading the data would sync). `positions`: launch_ranges'."""
    needed = {a.name: a for a in mods.user_aux()}
    if mods.dropout is not None:
        needed[AUX_DROPOUT] = None
    for name in given:
        if name not in needed:
            reads = ", ".join(needed) or "none"
            raise RuntimeInputError(f"{where}: aux tensor '{name}' is not read by this spec (it reads: {reads})")
    for name in needed:
        if name not in given:
            what = "a (seed, offset) pair of ints" if name == AUX_DROPOUT else needed[name].what
            raise RuntimeInputError(f"{where}: aux tensor '{name}' is missing: {what}")
    if mods.document is Documents.BOUNDS:
        shape, is_float = given[AUX_DOCUMENT_BOUNDS]
        if len(shape) != 2 or shape[0] != batch or shape[1] < 1 or is_float:
            raise RuntimeInputError(f"{where}: document_bounds must be int (batch, documents + 1) = ({batch}, D + 1), "
                                    f"got {'float' if is_float else 'int'} {tuple(shape)}")
    for name, (accepted, words) in _builtin_shapes(mods, batch, heads, q_len, kv_len).items():
        shape, is_float = given[name]
        if tuple(shape) not in accepted:
            raise RuntimeInputError(f"{where}: {name} must be {words}, got shape {tuple(shape)}")
        if is_float != (needed[name].dtype is Type.FLOAT):
            kind = "a float" if needed[name].dtype is Type.FLOAT else "an int (or bool)"
            raise RuntimeInputError(f"{where}: {name} must be {kind} tensor")
    if min(batch, heads, q_len, kv_len) == 0:
        return   # nothing is read
    ranges = launch_ranges(batch, heads, q_len, kv_len, kv_lens, positions)
    for role, expr in (("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod)):
        if expr is not None:
            _check_expression(role, expr, given, ranges, where, value_ranges)


def _check_expression(role: str, expr: Expr, given: dict, ranges: dict, where: str, value_ranges) -> None:
    def table(node, index_ranges):
        found = (value_ranges or {}).get(node.name)
        return found if found is not None else (INT32 if node.dtype is Type.INT else None)

    def visit(node, span):
        if isinstance(node, Aux):
            shape, is_float = given[node.name]
            if len(shape) != len(node.indices):
                raise RuntimeInputError(f"{where}: {role} reads {node.name} with {len(node.indices)} indices "
                                        f"({source(node)}); the tensor has {len(shape)} dimensions {tuple(shape)}")
            if is_float != (node.dtype is Type.FLOAT):
                kind = "float (scores)" if node.dtype is Type.FLOAT else "int or bool (a mask_mod's tables)"
                raise RuntimeInputError(f"{where}: {role} reads {node.name} as {kind}; the tensor is "
                                        f"{'float' if is_float else 'int'}")
            for axis, index in enumerate(node.indices):
                lo, hi = index_ranges[index][:2]
                if lo < 0 or hi >= shape[axis]:
                    raise RuntimeInputError(
                        f"{where}: {role} reads {source(node)}: index {axis} ({source(index)}) can reach {lo}..{hi} "
                        f"for this launch, outside {node.name}'s 0..{shape[axis] - 1} (shape {tuple(shape)}); size "
                        f"the table for every (query, key) a computed tile holds, or clamp the index with min / max")
        unread = value_ranges is None and reads(node, Aux)
        if node.type is Type.INT and not unread and (span[0] < INT32[0] or span[1] > INT32[1]):
            raise RuntimeInputError(f"{where}: {role}'s {source(node)} can reach {span[0]}..{span[1]} for this "
                                    "launch: outside int32, where kernels compute it")
        index_ranges[node] = span
    index_ranges: dict = {}
    interval(expr, ranges, aux_range=table, visit=visit)


def _kind(array) -> bool:
    """Whether an array's elements are floats (bools and ints are not)."""
    return np.asarray(array).dtype.kind == "f"


def prepare_aux(mods: Modifications, aux: dict | None, batch: int, heads: int, q_len: int, kv_len: int,
                kv_lens=None, where: str = "reference") -> dict:
    """check_aux, then the data checks, then NumPy arrays for the float64 reference: floats as float64,
    ints as int64, ALiBi slopes (batch, heads) (the geometric ones computed for `heads`), document
    bounds turned into document_ids (batch, kv_len)."""
    aux = dict(aux or {})
    given = {name: (() if name == AUX_DROPOUT else np.shape(value), False if name == AUX_DROPOUT else _kind(value))
             for name, value in aux.items()}
    ints = {name: (int(np.min(value)), int(np.max(value))) if np.size(value) else (0, 0)
            for name, value in aux.items() if name != AUX_DROPOUT and not _kind(value)}
    check_aux(mods, given, batch, heads, q_len, kv_len, kv_lens, where, ints)
    out = {name: np.asarray(value, dtype=np.float64 if _kind(value) else np.int64)
           for name, value in aux.items() if name != AUX_DROPOUT}
    if mods.dropout is not None:
        try:
            seed, offset = (int(x) for x in aux[AUX_DROPOUT])
        except (TypeError, ValueError):
            raise RuntimeInputError(f"{where}: {AUX_DROPOUT} must be (seed, offset), two ints") from None
        if not (0 <= seed < 1 << 64 and 0 <= offset < 1 << 64):
            raise RuntimeInputError(f"{where}: {AUX_DROPOUT} seed and offset must be in 0..2^64-1")
        out[AUX_DROPOUT] = (seed, offset)
    if mods.alibi is AlibiSlopes.GEOMETRIC:
        out[AUX_ALIBI] = np.broadcast_to(np.asarray(geometric_slopes(heads)), (batch, heads))
    elif mods.alibi is AlibiSlopes.GIVEN:
        out[AUX_ALIBI] = np.broadcast_to(out[AUX_ALIBI], (batch, heads))
    if mods.document is Documents.IDS:
        check_document_ids(out[AUX_DOCUMENT_IDS], where)
    if mods.document is Documents.BOUNDS:
        from .numeric import document_ids_from_bounds
        bounds = out.pop(AUX_DOCUMENT_BOUNDS)
        check_bounds(bounds, kv_len, where)
        out[AUX_DOCUMENT_IDS] = document_ids_from_bounds(bounds, kv_len)
    return out


def check_document_ids(ids, where: str) -> None:
    """Document ids of packed sequences: each document (a non-negative id) is one run of consecutive key
    positions (negative ids, padding, may lie anywhere; the ids need not increase). The kernels find a
    document's keys by searching for its run's ends, so a document that resumes after another's would
    see only part of itself."""
    ids = np.asarray(ids)
    for b, row in enumerate(ids.reshape(len(ids), -1) if ids.ndim == 2 else ()):
        starts = np.nonzero((row >= 0) & np.r_[True, row[1:] != row[:-1]])[0]
        _, first = np.unique(row[starts], return_index=True)
        if len(first) < len(starts):
            again = starts[np.setdiff1d(np.arange(len(starts)), first)[0]]
            earlier = starts[np.nonzero(row[starts] == row[again])[0][0]]
            raise RuntimeInputError(f"{where}: document_ids[{b}, {again}] = {row[again]} resumes document "
                                    f"{row[again]}, which ran from index {earlier} and stopped; a document is one run "
                                    "of consecutive positions (packed sequences; negative ids are padding)")


def check_bounds(bounds, kv_len: int, where: str) -> None:
    """Document bounds: each row starts at >= 0, never decreases and ends at <= kv_len."""
    bounds = np.asarray(bounds)
    for b, row in enumerate(bounds):
        if row[0] < 0:
            raise RuntimeInputError(f"{where}: document_bounds[{b}, 0] is {row[0]}; bounds start at >= 0")
        down = np.nonzero(np.diff(row) < 0)[0]
        if len(down):
            i = int(down[0]) + 1
            raise RuntimeInputError(f"{where}: document_bounds[{b}, {i}] = {row[i]} is below document_bounds[{b}, "
                                    f"{i - 1}] = {row[i - 1]}; bounds never decrease (an empty document repeats one)")
        if row[-1] > kv_len:
            raise RuntimeInputError(f"{where}: document_bounds[{b}, -1] = {row[-1]} is past the {kv_len} keys")
