"""`tiledsl check SPEC... [--json] [--verbose]`: parse and check spec files and print what they define.

Readable by default: one file prints each kernel's generated name and family with its full config, and
each search space as a summary (size, legal count, a few legal kernels, the rejections grouped by
reason); several files print one line per file and a total. `--verbose` prints every file in full,
every legal kernel and every rejection of a space. Every file is checked: a bad one prints its error
on stderr and the others are still reported; the exit status is 2 when any file failed. `--json`
prints one JSON list with an entry per kernel, space and failed file.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from enum import Enum

from ..frontend.space import SpecSpace
from .common import concrete_specs, read_items
from ..spec import BackwardSchedule, Family, KernelSpec, LoopOrder, Mask, Mma, SeqLayout

LEGAL_SHOWN = 3          # a space's legal kernels named in the summary (--verbose: all)
REASONS_SHOWN = 5        # a space's rejection reasons in the summary, most frequent first (--verbose: every config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (.tile)")
    parser.add_argument("--json", action="store_true", help="print one JSON list of every kernel, space and error")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every file in full: each kernel's config, each legal kernel and rejection of a space")


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
    if p.kv_dtype is not None:
        shown.update(kv_dtype=p.kv_dtype.value, kv_scale=p.kv_scale.value)
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
    if spec.problem.kv_fp8:
        from ..layout.decode import fp8_convert_of
        shown["dequant"] = fp8_convert_of(spec)
    return shown


def _backward_shown(b: BackwardSchedule) -> dict:
    shown = {"order": b.order.value, "tile_q": b.tile_q, "tile_kv": b.tile_kv, "warps": b.warps, "stages": b.stages,
             "mma": b.mma.value}
    if b.order is LoopOrder.KV_OUTER:
        shown["dq"] = b.dq.value
    return shown


def _kernel_layouts(spec: KernelSpec) -> dict:
    """{kernel: Layout} of the spec's forward kernel and its backward module's main kernel (where a template
    builds it): what the register lines describe."""
    from ..families import layout_of
    from ..layout.backward import backward_has_template, backward_layout
    layouts = {"forward": layout_of(spec)}
    if spec.backward is not None and not backward_has_template(spec):
        layouts["backward"] = backward_layout(spec).main
    return layouts


def _registers_json(spec: KernelSpec) -> dict:
    out = {}
    for kernel, lay in _kernel_layouts(spec).items():
        low, high = lay.ptxas_registers or (None, None)
        out[kernel] = {"estimate": lay.register_estimate, "ptxas_low": low, "ptxas_high": high,
                       "ceiling": lay.register_ceiling or None}
    return out


def _kernel_json(spec: KernelSpec) -> dict:
    return {"type": "kernel", "file": spec.source_file, "line": spec.span.line if spec.span else None,
            **spec.config(), "registers": _registers_json(spec)}


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
    if spec.backward is not None:
        print(f"{indent}    backward: {_config_text(_backward_shown(spec.backward))}")
    for kernel, lay in _kernel_layouts(spec).items():
        print(f"{indent}    registers{' (backward)' if kernel == 'backward' else ''}: {lay.register_text}")


def _mod_shown(value) -> str:
    return f"({value[0]}, {value[1]})" if isinstance(value, list) else str(value)


def space_summary(space: SpecSpace, legal: list, rejected: list, verbose: bool) -> list[str]:
    """A space's lines: its counts and choices, then a few legal kernels and the rejections grouped by
    reason (most frequent first), or with `verbose` every legal kernel and every rejected config."""
    lines = [f"space '{space.name}': {space.size} configs, {len(legal)} legal, {len(rejected)} rejected",
             "    choices: " + "; ".join(f"{name} in {{{', '.join(_shown(o) for o in options)}}}"
                                        for name, options in space.choices)]
    if verbose:
        lines += [f"    legal     {spec.kernel_name}" for spec in legal]
        lines += [f"    rejected  {' '.join(f'{k}={_shown(v)}' for k, v in config.items())}: {reason}"
                  for config, reason in rejected]
        return lines
    shown = ", ".join(spec.kernel_name for spec in legal[:LEGAL_SHOWN])
    more = f" and {len(legal) - LEGAL_SHOWN} more" if len(legal) > LEGAL_SHOWN else ""
    if legal:
        lines.append(f"    legal:    {shown}{more}")
    reasons = Counter(reason for _, reason in rejected).most_common()
    for reason, count in reasons[:REASONS_SHOWN]:
        lines.append(f"    rejected: {count} x {reason}")
    if len(reasons) > REASONS_SHOWN:
        lines.append(f"    rejected: {sum(c for _, c in reasons[REASONS_SHOWN:])} more, for "
                     f"{len(reasons) - REASONS_SHOWN} other reasons")
    lines.append("    (--verbose lists every legal kernel and rejected config; `tiledsl tune --dry-run` ranks them)")
    return lines


def _one_line(items: list) -> str:
    """A file's contents in one line: its kernels' names, its spaces' counts."""
    parts = []
    for item in items:
        if isinstance(item, SpecSpace):
            legal, rejected = item.expand()
            parts.append(f"space '{item.name}' ({item.size} configs, {len(legal)} legal)")
        else:
            parts.append(f"{item.kernel_name} ({item.family.value})")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    from .main import error_text
    results, failed, kernels, spaces = [], 0, 0, 0
    detailed = args.verbose or len(args.specs) == 1
    for path in args.specs:
        try:
            items = read_items(path)
            concrete_specs([path], items={path: items})   # two blocks defining one kernel: an error here too
        except Exception as err:   # each file's own error; the others are still checked
            text = error_text(err)
            if text is None:
                raise
            failed += 1
            print(text, file=sys.stderr)
            results.append({"type": "error", "file": str(path), "error": text})
            continue
        kernels += sum(not isinstance(i, SpecSpace) for i in items)
        spaces += sum(isinstance(i, SpecSpace) for i in items)
        if args.json:
            results += [_space_json(i) if isinstance(i, SpecSpace) else _kernel_json(i) for i in items]
        elif detailed:
            print(f"{path}: {len(items)} attention block{'s' if len(items) != 1 else ''}")
            for item in items:
                if isinstance(item, SpecSpace):
                    print("\n".join("  " + line for line in space_summary(item, *item.expand(), args.verbose)))
                else:
                    _print_kernel(item, "  ")
        else:
            print(f"{path}: {_one_line(items)}")
    if args.json:
        print(json.dumps(results, indent=2))
    elif len(args.specs) > 1:
        print(f"{len(args.specs) - failed} of {len(args.specs)} files check: {kernels} kernels, {spaces} spaces"
              + ("" if args.verbose else "  (--verbose: each file in full)"))
    return 2 if failed else 0

