"""The Python API's score and mask modifications: `tiledsl.attention(..., softcap=, alibi_slopes=, sinks=,
document_ids=, document_bounds=, prefix=, block_mask=, block_size=, score_mod=, mask_mod=, aux=, dropout_p=)` (and
paged_attention / varlen_attention's
same keywords) become the spec's Modifications (mods/model.py) and the aux tensors a launch passes, the
same ones `softcap = 30`, `mask = causal & document`, `score_mod = ...` write in a spec
(tiledsl.spec_for prints it).

  softcap          a float > 0
  alibi_slopes     "geometric" (the ALiBi paper's slopes for the head count) or a float tensor (heads,) or
                   (batch, heads)
  sinks            a float tensor (heads,): one learned logit per head joins the softmax
  document_ids     an int tensor (batch, kv_len): query i sees key j when the ids at i + kv_len - q_len and
                   at j are equal and >= 0 (negative: padding, in no document)
  document_bounds  an int tensor (batch, documents + 1) of cu_seqlens-like offsets instead of ids
  prefix           an int N >= 1: prefix-LM, the first N keys visible to every query and the rest causal (its own
                   mask: with causal=False and no window)
  block_mask       block-sparse attention: an int or bool tensor (batch or 1, heads or 1, q blocks, kv blocks)
                   whose nonzero entries mark the block_size[0] x block_size[1] blocks of (queries x keys) that
                   are computed (converted to int32 on the device), or a FlexAttention BlockMask
                   (torch.nn.attention.flex_attention: its blocks, partial and full, become the table on the
                   device; its own block size is used; one whose mask_mod is not noop_mask is refused, since
                   that mask_mod would be evaluated inside its partial blocks)
  block_size       the blocks' sizes (q, kv), or one int for both (default 128, Flex's); multiples of 16 that
                   the kernel's tiles divide
  score_mod        DSL text ("score + bias[h, q_idx - kv_idx]"), a Python callable (mods/trace.py), or a
                   mods.expr tree
  mask_mod         the same, a condition
  aux              the expressions' aux tensors by name
  dropout_p        a probability in [0, 1): dropout on the attention weights (0: none, the plain kernels); the
                   call's seed and offset come from dispatch/dropout.py
The aux tensors' shapes and element kinds are checked before launch (mods/checks.check_aux: shapes only,
no device sync).
"""
from __future__ import annotations

import functools
import numbers

from ..errors import RuntimeInputError
from ..hw import MMA_ROWS
from .dropout import dropout_probability
from ..mods.model import (AUX_ALIBI, AUX_BLOCK_MASK, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_SINKS, NO_MODS,
                          PREFIX_ALONE, AlibiSlopes, Documents, Modifications)

KEYWORDS = ("softcap", "alibi_slopes", "sinks", "document_ids", "document_bounds", "prefix", "block_mask", "block_size",
            "score_mod", "mask_mod", "aux", "dropout_p")
DEFAULT_BLOCK_SIZE = 128   # FlexAttention's


def modifications(where: str = "attention", *, softcap=None, alibi_slopes=None, sinks=None, document_ids=None,
                  document_bounds=None, prefix=None, block_mask=None, block_size=None, score_mod=None, mask_mod=None,
                  aux=None, dropout_p=None, differentiable: bool = False,
                  tables: bool = True) -> tuple[Modifications, dict]:
    """(the Modifications of the keywords, the aux tensors by name). `differentiable`: the call needs a
    gradient, so score_mod must have one in score. `tables` False leaves block_mask as given (spec_for reads
    shapes only). `dropout_p` (dispatch/dropout.py) sets the spec's dropout; the call draws its (seed, offset)."""
    fields, tensors = {}, dict(aux or {})
    if dropout_p is not None and dropout_probability(where, dropout_p) is not None:
        fields["dropout"] = float(dropout_p)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < float(softcap) < float("inf"):
            raise RuntimeInputError(f"{where}: softcap must be a finite number > 0, got {softcap!r}")
        fields["softcap"] = float(softcap)
    if isinstance(alibi_slopes, str):
        if alibi_slopes != "geometric":
            raise RuntimeInputError(f"{where}: alibi_slopes is 'geometric' or a float tensor, got {alibi_slopes!r}")
        fields["alibi"] = AlibiSlopes.GEOMETRIC
    elif alibi_slopes is not None:
        fields["alibi"], tensors[AUX_ALIBI] = AlibiSlopes.GIVEN, alibi_slopes
    if sinks is not None:
        fields["sinks"], tensors[AUX_SINKS] = True, sinks
    if document_ids is not None and document_bounds is not None:
        raise RuntimeInputError(f"{where}: pass document_ids or document_bounds, not both")
    if document_ids is not None:
        fields["document"], tensors[AUX_DOCUMENT_IDS] = Documents.IDS, document_ids
    if document_bounds is not None:
        fields["document"], tensors[AUX_DOCUMENT_BOUNDS] = Documents.BOUNDS, document_bounds
    if prefix is not None:
        if isinstance(prefix, bool) or not isinstance(prefix, numbers.Integral) or prefix < 1:
            raise RuntimeInputError(f"{where}: prefix is the number of leading keys every query sees, an int >= 1; "
                                    f"got {prefix!r}")
        fields["prefix"] = int(prefix)
    if block_mask is not None:
        fields["blocks"], tensors[AUX_BLOCK_MASK] = block_table(where, block_mask, block_size, tables)
    elif block_size is not None:
        raise RuntimeInputError(f"{where}: block_size sizes block_mask's blocks; pass block_mask too")
    for role, given in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if given is not None:
            fields[role], tensors = expression(where, role, given, tensors, differentiable)
    return (Modifications(**fields) if fields else NO_MODS), tensors


