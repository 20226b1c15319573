"""The checker's part for `backward { ... }`: its statements -> BackwardSchedule fields, and the
rules between them. frontend/check.py calls in here so that the forward checker stays as it was.

A backward field chosen in a search space is named "backward.<field>" among the space's choices
(e.g. "backward.tile_kv"), so it cannot collide with the forward's "tile_kv".
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..device_limits import H200, consumer_regs_fit, setmaxnreg_refusal
from ..hw import MMA_ROWS, WGMMA_ROWS
from ..spec import BACKWARD_KEYS, BackwardSchedule, CopyVia, DqAccumulate, LoopOrder, Mma
from . import syntax as ast

PREFIX = "backward."
EXAMPLES = {
    "order": "order kv, q   (kv outer, dK and dV on chip: FA2's; or: q, kv)",
    "tile": "tile q = 64, kv = 128", "warps": "warps 8", "pipeline": "pipeline 2 stages",
    "mma": "mma mma.sync   (or: wgmma)",
    "warpgroups": "warpgroups producer 1 regs 24, consumer 2 regs 240   (the warp-specialized Hopper backward)",
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
    out = getattr(checker, key)(statement)
    out.pop("warp_axis", None)
    return out


def unknown_statement(checker, key: ast.Word, problem_keys, did_you_mean):
    word = key.text
    if word in problem_keys:
        checker.fail(f"'{word}' is a problem setting; write it before `backward {{`", key.span)
    if word in ("overlap", "split"):
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
    if b.warp_specialized:
        return _rule_warp_specialized(spec, written)
    if b.copy is CopyVia.TMA:
        return ("backward.pipeline", "the backward copies with TMA only when warp-specialized: a producer "
                "warpgroup issues the copies", f"add `{EXAMPLES['warpgroups']}`, or drop `via tma`")
    if b.dq is DqAccumulate.TMA_REDUCE:
        return ("backward.dq", "`dq accumulate tma_reduce` is issued by the warp-specialized backward's dQ writer "
                "warp", f"add `{EXAMPLES['warpgroups']}`, or `dq accumulate atomic`")
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


def _rule_warp_specialized(spec, written: set):
    """The warp-specialized backward's rules between values (its layout, layout/backward_ws.py, checks sizes)."""
    b = spec.backward
    if b.order is not LoopOrder.KV_OUTER:
        return ("backward.order", "the warp-specialized backward is kv outer: each block keeps dK, dV on chip",
                "write `order kv, q`")
    if b.mma is not Mma.WGMMA:
        return ("backward.mma", "the warp-specialized backward runs on wgmma (its consumer warpgroups' MMA)",
                "remove `mma`, or write `mma wgmma`")
    if b.copy is not CopyVia.TMA:
        return ("backward.pipeline", "the warp-specialized backward's producer copies with TMA",
                "write `pipeline N stages via tma`")
    if b.warps != 4 * b.consumer_warpgroups:
        return ("backward.warps", f"warps follow the warpgroups: {b.consumer_warpgroups} consumer warpgroups are "
                f"{4 * b.consumer_warpgroups} warps (the producer's 4 come on top), got warps {b.warps}",
                "remove `warps`")
    if b.dq is DqAccumulate.SEPARATE:
        return ("backward.dq", "`dq accumulate separate` is the mma.sync backward's q-outer dQ kernel; the "
                "warp-specialized backward's dQ writer adds dQ_i as atomic, tma_reduce or ordered (deterministic)",
                "write `dq accumulate ordered` for bit-identical results")
    over = setmaxnreg_refusal(H200, b.producer_warpgroups, b.producer_regs, b.consumer_warpgroups, b.consumer_regs)
    if over:
        return ("backward.warpgroups", over, EXAMPLES["warpgroups"])
    return None


def warpgroup_defaults(values: dict[str, Any]) -> tuple[int, int]:
    """Fill in a warp-specialized schedule's unwritten warpgroup settings (forward and backward alike):
    producer 1 regs 24, consumer 2 with the most registers the block's setmaxnreg pool holds (at most
    256), TMA copies, wgmma. Returns (producers, consumers)."""
    producers = values.setdefault("producer_warpgroups", 1)
    consumers = values.setdefault("consumer_warpgroups", 2)
    producer_regs = values.setdefault("producer_regs", 24)
    values.setdefault("consumer_regs", min(256, consumer_regs_fit(H200, producers, producer_regs, consumers)))
    values.setdefault("copy", CopyVia.TMA)
    values.setdefault("mma", Mma.WGMMA)   # the warp-specialized families' only instruction
    return producers, consumers


def backward_schedule(values: dict[str, Any]) -> BackwardSchedule:
    """The written values plus defaults: BackwardSchedule's, except that q outer swaps the tiles
    (its 8 warps split the q tile, 16 rows each), and written warpgroups make the warp-specialized
    backward: producer 1 regs 24, consumer 2 with the most registers that fit, TMA copies, wgmma,
    4 warps per consumer warpgroup."""
    values = dict(values)
    if "producer_warpgroups" in values or "consumer_warpgroups" in values:
        _, consumers = warpgroup_defaults(values)
        values.setdefault("warps", 4 * consumers)
    if values.get("order") is LoopOrder.Q_OUTER:
        values.setdefault("tile_q", BackwardSchedule.tile_kv)
        values.setdefault("tile_kv", BackwardSchedule.tile_q)
    return BackwardSchedule(**values)
