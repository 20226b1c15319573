"""The rules between a spec's values, run on a whole KernelSpec: family features, warps against tiles, the
warpgroup register budget, the backward block's rules; then the kernel's layout (families.layout_of,
the layout the lowering is handed), so `check` refuses what `compile` refuses. Also the defaults that
depend on the family."""
from __future__ import annotations

import dataclasses

from ..device_limits import H200, consumer_regs_fit, setmaxnreg_refusal
from ..errors import SpecError
from ..hw import MMA_ROWS, WGMMA_ROWS
from ..families import feature_refusal, layout_of
from ..layout.backward import backward_has_template, backward_layout
from ..layout.base import GENERIC_SIZE_HINT
from ..mods.softcap import DEFAULT_VIA, refusal as softcap_refusal
from ..spec import (MAX_TILE, Axis, Family, KernelSpec, LaunchKind, Mma, Problem,
                    Schedule, SeqLayout)
from . import check_backward
from .words import EXAMPLES

WARP_COUNTS = (1, 2, 4, 8, 16)


def schedule_with_defaults(problem: Problem, written: dict) -> Schedule:
    """The Schedule of written values plus defaults. spec.Schedule's defaults hold, except:
    decode splits warps along kv and tiles q by 16 (its few query rows fill one MMA tile); hopper
    copies with TMA, has warps = 4 per warpgroup, producer 1 regs 24, consumer 2 with the most regs
    that fit the register file."""
    values = dict(written)
    if "producer_warpgroups" in values or "consumer_warpgroups" in values:
        producers, consumers = check_backward.warpgroup_defaults(values)
        values.setdefault("warps", 4 * (producers + consumers))
    elif problem.queries_per_seq is not None:
        values.setdefault("warp_axis", Axis.KV)
        values.setdefault("tile_q", MMA_ROWS)
    return Schedule(**values)


def _rule_family_features(spec: KernelSpec, written: set):
    """The settings the spec's family takes: families.FEATURES and the family's rows (the one table
    lowering reads too)."""
    broken = feature_refusal(spec)
    if broken:
        return broken
    s, p, fam = spec.schedule, spec.problem, spec.family
    if (s.launch is not None or s.item_order is not None) and fam is not Family.HOPPER:
        return ("launch", f"`launch` picks the hopper family's tile scheduler; {fam.value} launches one block per "
                "query tile", "add `warpgroups producer 1, consumer 2`, or remove `launch`")
    if s.item_order is not None and s.launch is None:
        return ("launch", "a launch order goes with a launch kind", "write e.g. `launch dynamic order longest_first`")
    if s.launch is LaunchKind.DYNAMIC and p.seq_layout is SeqLayout.VARLEN:
        return ("launch", "launch dynamic is built for batched layouts; varlen's work list is walked persistent or "
                "one block per item", "write `launch persistent` or `launch grid`")
    return None


def _rule_hopper(spec: KernelSpec, written: set):
    s = spec.schedule
    if spec.family is not Family.HOPPER:
        return None
    if "warps" in written:
        return ("warps", "the hopper family gets its warps from `warpgroups` (4 warps each)", "remove `warps`")
    if s.producer_warpgroups != 1 or not 1 <= s.consumer_warpgroups <= 3:
        return ("warpgroups", "hopper needs producer 1 and consumer 1..3 warpgroups", EXAMPLES["warpgroups"])
    over = setmaxnreg_refusal(H200, s.producer_warpgroups, s.producer_regs, s.consumer_warpgroups, s.consumer_regs)
    if over:
        fit = consumer_regs_fit(H200, s.producer_warpgroups, s.producer_regs, s.consumer_warpgroups)
        return ("warpgroups", over, f"use consumer regs <= {fit}")
    rows = WGMMA_ROWS * s.consumer_warpgroups
    if s.tile_q % rows:   # point at what was written: the tile, else the warpgroups that need it
        return ("tile" if "tile" in written else "warpgroups",
                f"tile q = {s.tile_q} is not a multiple of {WGMMA_ROWS} x {s.consumer_warpgroups} consumer "
                f"warpgroups = {rows} (each consumer's wgmma covers {WGMMA_ROWS} rows)", f"use tile q = {rows}")
    if s.pingpong and s.consumer_warpgroups < 2:
        return ("overlap", "pingpong alternates two consumer warpgroups; this kernel has 1",
                "use `consumer 2`, or drop pingpong")
    return None