def check_mask(where: str, mods: Modifications, mask) -> None:
    """prefix= is a mask of its own (mods/model.PREFIX_ALONE): refused with causal or a window."""
    from ..spec import Mask
    if mods.prefix is not None and mask is not Mask.NONE:
        raise RuntimeInputError(f"{where}: {PREFIX_ALONE}: pass prefix=N with causal=False and no window")


def block_table(where: str, block_mask, block_size, convert: bool = True) -> tuple[tuple[int, int], object]:
    """((block q, block kv), the int32 table on the mask's device) of block_mask= and block_size= (the module
    docstring); no device sync: a BlockMask's blocks are scattered into the table by device ops."""
    if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "kv_indices"):
        sizes = tuple(int(x) for x in block_mask.BLOCK_SIZE)
        if block_size is not None and _block_sizes(where, block_size) != sizes:
            raise RuntimeInputError(f"{where}: block_size {block_size!r} disagrees with the BlockMask's BLOCK_SIZE "
                                    f"{sizes}; leave block_size out")
        from torch.nn.attention.flex_attention import noop_mask
        if block_mask.mask_mod is not noop_mask:
            raise RuntimeInputError(
                f"{where}: block_mask is a BlockMask with a mask_mod "
                f"({getattr(block_mask.mask_mod, '__name__', '?')}), "
                "which FlexAttention evaluates inside its partial blocks; tiledsl reads a BlockMask's blocks only: "
                "build it with BlockMask.from_kv_blocks(..., mask_mod=None), or pass the per-block table")
        return _checked_sizes(where, sizes), flex_table(block_mask) if convert else block_mask
    sizes = _block_sizes(where, DEFAULT_BLOCK_SIZE if block_size is None else block_size)
    dtype = str(getattr(block_mask, "dtype", ""))
    shape = tuple(getattr(block_mask, "shape", ()))
    if not dtype or "float" in dtype or "complex" in dtype:
        raise RuntimeInputError(f"{where}: block_mask must be an int or bool tensor (batch or 1, heads or 1, q blocks, "
                                f"kv blocks) or a FlexAttention BlockMask, got {dtype or type(block_mask).__name__}")
    if len(shape) != 4:
        raise RuntimeInputError(f"{where}: block_mask must be 4-d (batch or 1, heads or 1, q blocks, kv blocks), got "
                                f"shape {shape}")
    return _checked_sizes(where, sizes), int32_table(block_mask) if convert else block_mask


def _block_sizes(where: str, given) -> tuple[int, int]:
    if isinstance(given, numbers.Integral) and not isinstance(given, bool):
        return int(given), int(given)
    if isinstance(given, (tuple, list)) and len(given) == 2 and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in given):
        return int(given[0]), int(given[1])
    raise RuntimeInputError(f"{where}: block_size is an int or a (q, kv) pair of ints, got {given!r}")


def _checked_sizes(where: str, sizes: tuple[int, int]) -> tuple[int, int]:
    if not all(x > 0 and x % MMA_ROWS == 0 for x in sizes):
        raise RuntimeInputError(f"{where}: block sizes must be positive multiples of {MMA_ROWS}, got {sizes}")
    return sizes


def int32_table(table):
    """The table as contiguous int32 on its device (a device copy unless it is one already; bools become 0 / 1)."""
    if str(getattr(table, "dtype", "")).endswith("int32"):
        return table.contiguous() if hasattr(table, "contiguous") else table
    if type(table).__module__.startswith("torch"):
        import torch
        return table.to(torch.int32).contiguous()
    return table.astype("int32")


