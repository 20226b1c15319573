"""The search-space figure of `tiledsl explain SPACE --html`: every legal config's on-chip budget (shared memory by
buffer against the limit, registers per thread against theirs) and the tune model's ranking, the numbers
`tiledsl tune SPACE --dry-run` prints at the same shape, drawn so that a person sees why the tuner picked what it
picked. Configs the checker refused are listed with their reasons."""
from __future__ import annotations

from .html_kernel import css_name, svg

ROW_PX = 15
LABEL_PX = 285
BAR_PX = 290
BUDGET_TEXT_PX = 120        # "208 KB, 212 regs" after the limit line
RANK_PX = 200
RANK_X = LABEL_PX + BAR_PX + 30 + BUDGET_TEXT_PX
STATUS_TEXT = {"pending": "timed", "pruned": "pruned", "hopeless": "hopeless", "illegal": "illegal"}


def space_figure(fid: str, space, shape, candidates: list, rejected: list, budget: int, label, layouts: dict,
                 backward: bool) -> dict:
    """`candidates`: the tuner's (tune/search.Candidate) with model ranks; `layouts`: kernel name -> the Layout of
    the kernel its budget is drawn from; `label`: a candidate's short config text."""
    ranked = sorted((c for c in candidates if c.model_rank), key=lambda c: c.model_rank)
    others = [c for c in candidates if not c.model_rank]
    rows = ranked + others
    els = [svg("text", f"{space.name}: {len(candidates) + len(rejected)} configs, {len(rejected)} refused by the "
                       f"checker, {len(candidates)} legal; ranked for batch {shape.batch} x heads {shape.heads}, "
                       f"seqlen {shape.seqlen_q}", x=20, y=18, cls="title"),
           svg("text", "config (model rank)", x=20, y=40, cls="tname"),
           svg("text", "shared memory per block, by buffer (line: the limit)", x=LABEL_PX + 20, y=40, cls="tname"),
           svg("text", ("heuristic rank (tune/backward.py: fewer spills, larger tiles, more warps)" if backward else
                        "predicted TFLOP/s (tune model)"), x=RANK_X, y=40, cls="tname")]
    smem_limit = max((lay.smem_limit for lay in layouts.values()), default=1)
    best = max((c.prediction.tflops for c in candidates if c.prediction), default=1.0) or 1.0
    y = 52
    for c in rows:
        lay = layouts.get(c.name)
        rank = f"#{c.model_rank}" if c.model_rank else "-"
        text = svg("text", f"{rank} {label(c)}", x=20, y=y + 11, cls=f"small st-{c.status}")
        els.append(text)
        x = LABEL_PX + 20
        if lay is not None:
            for b in lay.buffers:
                if b.reuses:
                    continue
                w = b.bytes / smem_limit * BAR_PX
                rect = svg("rect", x=x, y=y + 2, width=max(w, 0.5), height=ROW_PX - 4, cls=f"buf bf-{css_name(b.name)}")
                rect["title"] = f"{b.name}: {b.bytes} B"
                els.append(rect)
                x += w
            regs = c.resources.registers if c.resources else lay.register_estimate
            els.append(svg("text", f"{lay.smem_bytes // 1024} KB, {regs} regs"
                                   f"{' (ptxas)' if c.resources and c.resources.source == 'ptxas' else ''}",
                           x=LABEL_PX + BAR_PX + 26, y=y + 11, cls="small"))
        x0 = RANK_X
        if c.prediction is not None:
            w = c.prediction.tflops / best * RANK_PX
            rect = svg("rect", x=x0, y=y + 2, width=max(w, 0.5), height=ROW_PX - 4, cls=f"rank st-{c.status}")
            rect["title"] = (f"{c.prediction.tflops:.1f} TFLOP/s predicted, {c.prediction.blocks_per_sm} block(s)/SM "
                             f"({c.prediction.occupancy_limit}), bound by {c.prediction.bound}")
            els.append(rect)
            els.append(svg("text", f"{c.prediction.tflops:.0f} · {c.prediction.bound} · {c.prediction.blocks_per_sm}"
                                   f" blk/SM · {STATUS_TEXT.get(c.status, c.status)}", x=x0 + w + 4, y=y + 11,
                           cls="small"))
        elif c.model_rank:
            w = (len(ranked) - c.model_rank + 1) / max(len(ranked), 1) * RANK_PX
            els.append(svg("rect", x=x0, y=y + 2, width=w, height=ROW_PX - 4, cls=f"rank st-{c.status}"))
            els.append(svg("text", STATUS_TEXT.get(c.status, c.status), x=x0 + w + 4, y=y + 11, cls="small"))
        else:
            els.append(svg("text", f"{c.status}: {c.reason}", x=x0, y=y + 11, cls="small"))
        y += ROW_PX
    line_x = LABEL_PX + 20 + BAR_PX
    els.append(svg("line", x1=line_x, y1=48, x2=line_x, y2=y, cls="limit"))
    names = list(dict.fromkeys(b.name for lay in layouts.values() for b in lay.buffers if not b.reuses))
    x = LABEL_PX + 20
    for name in names:   # which colour is which buffer
        els.append(svg("rect", x=x, y=y + 4, width=10, height=10, cls=f"buf bf-{css_name(name)}"))
        els.append(svg("text", name, x=x + 13, y=y + 13, cls="small"))
        x += 20 + 6 * len(name)
    y += 18
    y += 16
    by_reason: dict[str, list[dict]] = {}
    for config, reason in rejected:   # one line per reason: how many configs it refused, and the first of them
        by_reason.setdefault(reason, []).append(config)
    for reason, configs in by_reason.items():
        first = " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in configs[0].items())
        els.append(svg("text", f"refused ({len(configs)}): {reason}", x=20, y=y, cls="small"))
        els[-1]["title"] = f"first of them: {first}"
        y += 13
    pick = ranked[0].name if ranked else "none"
    caption = (f"The tuner times the best {budget} of the {len(candidates)} legal configs by this ranking and keeps "
               f"the fastest; the model's pick is {pick} (stepped through in the next figure). "
               f"`tiledsl tune {space.source_file} --seqlen {shape.seqlen_q} --batch {shape.batch} --heads "
               f"{shape.heads} --dry-run` prints the same ranking.")
    return {"id": fid, "kind": "space", "elements": els, "height": y + 10, "caption": caption, "count": 0}
