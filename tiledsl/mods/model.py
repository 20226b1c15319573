"""Score and mask modifications: what a spec changes between S = scale Q K^T and the softmax.

    score    s = scale * q_i . k_j
             s = softcap * tanh(s / softcap)                 softcap = 30 [via ex2 | fma | split | tanh_approx]
             s = s - slope_h * |i + kv_len - q_len - j|      alibi = geometric | slopes   (FA2's ALiBi)
             s = score_mod(s, b, h, i, j)                    score_mod = score + bias[h, q_idx - kv_idx]
    visible  j < kv_len, the mask (none | causal | window), and each of:
             document    query i (at key position i + kv_len - q_len) and key j in one document
             prefix(n)   j <= i + kv_len - q_len, or j < n            (prefix-LM: the first n keys bidirectional)
             blocks      block_mask[b, h, i // block q, j // block kv] != 0   (block-sparse)
             mask_mod    the spec's condition (mask_mod = kv_idx <= q_idx | kv_idx == 0)
    softmax  P = exp(s - lse) over the visible keys; with `sinks = per_head` a learned logit sink_h
             joins the sum: lse = log(sum_j exp(s_j) + exp(sink_h)) (no value: it only takes weight);
             a row that sees no key has O = 0 and lse = -inf, or lse = sink_h with sinks
    dropout  O = (P * Z / (1 - p)) V with Z a keep mask from counter-based Philox (mods/philox.py),
             regenerated in the backward from the same seed and offset; lse is dropout's input's

The aux tensors these read (inputs beside q, k, v) are named in AUX_*; `Modifications.aux_tensors` lists
a spec's. The order above is fixed: softcap first, then ALiBi, then score_mod (which sees the result).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from enum import Enum

from .expr import Aux, Const, Expr, Type, Var, apply, derivative, reads, source, substitute
from .softcap import TanhVia


class AlibiSlopes(Enum):
    GEOMETRIC = "geometric"    # the ALiBi paper's 2^(-8 (h + 1) / heads), computed for the launch's head count
    GIVEN = "slopes"           # read from the aux tensor alibi_slopes, (heads,) or (batch, heads)


class Documents(Enum):
    IDS = "ids"                # document_ids[b, t] (batch, kv_len): one id per key position
    BOUNDS = "bounds"          # document_bounds[b, :] (batch, documents + 1): cu_seqlens-like offsets


# The built-in modifications' aux tensors (name -> (rank, element type, what it holds)).
# The score modifications' fields (Modifications' names) that every template with modifications spells: softcap
# (and how its tanh runs), ALiBi and sinks (families.BUILT_MODS, layout/backward_ws.WS_BUILT_MODS).
SCORE_MODS = ("softcap", "softcap_via", "alibi", "sinks")
# The mask modifications the hopper forward and the warp-specialized backward spell (families.BUILT_MODS,
# layout/backward_ws.WS_BUILT_MODS).
MASK_MODS = ("document", "prefix")
# prefix(n) is a mask of its own (causal, with the first n keys visible to every query): together with causal it
# would be causal, and with a window a window, so both are refused (the DSL's check and the Python API alike).
PREFIX_ALONE = "prefix(N) is causal with the first N keys visible to all; it takes no causal or window term"

AUX_ALIBI = "alibi_slopes"
AUX_SINKS = "sinks"
AUX_DOCUMENT_IDS = "document_ids"
AUX_DOCUMENT_BOUNDS = "document_bounds"
AUX_BLOCK_MASK = "block_mask"
AUX_DROPOUT = "dropout_rng"    # (seed, offset): two uint64 launch arguments, not a tensor
DROPOUT_PARAMETERS = ("dropout_seed", "dropout_offset")   # the kernels' names of AUX_DROPOUT's pair
BUILTIN_AUX = {
    AUX_ALIBI: (2, Type.FLOAT, "(batch, heads) ALiBi slopes ((heads,) is taken for every batch entry)"),
    AUX_SINKS: (1, Type.FLOAT, "(heads,) sink logits, in the units of the scaled scores"),
    AUX_DOCUMENT_IDS: (2, Type.INT, "(batch, kv_len) document id of each key position"),
    AUX_DOCUMENT_BOUNDS: (2, Type.INT, "(batch, documents + 1) document start offsets, 0 first, non-decreasing"),
    AUX_BLOCK_MASK: (4, Type.INT, "(batch or 1, heads or 1, q blocks, kv blocks) nonzero: computed"),
}


@dataclass(frozen=True)
class AuxTensor:
    """An input tensor an expression or a built-in modification reads."""
    name: str
    rank: int
    dtype: Type            # INT: int32, FLOAT: float32
    what: str = field(default="", compare=False)


@dataclass(frozen=True)
class Modifications:
    """A Problem's score and mask modifications (the module docstring). The defaults change nothing;
    a Problem whose modifications are all defaults keeps its config, hash and kernel name."""
    softcap: float | None = None
    softcap_via: TanhVia | None = None        # how tanh runs (mods/softcap.py); None: the lowering's default
    alibi: AlibiSlopes | None = None
    sinks: bool = False
    document: Documents | None = None
    prefix: int | None = None                 # prefix(n): the first n keys are visible to every query
    blocks: tuple[int, int] | None = None     # block-sparse: (block q, block kv) of block_mask's entries
    dropout: float | None = None              # the probability of dropping a weight, in (0, 1)
    score_mod: Expr | None = None             # float, reads `score`
    mask_mod: Expr | None = None              # bool

    @property
    def active(self) -> bool:
        return self != NO_MODS

    @property
    def modifies_scores(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.score_mod is not None

    @property
    def modifies_mask(self) -> bool:
        return any(x is not None for x in (self.document, self.prefix, self.blocks, self.mask_mod))

    @property
    def masks_positions(self) -> bool:
        """Whether a document or prefix mask says which keys each query position sees (MASK_MODS)."""
        return self.document is not None or self.prefix is not None

    def score_expression(self) -> Expr | None:
        """softcap, ALiBi and score_mod composed into one tree over `score` (the scaled score); None
        when the scores are not modified."""
        if not self.modifies_scores:
            return None
        expr: Expr = Var("score")
        if self.softcap is not None:
            cap = Const(float(self.softcap))
            expr = apply("mul", cap, apply("tanh", apply("div", expr, cap)))
        if self.alibi is not None:
            slope = Aux(AUX_ALIBI, (Var("b"), Var("h")), Type.FLOAT)
            position = apply("sub", apply("add", Var("q_idx"), apply("sub", Var("kv_len"), Var("q_len"))),
                             Var("kv_idx"))
            expr = apply("sub", expr, apply("mul", slope, apply("abs", position)))
        if self.score_mod is not None:
            expr = substitute(self.score_mod, "score", expr)
        return expr

    def score_derivative(self) -> Expr | None:
        """d(modified score) / d(scaled score), for the backward's dS (NotDifferentiable when none)."""
        expr = self.score_expression()
        return None if expr is None else derivative(expr)

    def aux_tensors(self) -> tuple[AuxTensor, ...]:
        """Every aux tensor this reads, built-ins first, then the expressions' in name order."""
        names = []
        if self.alibi is AlibiSlopes.GIVEN or self.alibi is AlibiSlopes.GEOMETRIC:
            names.append(AUX_ALIBI)   # geometric slopes are computed on the host for the launch's heads
        if self.sinks:
            names.append(AUX_SINKS)
        if self.document is not None:
            names.append(AUX_DOCUMENT_IDS if self.document is Documents.IDS else AUX_DOCUMENT_BOUNDS)
        if self.blocks is not None:
            names.append(AUX_BLOCK_MASK)
        out = [AuxTensor(n, BUILTIN_AUX[n][0], BUILTIN_AUX[n][1], BUILTIN_AUX[n][2]) for n in names]
        found: dict[str, AuxTensor] = {}
        for expr in (self.score_mod, self.mask_mod):
            for node in reads(expr, Aux) if expr is not None else ():
                found.setdefault(node.name, AuxTensor(node.name, len(node.indices), node.dtype,
                                                      "read by " + ("score_mod" if expr is self.score_mod
                                                                    else "mask_mod")))
        return tuple(out) + tuple(found[n] for n in sorted(found))

    def user_aux(self) -> tuple[AuxTensor, ...]:
        """The aux tensors a caller passes by name (the expressions'; geometric slopes are computed)."""
        builtin = {AUX_ALIBI} if self.alibi is AlibiSlopes.GEOMETRIC else set()
        return tuple(a for a in self.aux_tensors() if a.name not in builtin)

    # -- names and plain data
    def config(self) -> dict:
        """JSON-ready plain data: only the modifications that are set (expressions as DSL text)."""
        out: dict = {}
        for name in ("softcap", "prefix", "dropout"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name in ("softcap_via", "alibi", "document"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).value
        if self.sinks:
            out["sinks"] = "per_head"
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
        for name in ("score_mod", "mask_mod"):
            if getattr(self, name) is not None:
                out[name] = source(getattr(self, name))
        return out

    def name_parts(self) -> list[str]:
        """The kernel name's parts, e.g. softcap30, alibig, sinks, doc, prefix256, blk128x128, drop0p1,
        smod1a2b3c4d (an expression's: the first 8 hex digits of its text's sha256)."""
        parts = []
        if self.softcap is not None:
            parts.append("softcap" + _number(self.softcap)
                         + (self.softcap_via.value.replace("_", "") if self.softcap_via else ""))
        if self.alibi is not None:
            parts.append("alibi" + ("g" if self.alibi is AlibiSlopes.GEOMETRIC else "s"))
        if self.sinks:
            parts.append("sinks")
        if self.document is not None:
            parts.append("doc" if self.document is Documents.IDS else "docb")
        if self.prefix is not None:
            parts.append(f"prefix{self.prefix}")
        if self.blocks is not None:
            parts.append(f"blk{self.blocks[0]}x{self.blocks[1]}")
        if self.dropout is not None:
            parts.append("drop" + _number(self.dropout))
        for tag, expr in (("smod", self.score_mod), ("mmod", self.mask_mod)):
            if expr is not None:
                parts.append(tag + hashlib.sha256(source(expr).encode()).hexdigest()[:8])
        return parts

    def dsl_lines(self) -> list[str]:
        """The settings that write these modifications (besides `mask`'s part: mask_terms)."""
        lines = []
        if self.softcap is not None:
            via = f" via {self.softcap_via.value}" if self.softcap_via else ""
            lines.append(f"softcap   = {self.softcap!r}{via}")
        if self.alibi is not None:
            lines.append(f"alibi     = {self.alibi.value}")
        if self.sinks:
            lines.append("sinks     = per_head")
        if self.dropout is not None:
            lines.append(f"dropout   = {self.dropout!r}")
        if self.score_mod is not None:
            lines.append(f"score_mod = {source(self.score_mod)}")
        if self.mask_mod is not None:
            lines.append(f"mask_mod  = {source(self.mask_mod)}")
        return lines

    def mask_terms(self) -> list[str]:
        """The built-in masks of these modifications as `mask = ...` terms (joined by `&`)."""
        terms = []
        if self.document is not None:
            terms.append("document" if self.document is Documents.IDS else "document(bounds)")
        if self.prefix is not None:
            terms.append(f"prefix({self.prefix})")
        if self.blocks is not None:
            terms.append(f"blocks(q = {self.blocks[0]}, kv = {self.blocks[1]})")
        return terms

    def without(self, *names: str) -> "Modifications":
        return replace(self, **{n: getattr(NO_MODS, n) for n in names})


NO_MODS = Modifications()


def _number(x: float) -> str:
    value = float(x)
    text = repr(int(value)) if value.is_integer() else repr(value)
    return text.replace(".", "p").replace("-", "m")


def geometric_slopes(heads: int) -> list[float]:
    """ALiBi's standard slopes for `heads` heads (Press et al.; BLOOM's get_slopes): 2^(-8 (i + 1) / n)
    for a power of two n = heads; otherwise those of the largest power of two below, then every
    other slope of twice that, until there are `heads`."""
    if heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {heads}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    closest = 1 << (heads.bit_length() - 1)
    slopes = power_of_two(closest)
    if closest != heads:
        slopes += power_of_two(2 * closest)[0::2][: heads - closest]
    return slopes

