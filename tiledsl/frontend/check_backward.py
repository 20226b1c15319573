"""The checker's part for `backward { ... }`: its statements -> BackwardSchedule fields, and the
rules between them. frontend/check.py calls in here so that the forward checker stays as it was.

A backward field chosen in a search space is named "backward.<field>" among the space's choices
(e.g. "backward.tile_kv"), so it cannot collide with the forward's "tile_kv".
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..hw import MMA_ROWS, WGMMA_ROWS
from ..spec import BACKWARD_KEYS, BackwardSchedule, DqAccumulate, LoopOrder, Mma
from . import syntax as ast

PREFIX = "backward."
EXAMPLES = {
    "order": "order kv, q   (kv outer, dK and dV on chip: FA2's; or: q, kv)",
    "tile": "tile q = 64, kv = 128", "warps": "warps 8", "pipeline": "pipeline 2 stages",
    "mma": "mma mma.sync   (or: wgmma)",
}
_FIELDS = {f.name for f in fields(BackwardSchedule)}


def statement_fields(checker, statement) -> dict:
    """{BackwardSchedule field: (values, is_choice)} of one statement of a backward block; the
    forward's statement parsers do the values, with what the backward has no use for refused."""
    key = statement.key.text
    if isinstance(statement, ast.Dq):
        table = {m.value: m for m in DqAccumulate}
        return {"dq": checker.values(statement.mode, lambda a: checker.word(a, "dq accumulate mode", table))}
    if isinstance(statement, ast.Warps) and statement.axis is not None:
        checker.fail("the backward splits warps along its outer loop's tile; `along` is not for it",
                     statement.axis.span, f"write e.g. `{EXAMPLES['warps']}`")
    if isinstance(statement, ast.Pipeline) and statement.copy is not None:
        checker.fail("the backward copies with cp.async; `via` is not for it", statement.copy.span,
                     f"write e.g. `{EXAMPLES['pipeline']}`")
    out = getattr(checker, key)(statement)
    out.pop("warp_axis", None)
    out.pop("copy", None)
    return out


def unknown_statement(checker, key: ast.Word, problem_keys, did_you_mean):
    word = key.text
    if word in problem_keys:
        checker.fail(f"'{word}' is a problem setting; write it before `backward {{`", key.span)
    if word in ("warpgroups", "overlap", "split"):
        checker.fail(f"the backward schedule has no '{word}'", key.span,
                     "backward statements: " + ", ".join(BACKWARD_KEYS))
    checker.fail(f"unknown backward statement '{word}'{did_you_mean(word, BACKWARD_KEYS)}", key.span,
                 "backward statements: " + ", ".join(BACKWARD_KEYS))


def split_config(values: dict) -> tuple[dict, dict]:
    """(forward schedule values, backward schedule values) of a space's config."""
    forward = {k: v for k, v in values.items() if not k.startswith(PREFIX)}
    backward = {k[len(PREFIX):]: v for k, v in values.items() if k.startswith(PREFIX)}
    assert set(backward) <= _FIELDS, backward
    return forward, backward


def rule_backward(spec, written: set):
    """The rules between a backward schedule's values (and the problem's): (key, message, hint)."""
    b, p = spec.backward, spec.problem
    if b is None:
        return None
    if p.queries_per_seq is not None:
        return ("backward", "a decode kernel (queries = N) has no backward pass",
                "remove `backward { }`, or `queries` for a prefill kernel with a backward")
    kv_outer = b.order is LoopOrder.KV_OUTER
    if not kv_outer and b.dq is not DqAccumulate.ATOMIC:
        return ("backward.dq", f"q outer keeps dQ on chip (and sums dK, dV with atomics); `dq accumulate "
                f"{b.dq.value}` is for order kv, q", "write `order kv, q`, or remove `dq accumulate`")
    axis, tile = ("kv", b.tile_kv) if kv_outer else ("q", b.tile_q)
    tile_key = "backward.tile" if "backward.tile" in written else "backward"
    warps_key = "backward.warps" if "backward.warps" in written else tile_key
    if b.mma is Mma.WGMMA:
        if b.warps % 4 or tile != b.warps // 4 * WGMMA_ROWS:
            fit = max(4, tile // WGMMA_ROWS * 4)
            return (warps_key, f"wgmma runs whole warpgroups (4 warps), each owning {WGMMA_ROWS} rows of the outer "
                    f"tile {axis}: {b.warps} warps and tile {axis} = {tile} do not match",
                    f"use warps {fit} with tile {axis} = {fit // 4 * WGMMA_ROWS}")
        if p.head_dim_qk % 64 or p.head_dim_v % 64:
            return ("backward.mma", f"wgmma reads 64-column panels: head dims must be multiples of 64, got "
                    f"{p.head_dim_qk}/{p.head_dim_v}", "use mma.sync for other head dims")
    elif tile % (MMA_ROWS * b.warps):
        fits = [w for w in (1, 2, 4, 8, 16) if tile % (MMA_ROWS * w) == 0]
        return (warps_key, f"{b.warps} warps give each warp {tile / b.warps:g} rows of the outer tile {axis} = {tile}; "
                f"a warp needs a multiple of {MMA_ROWS}",
                f"use warps {fits[-1]}, or tile {axis} = {MMA_ROWS * b.warps}")
    return None


def backward_schedule(values: dict[str, Any]) -> BackwardSchedule:
    """The written values plus defaults: BackwardSchedule's, except that q outer swaps the tiles
    (its 8 warps split the q tile, 16 rows each)."""
    values = dict(values)
    if values.get("order") is LoopOrder.Q_OUTER:
        values.setdefault("tile_q", BackwardSchedule.tile_kv)
        values.setdefault("tile_kv", BackwardSchedule.tile_q)
    return BackwardSchedule(**values)
