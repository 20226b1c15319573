"""The graph ops of a spec's score and mask modifications (mods/model.py), for every family's graph:

  score_mod       between S = scale Q K^T and the mask: softcap, ALiBi, score_mod (forward, and the
                  backward's recompute of S)
  mask            the spec's mask op, its text extended with the modifications' terms
  dropout         after the online softmax (l sums the undropped P): P V reads P * Z / (1 - p); in the
                  backward, after P's recompute, for dV and dS
  score_mod_grad  the backward's dS through the modification: dS *= d(modified S) / dS
  sink_grad       the backward's kernel after the preprocess: dsink_h = -sum_i exp(sink_h - lse_i) D_i
Sinks change no op: the running m, l of the kv loop start at (sink_h, 1) instead of (-inf, 0) (split 0's
only, with split-KV), so the sink joins the softmax once.
"""
from __future__ import annotations

from ..mods.expr import ONE, source
from ..mods.model import AlibiSlopes, Documents, Modifications
from ..spec import Family, KernelSpec, Problem
from .ops import MASK_TEXT, Op, OpKind, Space

SINK_INIT = (("m", "sink_h"), ("l", "1 (the sink's weight)"))   # the kv loop's running m, l with sinks


def query_index(spec: KernelSpec) -> str:
    """An expression's q_idx in the pseudo-code's terms (i: the query's row among the call's queries): decode's
    queries are their sequence's last, so there q_idx is the query's position in its sequence; elsewhere i."""
    return "i + kv_len - q_len" if spec.family is Family.DECODE else "i"


def score_text(mods: Modifications, q_idx: str = "i") -> str:
    """The score modification as pseudo-code, one step per modification, in their order; `q_idx`: query_index's."""
    steps = []
    if mods.softcap is not None:
        steps.append(f"S = {mods.softcap:g} * tanh(S / {mods.softcap:g})")
    if mods.alibi is not None:
        slopes = "geometric slopes" if mods.alibi is AlibiSlopes.GEOMETRIC else "alibi_slopes"
        steps.append(f"S -= slope[b, h] * |i + kv_len - q_len - j|   ({slopes})")
    if mods.score_mod is not None:
        steps.append(f"S = {source(mods.score_mod)}   (score = S, q_idx = {q_idx}, kv_idx = j)")
    return "; ".join(steps)


def mask_text(problem: Problem, q_idx: str = "i") -> str:
    """The mask op's pseudo-code: the spec's mask and every modification's term; `q_idx`: query_index's (said
    beside mask_mod where it is not the row i)."""
    mods = problem.mods
    terms = []
    if mods.document is not None:
        source_ = "document_ids" if mods.document is Documents.IDS else "the documents of document_bounds"
        terms.append(f"query position i + kv_len - q_len and key j in one document ({source_})")
    if mods.prefix is not None:
        terms.append(f"j <= i + kv_len - q_len or j < {mods.prefix} (prefix)")
    if mods.mask_mod is not None:
        terms.append(f"{source(mods.mask_mod)} (mask_mod" + ("" if q_idx == "i" else f", q_idx = {q_idx}") + ")")
    text = MASK_TEXT[problem.mask]
    if terms:
        text += "; and -inf unless " + " and ".join(terms) + "   (full tiles: no per-element mask)"
    if mods.blocks is not None:
        text += (f"; only blocks with block_mask[b, h, i // {mods.blocks[0]}, j // {mods.blocks[1]}] != 0 are "
                 "computed (whole tiles: the kv loop walks those, no element is tested for them)")
    return text


def kv_loop_text(mods: Modifications) -> str:
    """What the kv loop walks besides the mask's own tile range: block_mask's nonzero blocks."""
    if mods.blocks is None:
        return ""
    return (f"; only the kv tiles whose block_mask[b, h, i // {mods.blocks[0]}, j // {mods.blocks[1]}] is nonzero: "
            "the producer reads q tile i's row once and lists them for itself and the consumers")


def q_loop_text(mods: Modifications) -> str:
    """What the backward's q loop (kv outer) walks besides the mask's own tile range: block_mask's nonzero blocks."""
    if mods.blocks is None:
        return ""
    return (f"; only the (query head, q tile) steps whose block_mask[b, h, i // {mods.blocks[0]}, j // "
            f"{mods.blocks[1]}] is nonzero: warp 0 reads kv tile j's column once and marks them for every role")


def add_score_mod(g, name: str, loops, role, key: str, scores: str, lag: int = 0) -> str:
    """The score_mod op after `scores` (the node producing S) when the spec modifies scores; returns
    the node that produces S for the mask."""
    mods = g.spec.problem.mods
    if not mods.modifies_scores:
        return scores
    g.add(name, Op(OpKind.SCORE_MOD, Space.REGISTERS, ("Br", "Bc"), loops, role, _mod_key(g, "score"),
                   score_text(mods, query_index(g.spec)), lag=lag))
    g.connect(scores, name, "S")
    return name


def add_dropout(g, name: str, loops, role, probabilities: str, lag: int = 0) -> str:
    """The dropout op after `probabilities` (the node producing P) when the spec drops; returns the
    node whose P the next op reads."""
    mods = g.spec.problem.mods
    if mods.dropout is None:
        return probabilities
    g.add(name, Op(OpKind.DROPOUT, Space.REGISTERS, ("Br", "Bc"), loops, role, "dropout",
                   f"P *= Z / (1 - {mods.dropout:g}), Z = philox(seed, offset, b, h, i, j) >= {mods.dropout:g}"
                   "   (regenerated from the counters, never stored)", lag=lag))
    g.connect(probabilities, name, "P")
    return name


def add_score_mod_grad(g, name: str, loops, role, key: str, ds: str) -> str:
    """The backward's chain rule through the score modification (none when d(mod)/dS is 1)."""
    mods = g.spec.problem.mods
    derivative = mods.score_derivative()
    if derivative is None or derivative == ONE:
        return ds
    g.add(name, Op(OpKind.SCORE_MOD_GRAD, Space.REGISTERS, ("Br", "Bc"), loops, role, key=_mod_key(g, "score"),
                   text=f"dS *= d(modified S)/dS = {source(derivative)}   (score = S before the modification)"))
    g.connect(ds, name, "dS")
    return name


def add_sink_grad(g, name: str, loops, d: str) -> str | None:
    """The sink gradient, after `d` (the node giving D_i; None without sinks)."""
    if not g.spec.problem.mods.sinks:
        return None
    g.add(name, Op(OpKind.SINK_GRAD, Space.HBM, ("Br",), loops, key="sinks",
                   text="dsink[h] -= sum_i exp(sink_h - lse_i) * D_i   (fp32, summed in a fixed order)"))
    g.connect(d, name, "D_i")
    return name


def _mod_key(g, what: str) -> str:
    """The DSL setting an op's source tag points at: the first of its modifications written."""
    written = [k for k, _ in g.spec.spans]
    for key in ("softcap", "alibi", "score_mod") if what == "score" else ("mask", "mask_mod"):
        if key in written:
            return key
    return "mask"


def mask_key(g) -> str:
    """The mask op's source tag: `mask`, or `mask_mod` when only that was written."""
    return _mod_key(g, "mask")