def flex_table(block_mask):
    """A FlexAttention BlockMask's blocks (kv_num_blocks / kv_indices, and the full blocks where it has them) as
    an int32 (batch, heads, q blocks, kv blocks) table of 0 / 1, scattered on the device."""
    import torch
    indices = block_mask.kv_indices
    batch, heads, q_blocks = indices.shape[:3]
    kv_blocks = -(-int(block_mask.seq_lengths[1]) // int(block_mask.BLOCK_SIZE[1]))
    table = torch.zeros((batch, heads, q_blocks, max(kv_blocks, indices.shape[3])), dtype=torch.int32,
                        device=indices.device)
    for counts, listed in ((block_mask.kv_num_blocks, indices),
                           (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if counts is None or listed is None:
            continue
        position = torch.arange(listed.shape[3], device=listed.device)
        taken = (position < counts[..., None].to(torch.int64)).to(torch.int32)
        table.scatter_add_(3, listed.to(torch.int64), taken)   # add: positions past the count point anywhere
    rows = -(-int(block_mask.seq_lengths[0]) // int(block_mask.BLOCK_SIZE[0]))
    return (table[:, :, :rows, :kv_blocks] > 0).to(torch.int32).contiguous()


def keywords_key(softcap, alibi_slopes, sinks) -> tuple:
    """What a prepared call's key holds of the built-in keywords: softcap's value, ALiBi's kind or its tensor's
    signature, the sinks' signature (the tensors themselves are read by pointer on every call)."""
    from ..runtime.tensors import signature
    return (softcap if isinstance(softcap, (int, float)) else repr(softcap),
            alibi_slopes if isinstance(alibi_slopes, str) else signature(alibi_slopes), signature(sinks))


def expression(where: str, role: str, given, aux: dict, differentiable: bool = False):
    """(the tree of `given`: DSL text, a callable or a tree, the aux dict with captured tensors)."""
    from ..mods.expr import Aux, Apply, Const, Var
    from ..mods.validate import ExprRuleError, validate_expression
    if isinstance(given, str):
        return parsed_expression(where, role, given, differentiable), aux
    if isinstance(given, (Const, Var, Aux, Apply)):
        try:
            validate_expression(given, role, differentiable)
        except ExprRuleError as err:
            raise RuntimeInputError(f"{where}: {role}: {err}") from None
        return given, aux
    if callable(given):
        from ..mods.trace import TraceError, trace
        try:
            return trace(given, role, aux, differentiable)
        except TraceError as err:
            raise RuntimeInputError(f"{where}: {err}") from None
    raise RuntimeInputError(f"{where}: {role} is DSL text, a callable or an expression tree, got "
                            f"{type(given).__name__}")


@functools.lru_cache(maxsize=256)
def parsed_expression(where: str, role: str, given: str, differentiable: bool):
    """The tree of DSL text `given` (parsed once per text: a warm call reads the cache, not the front end)."""
    from ..errors import SpecError
    from ..frontend.parse import parse_text
    backward = "    backward {\n    }\n" if differentiable else ""
    text = f"attention {role} {{\n    head_dim = 64\n    {role} = {given}\n{backward}}}\n"
    try:
        (spec,) = parse_text(text, f"<{role}>")
    except SpecError as err:
        raise RuntimeInputError(f"{where}: {role}: {err.render()}") from None
    return getattr(spec.problem.mods, role)


def shapes_of(aux: dict) -> dict:
    """name -> (shape, is_float) of the aux tensors (torch, CuPy, NumPy: by their shape and dtype)."""
    out = {}
    for name, value in aux.items():
        dtype = str(getattr(value, "dtype", ""))
        out[name] = (tuple(getattr(value, "shape", ())), "float" in dtype or "bfloat" in dtype)
    return out


def check_launch(mods: Modifications, aux: dict, batch: int, heads: int, q_len: int, kv_len: int,
                 ragged: bool = False, where: str = "attention", positions: bool = False) -> None:
    """mods/checks.check_aux on the tensors' shapes (no sync). `ragged`: kv_lens shorten the sequences
    by amounts not read here, so an expression's kv_len may be anything in 0..kv_len. `positions`: q_idx is a
    query's position in its sequence (decode's)."""
    from ..mods.checks import check_aux
    check_aux(mods, shapes_of(aux), batch, heads, q_len, kv_len, [0, kv_len] if ragged else None, where,
              positions=positions)
