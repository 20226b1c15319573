"""`tiledsl check SPEC... [--json]`: parse and check spec files and print what they define.

A kernel prints its generated name, family and full config; a search space prints its size, how
many configs are legal, each legal kernel and each rejection with its reason. The first spec
error stops the command (cli/main.py prints it and exits 2).
"""
from __future__ import annotations

import argparse
import json
from enum import Enum

from ..frontend.space import SpecSpace
from .common import concrete_specs, read_items
from ..spec import Family, KernelSpec, LoopOrder, Mask, Mma, SeqLayout

MAX_REJECTIONS_SHOWN = 50   # a big space's rejections go to --json; the text stays readable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.tile)")
    parser.add_argument("--json", action="store_true", help="print one JSON list of every kernel and space")


def _plain(value):
    return value.value if isinstance(value, Enum) else value


def _shown(value) -> str:
    """A config value as the DSL writes it, not as Python reprs it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, LoopOrder):
        return f"({value.value})"
    return str(_plain(value))


def _config_text(config: dict) -> str:
    return " ".join(f"{key}={_plain(value)}" for key, value in config.items())


def _problem_shown(spec: KernelSpec) -> dict:
    """The problem fields that mean something for this spec (no window sizes without a window)."""
    p = spec.problem
    shown = {"head_dim_qk": p.head_dim_qk, "head_dim_v": p.head_dim_v, "dtype": p.dtype.value, "mask": p.mask.value}
    if p.mask is Mask.WINDOW:
        shown.update(window_left=p.window_left, window_right=p.window_right)
    shown["softmax_scale"] = p.softmax_scale if p.softmax_scale is not None else f"1/sqrt({p.head_dim_qk})"
    if p.queries_per_seq is not None:
        shown["queries_per_seq"] = p.queries_per_seq
    if p.kv_page_size is not None:
        shown["kv_page_size"] = p.kv_page_size
    if p.seq_layout is not SeqLayout.BATCHED:
        shown["seq_layout"] = p.seq_layout.value
    return shown


def _schedule_shown(spec: KernelSpec) -> dict:
    """The schedule fields of the spec's family: a Hopper kernel runs wgmma whatever `mma` says and
    has warpgroups instead of a warp axis; the other families have no warpgroups or overlap."""
    s = spec.schedule
    shown = {"order": s.order.value, "tile_q": s.tile_q, "tile_kv": s.tile_kv, "warps": s.warps}
    if spec.family is Family.HOPPER:
        shown.update(stages=s.stages, copy=s.copy.value, mma=Mma.WGMMA.value,
                     producer_warpgroups=s.producer_warpgroups, producer_regs=s.producer_regs,
                     consumer_warpgroups=s.consumer_warpgroups, consumer_regs=s.consumer_regs,
                     pingpong=_shown(s.pingpong), intra_overlap=_shown(s.intra_overlap),
                     launch=s.launch.value if s.launch else "the runtime's (by mask and length)",
                     item_order=s.item_order.value if s.item_order else "longest_first (by mask)")
    else:
        shown.update(warp_axis=s.warp_axis.value, stages=s.stages, copy=s.copy.value, mma=s.mma.value)
    shown["split_kv"] = s.split_kv
    return shown


def _kernel_json(spec: KernelSpec) -> dict:
    return {"type": "kernel", "file": spec.source_file, "line": spec.span.line if spec.span else None,
            **spec.config()}


def _space_json(space: SpecSpace) -> dict:
    legal, rejected = space.expand()
    return {"type": "space", "file": space.source_file, "line": space.span.line if space.span else None,
            "name": space.name, "size": space.size, "legal_count": len(legal),
            "choices": {name: [_plain(o) for o in options] for name, options in space.choices},
            "legal": [spec.config() for spec in legal],
            "rejected": [{"config": {k: _plain(v) for k, v in config.items()}, "reason": reason}
                         for config, reason in rejected]}


def _print_kernel(spec: KernelSpec, indent: str = "") -> None:
    print(f"{indent}{spec.kernel_name}  ({spec.family.value}, from '{spec.name}')")
    print(f"{indent}    problem:  {_config_text(_problem_shown(spec))}")
    mods = spec.problem.mods
    if mods.active:   # score and mask modifications, and the aux tensors a launch passes
        print(f"{indent}    modifies: {'; '.join(f'{k} = {_mod_shown(v)}' for k, v in mods.config().items())}")
        aux = ", ".join(f"{a.name} ({a.rank}-d {'float32' if a.dtype.value == 'float' else 'int32'})"
                        for a in mods.user_aux())
        if aux:
            print(f"{indent}    aux:      {aux}")
    print(f"{indent}    schedule: {_config_text(_schedule_shown(spec))}")


def _mod_shown(value) -> str:
    return f"({value[0]}, {value[1]})" if isinstance(value, list) else str(value)


def _print_space(space: SpecSpace) -> None:
    legal, rejected = space.expand()
    print(f"  space '{space.name}': {space.size} configs, {len(legal)} legal, {len(rejected)} rejected")
    print("      choices: " + "; ".join(f"{name} in {{{', '.join(_shown(o) for o in options)}}}"
                                     for name, options in space.choices))
    for spec in legal:
        print(f"      legal     {spec.kernel_name}")
    for config, reason in rejected[:MAX_REJECTIONS_SHOWN]:
        print(f"      rejected  {' '.join(f'{k}={_shown(v)}' for k, v in config.items())}: {reason}")
    if len(rejected) > MAX_REJECTIONS_SHOWN:
        print(f"      ... and {len(rejected) - MAX_REJECTIONS_SHOWN} more rejected (--json lists every one)")


def run(args: argparse.Namespace) -> int:
    results = []
    for path in args.specs:
        items = read_items(path)
        concrete_specs([path], items={path: items})   # two blocks defining one kernel: an error here too
        if args.json:
            results += [_space_json(i) if isinstance(i, SpecSpace) else _kernel_json(i) for i in items]
            continue
        print(f"{path}: {len(items)} attention block{'s' if len(items) != 1 else ''}")
        for item in items:
            _print_space(item) if isinstance(item, SpecSpace) else _print_kernel(item, "  ")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
