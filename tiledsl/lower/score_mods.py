"""What a forward kernel needs to spell a spec's score modifications (mods/model.py) with
templates/score_mods.cuh: the aux tensors it reads (its parameters), the constants of its steps (in the raw
units of S that the softmax scales) and the plan fields the templates branch on. Shared by the hopper
forward (batched and varlen) and the decode family (contiguous, paged and FP8 KV caches), so a capped,
ALiBi-biased or sink-weighted score is the same number in every kernel."""
from __future__ import annotations

import math

from ..mods.model import DROPOUT_PARAMETERS, Documents, Modifications
from ..mods.philox import drop_threshold
from ..mods.softcap import DEFAULT_VIA, QUOTIENT_FITS, TanhVia, mufu_tiles, quotient_degree
from .expressions import expression_parameters
from .plan import Constant, Parameter
from .steps import parameters


def mod_parameters(mods: Modifications) -> tuple[tuple[Parameter, ...], ...]:
    """The aux tensors the modified kernel reads: ALiBi's slopes (batch stride 0 for (heads,) slopes and the
    host's geometric ones), the sinks, the documents, then the expressions' (lower/expressions.py); () for an
    unmodified kernel."""
    line = ()
    if mods.alibi is not None:
        line += parameters("const float* __restrict__", "alibi_slopes") + parameters("int", "alibi_batch_stride")
    if mods.sinks:
        line += parameters("const float* __restrict__", "sinks")
    if mods.document is Documents.IDS:
        line += parameters("const int* __restrict__", "document_ids") + parameters("i64", "document_stride")
    elif mods.document is Documents.BOUNDS:
        line += (parameters("const int* __restrict__", "document_bounds") + parameters("i64", "document_stride")
                 + parameters("int", "document_count"))
    if mods.blocks is not None:
        line += (parameters("const int* __restrict__", "block_mask")
                 + parameters("i64", "block_mask_batch_stride", "block_mask_head_stride")
                 + parameters("int", "block_mask_kv_blocks"))
    line += expression_parameters(mods)
    if mods.dropout is not None:   # (seed, offset) of the launch's Philox streams (mods/philox.py)
        line += parameters("unsigned long long", *DROPOUT_PARAMETERS)
    return (line,) if line else ()


def softcap_via(mods: Modifications) -> TanhVia | None:
    """How the kernel's tanh runs: the spec's `via`, else mods/softcap.DEFAULT_VIA (None without softcap)."""
    return None if mods.softcap is None else mods.softcap_via or DEFAULT_VIA


def softcap_constants(p, s_tiles: int) -> list[Constant]:
    """softcap's constants (mods/softcap.py): tanh.approx's argument and output scales, or the exponent
    scale of w = e^(-2 SCALE |s| / cap), the quotient's coefficients (cap / scale folded in, raw units) and
    how many 8-column tiles of S take w from MUFU."""
    cap, via = p.mods.softcap, softcap_via(p.mods)
    if via is TanhVia.TANH_APPROX:
        return [Constant("SOFTCAP_IN", "float", p.scale / cap, "softcap: scale / cap, tanh's argument"),
                Constant("SOFTCAP_OUT", "float", cap / p.scale, "softcap: cap / scale, back to raw units")]
    degree = quotient_degree(cap, via)
    coefficients, error = QUOTIENT_FITS[degree]
    return [Constant("SOFTCAP_EXP", "float", -2.0 * math.log2(math.e) * p.scale / cap,
                     "softcap: w = 2^(|s| SOFTCAP_EXP) = e^(-2 scale |s| / cap)"),
            Constant("SOFTCAP_MUFU_TILES", "int", mufu_tiles(via, s_tiles),
                     f"softcap via {via.value}: tiles of S whose w comes from MUFU's ex2 (the rest: FMA pipes)")] + [
        Constant(f"SOFTCAP_Q{k}", "float", c * cap / p.scale,
                 f"softcap: the quotient's w^{k} coefficient (degree {degree}, error {error:.2g}) times cap / scale"
                 if k == 0 else "") for k, c in enumerate(coefficients)]


def mod_constants(p, s_tiles: int) -> list[Constant]:
    """The constants of the modifications' steps, in the raw units of S the softmax scales. `s_tiles`: the
    8-column tiles of S one thread's accumulators hold (a decode warp's: its key slice's)."""
    mods, out = p.mods, []
    if mods.softcap is not None:
        out += softcap_constants(p, s_tiles)
    if mods.alibi is not None:
        out.append(Constant("ALIBI_UNITS", "float", -1.0 / p.scale, "ALiBi: -1 / scale, a slope in raw units"))
    if mods.sinks:
        out.append(Constant("SINK_UNITS", "float", 1.0 / p.scale, "sinks: 1 / scale, a sink logit in raw units"))
    if mods.document is not None or mods.prefix is not None or mods.mask_mod is not None:
        out += [Constant("DOCUMENTS", "bool", mods.document is not None, "mask = document: rows see their document"),
                Constant("PREFIX", "int", mods.prefix or 0, "prefix(n): keys below it are visible to all (0: none)")]
    if mods.blocks is not None:
        out += [Constant("BLOCK_Q", "int", mods.blocks[0], "blocks: queries of one block_mask row"),
                Constant("BLOCK_KV", "int", mods.blocks[1], "blocks: keys of one block_mask entry")]
    if mods.dropout is not None:
        out += dropout_constants(mods.dropout)
    return out


def dropout_constants(p: float) -> list[Constant]:
    """Dropout's threshold (a Philox word below it drops its weight: mods/philox.drop_threshold) and the
    scale of the kept weights, a spec fact each."""
    return [Constant("DROP_THRESHOLD", "u32", drop_threshold(p), f"dropout {p:g}: words below p 2^32 drop"),
            Constant("KEEP_SCALE", "float", 1.0 / (1.0 - p), "dropout: 1 / (1 - p), the kept weights' scale")]


def score_mod_fields(mods: Modifications, constants) -> dict:
    """KernelPlan's score-modification fields (what the templates branch on) for `mods`, whose constants
    (mod_constants) are among `constants`."""
    via = softcap_via(mods)
    terms = tuple("C::" + c.name for c in constants if c.name.startswith("SOFTCAP_Q"))
    return dict(score_mods=mods.active, softcap=mods.softcap is not None, alibi=mods.alibi is not None,
                sinks=mods.sinks, softcap_via=via.value if via else "", softcap_terms=terms,
                softcap_degree=max(len(terms) - 1, 0), dropout=mods.dropout is not None)