def _rule_wgmma(spec: KernelSpec, written: set):
    """fa2 on wgmma: whole warpgroups of 4 warps, 64 query rows each; 64-column panels."""
    s, p = spec.schedule, spec.problem
    if spec.family is not Family.FA2 or s.mma is not Mma.WGMMA:
        return None
    if s.warps % 4 or s.tile_q != s.warps // 4 * WGMMA_ROWS:
        fit = max(4, s.tile_q // WGMMA_ROWS * 4)
        return ("warps" if "warps" in written else "tile" if "tile" in written else "mma",
                f"wgmma runs whole warpgroups (4 warps), each owning {WGMMA_ROWS} query rows: {s.warps} warps and "
                f"tile q = {s.tile_q} do not match", f"use warps {fit} with tile q = {fit // 4 * WGMMA_ROWS}")
    if p.head_dim_qk % 64 or p.head_dim_v % 64:
        return ("head_dim" if p.head_dim_qk % 64 else "head_dim_v",
                f"wgmma reads 64-column panels: head dims must be multiples of 64, got "
                f"{p.head_dim_qk}/{p.head_dim_v}", "use mma.sync for other head dims")
    if s.tile_kv > 256:
        return ("tile", f"wgmma's n is at most 256: tile kv = {s.tile_kv}", "use tile kv <= 256")
    threads, chunks = s.warps * 32, max(p.head_dim_qk, p.head_dim_v) // 8
    if threads % chunks or (threads // chunks) % 8:
        return ("head_dim", f"{threads} threads copy whole groups of 8 rows of a {chunks * 8}-wide tile per pass only "
                f"for head dims 64 and 128 (4 warps) or 64, 128 and 256 (8+ warps)", "use mma.sync for this head dim")
    return None


def _rule_warps_fit(spec: KernelSpec, written: set):
    s = spec.schedule
    if spec.family is Family.HOPPER:
        return None
    tile = s.tile_q if s.warp_axis is Axis.Q else s.tile_kv
    if tile % (MMA_ROWS * s.warps):
        default = "" if "warps" in written else " (the default)"
        fits = [w for w in WARP_COUNTS if tile % (MMA_ROWS * w) == 0]
        return ("warps" if "warps" in written else "tile",
                f"{s.warps} warps{default} along {s.warp_axis.value} give each warp {tile / s.warps:g} of "
                f"tile {s.warp_axis.value} = {tile}'s rows; a warp needs a multiple of {MMA_ROWS}",
                f"use warps {fits[-1]}, or tile {s.warp_axis.value} = {MMA_ROWS * s.warps}")
    return None


def _rule_softcap(spec: KernelSpec, written: set):
    """softcap's tanh must move no capped score past mods/softcap.SCORE_ERROR_BUDGET (the way written, or
    the default one)."""
    mods = spec.problem.mods
    if mods.softcap is None:
        return None
    why = softcap_refusal(mods.softcap, mods.softcap_via or DEFAULT_VIA)
    if why:
        written_via = f" via {mods.softcap_via.value}" if mods.softcap_via else ""
        return "softcap", f"softcap = {mods.softcap:g}{written_via}: {why}", EXAMPLES["softcap"]
    return None


RULES = (_rule_family_features, _rule_hopper, _rule_wgmma, _rule_warps_fit, _rule_softcap,
         check_backward.rule_backward)
# Rules whose own hint is a guess at a size: their hint is replaced by schedule edits that check.
_SIZE_RULES = (_rule_warps_fit,)
SUGGESTIONS_SHOWN = 2


def validate(spec: KernelSpec, hints: bool = True) -> None:
    """Raise SpecError for the first rule between values that `spec` breaks, then for what its
    kernel's layout refuses (shapes and resources: the same function lowering calls). With `hints`,
    a refusal over sizes (warps against tiles, shared memory, registers) suggests the nearby schedule
    edits that pass every check, so a hint never leads to the next error; a search space's expansion
    asks for none (only the reasons are kept)."""
    written = {key for key, _ in spec.spans}
    for rule in RULES:
        broken = rule(spec, written)
        if broken:
            key, message, hint = broken
            if hints and rule in _SIZE_RULES:
                hint = _checked_edits(spec) or hint
            raise SpecError(message, spec.span_of(key), spec.source_text, hint)
    try:
        layout_of(spec)
        if spec.backward is not None and not backward_has_template(spec):   # what the backward template can't fit
            backward_layout(spec)
    except SpecError as err:
        edits = _checked_edits(spec) if hints and spec.backward is None else ""
        if not edits:
            raise
        kept = err.hint if err.hint and err.hint != GENERIC_SIZE_HINT else ""   # a computed hint stays first
        raise SpecError(err.message, err.span, err.source_text, f"{kept}; {edits}" if kept else edits) from None


def _checked_edits(spec: KernelSpec) -> str:
    """'e.g. `warps 8` or `tile kv = 32` (each passes every check)' for the first few one-value edits of
    the schedule that make `spec` legal, nearest first; "" when none does."""
    s = spec.schedule
    if spec.family is Family.HOPPER:
        return ""
    edits = [(f"warps {w}", {"warps": w}) for w in sorted(WARP_COUNTS, key=lambda w: abs(w - s.warps) + (w < s.warps))
             if w != s.warps]
    edits += [(f"pipeline {n} stage{'s' if n > 1 else ''}", {"stages": n}) for n in range(s.stages - 1, 0, -1)]
    for axis, size in (("q", s.tile_q), ("kv", s.tile_kv)):
        step = MMA_ROWS * s.warps if s.warp_axis.value == axis else MMA_ROWS   # whole 16-row slices per warp
        near = (size - size % step, size - size % step + step) if size % step else (size - MMA_ROWS, size + MMA_ROWS)
        halved = [(size >> k) - (size >> k) % step for k in range(1, 7)]
        sizes = dict.fromkeys(v for v in (*near, *halved, size * 2) if MMA_ROWS <= v <= MAX_TILE and v % MMA_ROWS == 0
                              and v != size)
        edits += [(f"tile {axis} = {v}", {f"tile_{axis}": v}) for v in sizes]
    passing = []
    for text, fields in edits:
        try:
            validate(dataclasses.replace(spec, schedule=dataclasses.replace(s, **fields)), hints=False)
        except SpecError:
            continue
        passing.append(f"`{text}`")
        if len(passing) == SUGGESTIONS_SHOWN:
            break
    return f"e.g. {' or '.join(passing)} (each passes every check)" if passing else ""
