"""`tiledsl explain SPEC --html OUT.html`: one self-contained page that steps through each kernel of the specs.

The steps are the step trace's (schedule/trace.py: every op instance of the scheduler graph at a small shape, in
emission order); this module only draws them: it places HBM tensors and one block's on-chip places to scale by
bytes, and turns each step into the changes it makes to the drawing (which tiles move where, which places are
read and written, the running byte counters, the timeline's cursor). The page template
(templates/explain_page.html.j2) spells the elements and carries a little JavaScript that applies the changes; it
computes nothing. A search space gets a figure of its legal configs' budgets and the tune model's ranking
(cli/html_space.py), then the step-through of the model's pick.
"""
from __future__ import annotations

import json

from .report import human, source_tag
from ..schedule.trace import StepTrace

WIDTH = 1100
HBM_TOP, HBM_HEIGHT, HBM_WIDTH = 56, 190, 700
MIN_TILE_PX = 7                    # a tile drawn smaller than this would vanish: drawn at this size, not to scale
MIN_PLACE_PX = 6
PLACE_HEIGHT = 34
STEP_PX = 16                       # the timeline's width of one step
LANE_PX = 16
MAP_CELL = 16                      # the (q tile, kv tile) map and the block grid
SHADES = 4                         # a place or tile turns darker with each update, up to this many shades
ROLE_NAMES = {"all": "all warps", "producer": "producer warpgroup", "consumer": "consumer warpgroups"}


def svg(tag: str, text: str = "", **attrs) -> dict:
    """One SVG element for the template: its tag, attributes (`cls` is the class) and text."""
    return {"tag": tag, "attrs": [("class" if k == "cls" else k.replace("_", "-"), _attr(v)) for k, v in
                                  attrs.items() if v is not None], "text": text, "title": ""}


def _attr(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _tiles_label(at) -> str:
    names = {"q": "q tile", "kv": "kv tile", "split": "split", "rows": "row pass"}
    return ", ".join(f"{names[var]} {i}" for var, i in at) or "once per block"


class KernelFigure:
    """The drawing and the per-step changes of one StepTrace."""

    def __init__(self, fid: str, trace: StepTrace, spec, model: dict):
        self.fid, self.trace, self.spec = fid, trace, spec
        self.model = model                             # the traffic model at the trace's shape: {"read", "write"} B
        self.elements: list[dict] = []
        self.base: dict[str, list] = {}                # dynamic element id -> [class, text]
        self.anchor: dict[str, tuple[float, float, float, float]] = {}   # id -> x, y, w, h
        self.tile_ids: dict[tuple[str, int, int], str] = {}
        self.place_ids: dict[tuple[int, str], str] = {}
        self.counter_ids: dict[str, str] = {}
        self.groups: dict[int, str] = {}              # kernel -> the group of its on-chip places
        self._draw()

    # -- drawing
    def _dyn(self, key: str, cls: str, text: str = "") -> str:
        eid = f"{self.fid}-{key}"
        self.base[eid] = [cls, text]
        return eid

    def _draw(self) -> None:
        self._hbm()
        self._maps()
        y = self._chip(self.hbm_bottom + 44)
        y = self._counters(y + 18)
        self._timeline(y + 16)

    def _hbm(self) -> None:
        t, els = self.trace, self.elements
        tensors = list(t.tensors)
        bytes_per_row = [x.cols * x.element_bytes for x in tensors]
        gap = 18
        sx = (HBM_WIDTH - gap * len(tensors)) / max(sum(b * x.copies for b, x in zip(bytes_per_row, tensors)), 1)
        rows = max(max(x.rows for x in tensors), 1)
        sy = HBM_HEIGHT / rows
        els.append(svg("text", f"HBM: one (batch, head) at seqlen q {t.seqlen_q}, kv {t.seqlen_kv}; widths are bytes "
                               f"per row, heights rows (tiles of {t.tile_q} q / {t.tile_kv} kv rows)",
                       x=20, y=20, cls="title"))
        x, bottom = 20.0, HBM_TOP
        for tensor, per_row in zip(tensors, bytes_per_row):
            width = max(per_row * sx, MIN_PLACE_PX)
            scaled = per_row * sx >= MIN_PLACE_PX and all((b - a) * sy >= MIN_TILE_PX for a, b in tensor.tiles)
            label = f"{tensor.name}{'' if scaled else '*'}"
            els.append(svg("text", label, x=x + width * tensor.copies / 2, y=HBM_TOP - 8, cls="tname",
                           text_anchor="middle"))
            for copy in range(tensor.copies):
                y = float(HBM_TOP)
                for i, (a, b) in enumerate(tensor.tiles):
                    h = max((b - a) * sy, MIN_TILE_PX)
                    eid = self._dyn(f"t-{tensor.name}-{copy}-{i}", f"tile t-{css_name(tensor.name)}")
                    self.tile_ids[(tensor.name, copy, i)] = eid
                    self.anchor[eid] = (x, y, width, h)
                    els.append(svg("rect", id=eid, x=x, y=y, width=width, height=h, cls=self.base[eid][0]))
                    els[-1]["title"] = (f"{tensor.name}{f' split {copy}' if tensor.copies > 1 else ''} tile {i}: "
                                        f"rows {a}-{b - 1}, {(b - a) * per_row} B")
                    y += h
                bottom = max(bottom, y)
                x += width
            x += gap
        y = bottom + 16
        if any(e["text"].endswith("*") for e in els if e["tag"] == "text"):
            els.append(svg("text", "* drawn larger than to scale, so that it shows", x=20, y=y, cls="small"))
            y += 14
        for n, tensor in enumerate(tensors):   # running bytes and tiles moved per tensor, two to a row
            counter = self._dyn(f"c-{tensor.name}", "tcount", f"{tensor.name}: -")
            self.counter_ids[tensor.name] = counter
            els.append(svg("text", f"{tensor.name}: -", id=counter, x=20 + (n % 2) * 360, y=y + (n // 2) * 13,
                           cls="tcount"))
        bottom = y + 13 * (-(-len(tensors) // 2))
        self.hbm_bottom = bottom + 18

    def _maps(self) -> None:
        """The (q tile, kv tile) map of the mask (full, partial, skipped) and the grid of blocks."""
        t, els = self.trace, self.elements
        x0, y0 = HBM_WIDTH + 60, HBM_TOP
        els.append(svg("text", "S tiles: q tile (row) x kv tile (column)", x=x0, y=HBM_TOP - 8, cls="tname"))
        for i, row in enumerate(t.tile_map):
            for j, state in enumerate(row):
                eid = self._dyn(f"m-{i}-{j}", f"cell {state}")
                els.append(svg("rect", id=eid, x=x0 + j * MAP_CELL, y=y0 + i * MAP_CELL, width=MAP_CELL - 2,
                               height=MAP_CELL - 2, cls=self.base[eid][0]))
                els[-1]["title"] = f"q tile {i}, kv tile {j}: {state}"
        y = y0 + len(t.tile_map) * MAP_CELL + 10
        for cls, text in (("full", "full tile"), ("partial", "partly masked"), ("skipped", "skipped")):
            els.append(svg("rect", x=x0, y=y, width=10, height=10, cls=f"cell {cls}"))
            els.append(svg("text", text, x=x0 + 14, y=y + 9, cls="small"))
            y += 14
        y += 10
        self.block_ids: dict[tuple[int, tuple], str] = {}
        for k, kernel in enumerate(t.kernels):
            extents = [n for _, n in kernel.grid] or [1]
            vars_ = " x ".join(f"{v} tiles" if v != "split" else "splits" for v, _ in kernel.grid) or "one block"
            els.append(svg("text", f"kernel {kernel.name}: blocks ({vars_})", x=x0, y=y + 10, cls="small"))
            y += 16
            cols = extents[-1] if len(extents) > 1 else min(extents[0], 16)
            count = 1
            for n in extents:
                count *= n
            for b in range(count):
                index = _unflatten(b, extents) if kernel.grid else ()
                eid = self._dyn(f"b-{k}-{b}", "blk")
                self.block_ids[(k, index)] = eid
                els.append(svg("rect", id=eid, x=x0 + (b % cols) * MAP_CELL, y=y + (b // cols) * MAP_CELL,
                               width=MAP_CELL - 3, height=MAP_CELL - 3, cls="blk"))
                els[-1]["title"] = f"block {index}" if index else "the only block"
            y += (-(-count // cols)) * MAP_CELL + 10
        self.hbm_bottom = max(self.hbm_bottom, y + 8)

    def _chip(self, top: float) -> float:
        """Each kernel's on-chip places, one group per kernel (shown while its steps run)."""
        els = self.elements
        y_end = top
        for k, kernel in enumerate(self.trace.kernels):
            group = self._dyn(f"g-{k}", "kgroup" if k == 0 else "kgroup off")
            self.groups[k] = group
            els.append({"tag": "g-open", "attrs": [("id", group), ("class", self.base[group][0])], "text": ""})
            shared = [p for p in kernel.places if p.space == "shared"]
            registers = [p for p in kernel.places if p.space == "registers"]
            # one scale for both rows, so that the wider row fits (a place that reuses another's bytes is drawn too)
            widest = max((places for places in (shared, registers)), key=lambda ps: sum(p.bytes for p in ps))
            sx = (WIDTH - 40 - (MIN_PLACE_PX + 2) * len(widest)) / max(sum(p.bytes for p in widest), 1)
            y = top
            for title, places in ((f"kernel {kernel.name}, one block: shared memory", shared),
                                  ("registers (fp32 tiles of the whole block)", registers)):
                used = sum(p.bytes for p in places if not p.note.startswith("reuses"))
                els.append(svg("text", f"{title}: {used} B", x=20, y=y, cls="title"))
                x = 20.0
                for n, p in enumerate(places):
                    w = max(p.bytes * sx, MIN_PLACE_PX)
                    eid = self._dyn(f"p-{k}-{css_name(p.name)}", f"place {p.space}")
                    label = self._dyn(f"pl-{k}-{css_name(p.name)}", "plabel", "")
                    self.place_ids[(k, p.name)] = eid
                    self.place_ids[(k, p.name, "label")] = label
                    self.anchor[eid] = (x, y + 8, w, PLACE_HEIGHT)
                    els.append(svg("rect", id=eid, x=x, y=y + 8, width=w, height=PLACE_HEIGHT, cls=f"place {p.space}"))
                    els[-1]["title"] = f"{p.name}: {p.bytes} B" + (f" ({p.note})" if p.note else "")
                    els.append(svg("text", "", id=label, x=x + 3, y=y + 8 + PLACE_HEIGHT / 2 + 4, cls="plabel"))
                    stagger = 11 * (n % 3) if w < 60 else 0   # narrow neighbours' names on three lines
                    els.append(svg("text", p.name, x=x + w / 2, y=y + 8 + PLACE_HEIGHT + 12 + stagger, cls="pname",
                                   text_anchor="middle"))
                    x += w + 2
                y += PLACE_HEIGHT + 52
            els.append({"tag": "g-close", "attrs": [], "text": ""})
            y_end = max(y_end, y)
        return y_end

    def _counters(self, y: float) -> float:
        self.fetched_id = self._dyn("fetched", "counter", "fetched from HBM: 0 B")
        self.stored_id = self._dyn("stored", "counter", "stored to HBM: 0 B")
        self.elements.append(svg("text", "fetched from HBM: 0 B", id=self.fetched_id, x=20, y=y, cls="counter"))
        self.elements.append(svg("text", "stored to HBM: 0 B", id=self.stored_id, x=330, y=y, cls="counter"))
        self.elements.append(svg("text", f"traffic model at this shape: read {self.model['read']} B, written "
                                 f"{self.model['write']} B", x=620, y=y, cls="small"))
        return y

    def _timeline(self, top: float) -> None:
        """One lane per role (a step's slot), and lanes of asynchronous work in flight (issue to wait), stacked
        where bars overlap."""
        t, els = self.trace, self.elements
        roles = list(dict.fromkeys(s.role for s in t.steps))
        bars = {"copy": [], "mma": [], "turn": []}
        for i, s in enumerate(t.steps):
            if s.done is not None:
                bars["copy" if s.transfers else "mma"].append((i, s.done, s))
            if s.kind == "wait" and s.barrier == "turn":
                end = next((j for j in range(i + 1, len(t.steps)) if t.steps[j].barrier == "turn"
                            and t.steps[j].kind == "arrive" and t.steps[j].at == s.at), None)
                if end is not None:
                    bars["turn"].append((i, end, s))
        via = "/".join(sorted({s.via for _, _, s in bars["copy"]}))
        lanes = [(ROLE_NAMES.get(r, r), "role", r) for r in roles]
        names = {"copy": f"loads in flight ({via})", "mma": "wgmma in flight", "turn": "ping-pong turn held"}
        packed = {k: _pack(v) for k, v in bars.items()}
        for k in ("copy", "mma", "turn"):
            lanes += [(names[k] if row == 0 else "", k, row) for row in range(len(packed[k]))]
        x0, clip_w = 170, WIDTH - 190
        height = LANE_PX * len(lanes) + 8
        els.append(svg("text", "timeline: steps in emission order (bars: work in flight from its issue to the wait "
                               "that completes it)", x=20, y=top, cls="title"))
        top += 8
        clip = f"{self.fid}-clip"
        els.append({"tag": "clip", "attrs": [("id", clip), ("x", x0), ("y", top), ("width", clip_w),
                                             ("height", height)], "text": ""})
        for n, (name, _, _) in enumerate(lanes):
            els.append(svg("text", name, x=20, y=top + n * LANE_PX + 12, cls="small"))
            els.append(svg("rect", x=x0, y=top + n * LANE_PX, width=clip_w, height=LANE_PX - 2, cls="lane"))
        self.track_id = f"{self.fid}-track"
        els.append({"tag": "g-open", "attrs": [("clip-path", f"url(#{clip})")], "text": ""})
        els.append({"tag": "g-open", "attrs": [("id", self.track_id)], "text": ""})
        lane_index = {(kind, key): n for n, (_, kind, key) in enumerate(lanes)}
        for i, s in enumerate(t.steps):
            n = lane_index[("role", s.role)]
            rect = svg("rect", x=x0 + i * STEP_PX, y=top + n * LANE_PX + 1, width=STEP_PX - 2, height=LANE_PX - 4,
                       cls=f"op k-{css_name(s.kind)}")
            rect["title"] = f"{i}. {s.op}: {s.text}"
            els.append(rect)
        for kind, rows in packed.items():
            for row, items in enumerate(rows):
                for a, b, s in items:
                    n = lane_index[(kind, row)]
                    rect = svg("rect", x=x0 + a * STEP_PX, y=top + n * LANE_PX + 2, width=(b - a + 1) * STEP_PX - 2,
                               height=LANE_PX - 6, cls=f"bar b-{kind}")
                    rect["title"] = f"{s.op} ({_tiles_label(s.at)}): steps {a}-{b}"
                    els.append(rect)
        els.append({"tag": "g-close", "attrs": [], "text": ""})
        els.append({"tag": "g-close", "attrs": [], "text": ""})
        # the track slides under a fixed cursor: the current step stays in the middle of the lanes
        self.track_shift = clip_w / 2 - STEP_PX / 2
        els.append(svg("rect", x=x0 + self.track_shift - 2, y=top - 2, width=STEP_PX + 2, height=height, cls="cursor"))
        self.height = top + height + 10

    # -- the steps
    def steps(self) -> list[dict]:
        """Per step: its list label, caption lines, arrows and the element changes from the step before."""
        t = self.trace
        current = {k: list(v) for k, v in self.base.items()}
        content: dict[tuple[int, str], tuple[str, int]] = {}
        tile_counts: dict[tuple[str, int, int], list[int]] = {}
        tensor_totals = {x.name: [0, 0, 0, 0] for x in t.tensors}   # bytes read, written; tiles read, written
        out, previous_touched, block_before = [], set(), None
        for i, s in enumerate(t.steps):
            state: dict[str, list] = {}

            def put(eid, cls=None, text=None):
                old = state.get(eid, list(current[eid]))
                state[eid] = [old[0] if cls is None else cls, old[1] if text is None else text]

            for eid in previous_touched:   # last step's highlights fade
                put(eid, cls=_strip_active(current[eid][0]))
            touched = set()
            # an op outside the inner grid loops (split-KV's merge) runs in one of those blocks: the last one drawn
            grid = [n for _, n in t.kernels[s.kernel].grid]
            block = (s.kernel, s.block + tuple(n - 1 for n in grid[len(s.block):]))
            if block != block_before:   # a new block: its places start empty
                for (k, name), eid in ((key, v) for key, v in self.place_ids.items() if len(key) == 2):
                    if k == s.kernel:
                        put(eid, cls=self.base[eid][0])
                        put(self.place_ids[(k, name, "label")], text="")
                        content.pop((k, name), None)
                if block_before in self.block_ids:
                    put(self.block_ids[block_before], cls="blk done")
                put(self.block_ids[block], cls="blk now")
                for k, group in self.groups.items():
                    put(group, cls="kgroup" if k == s.kernel else "kgroup off")
                block_before = block
            arrows = []
            for x in s.transfers:
                tile = self.tile_ids[(x.tensor, x.copy, x.tile)]
                counts = tile_counts.setdefault((x.tensor, x.copy, x.tile), [0, 0])
                counts[x.mode == "write"] += 1
                totals = tensor_totals[x.tensor]
                totals[x.mode == "write"] += x.bytes
                totals[2 + (x.mode == "write")] += 1
                cls = f"tile t-{css_name(x.tensor)} {'rd' if x.mode == 'read' else 'wr'}"
                put(tile, cls=_shade(cls, counts[1]))
                touched.add(tile)
                most = [max((c[m] for (name, _, _), c in tile_counts.items() if name == x.tensor)) for m in (0, 1)]
                put(self.counter_ids[x.tensor], text=f"{x.tensor}: R {human(totals[0])} x{totals[2]} (<={most[0]}/tile)"
                                                     f"   W {human(totals[1])} x{totals[3]} (<={most[1]}/tile)")
                place = self.place_ids.get((s.kernel, x.place))
                if place:
                    arrows.append(self._arrow(tile, place, x.mode))
                if x.mode == "read" and x.place:
                    content[(s.kernel, x.place)] = (f"{x.tensor}_{x.tile}" + (f" s{x.copy}" if x.copy else ""), 0)
            for name in s.reads:
                eid = self.place_ids[(s.kernel, name)]
                put(eid, cls=_strip_active(state.get(eid, current[eid])[0]) + " rd")
                touched.add(eid)
            for name in s.waits_on:
                eid = self.place_ids[(s.kernel, name)]
                put(eid, cls=_strip_active(state.get(eid, current[eid])[0]) + " wt")
                touched.add(eid)
            for name in s.writes:
                eid = self.place_ids[(s.kernel, name)]
                label, version = content.get((s.kernel, name), ("", -1))
                if not any(x.place == name and x.mode == "read" for x in s.transfers):
                    label, version = f"{name.split('[')[0]} {_short_at(s.at)}", version + 1
                content[(s.kernel, name)] = (label, version)
                put(eid, cls=_shade(_strip_active(state.get(eid, current[eid])[0]), version) + " wr")
                put(self.place_ids[(s.kernel, name, "label")], text=label)
                touched.add(eid)
            tiles = dict(s.at)
            if "q" in tiles and "kv" in tiles:   # the S tile the step works on, in the mask's map
                cell = f"{self.fid}-m-{tiles['q']}-{tiles['kv']}"
                put(cell, cls=_strip_active(current[cell][0]) + " cur")
                touched.add(cell)
            put(self.fetched_id, text=f"fetched from HBM: {s.fetched:,} B")
            put(self.stored_id, text=f"stored to HBM: {s.stored:,} B")
            changes = {eid: v for eid, v in state.items() if v != current[eid]}
            current.update(changes)
            previous_touched = touched
            out.append({"label": self._label(i, s), "caption": self._caption(i, s), "set": changes,
                        "arrows": arrows, "shift": round(self.track_shift - i * STEP_PX, 1)})
        return out

    def _arrow(self, tile: str, place: str, mode: str) -> list:
        tx, ty, tw, th = self.anchor[tile]
        px, py, pw, _ = self.anchor[place]
        hbm = (tx + tw / 2, ty + th)
        chip = (px + pw / 2, py)
        a, b = (hbm, chip) if mode == "read" else (chip, hbm)
        return [round(a[0], 1), round(a[1], 1), round(b[0], 1), round(b[1], 1), mode]

    def _label(self, i: int, s) -> str:
        where = _short_at(s.at)
        return f"{i}. {where + ' ' if where else ''}{s.op}"

    def _caption(self, i: int, s) -> list[str]:
        t = self.trace
        kernel = t.kernels[s.kernel]
        block = ", ".join(f"{v} {b}" for (v, _), b in zip(kernel.grid, s.block)) or "the only block"
        lines = [f"step {i + 1} of {len(t.steps)} · kernel {kernel.name} · block ({block}) · {_tiles_label(s.at)}"
                 + (f" · kv trip {s.trip} (the op runs {s.trip - dict(s.at)['kv']} tile(s) behind)" if s.trip is not
                    None else ""),
                 f"{ROLE_NAMES.get(s.role, s.role)}: {s.text}   {source_tag(self.spec, s.key)}"]
        if s.reads or s.writes:
            lines.append(f"reads {', '.join(s.reads) or '-'}; writes {', '.join(s.writes) or '-'}")
        for x in s.transfers:
            arrow = f"HBM -> {x.place}" if x.mode == "read" else f"{x.place} -> HBM"
            how = f" via {s.via}" if s.via and x.mode == "read" else ""
            lines.append(f"{x.tensor} tile {x.tile}{f' of split {x.copy}' if t.splits and x.copy else ''} "
                         f"(rows {x.rows[0]}-{x.rows[1] - 1}, {x.bytes:,} B): {arrow}{how}")
        if s.mask:
            lines.append("this tile is partly masked: the mask runs" if s.mask == "partial" else
                         "no query of this tile is masked")
        if s.done is not None:
            lines.append(f"asynchronous: in flight until step {s.done + 1} ({t.steps[s.done].op})")
        if s.issued is not None:
            lines.append(f"completes step {s.issued + 1} ({t.steps[s.issued].op})")
        return lines

    def figure(self) -> dict:
        t = self.trace
        skips = {}
        for skip in t.skips:
            skips.setdefault(skip.before, []).append(f"skipped: {_tiles_label(skip.at)} ({skip.why})")
        steps = self.steps()
        items = []
        for i, step in enumerate(steps):
            items += [{"skip": text} for text in skips.get(i, [])]
            items.append({"step": i, "label": step["label"]})
        items += [{"skip": text} for text in skips.get(len(steps), [])]
        return {"id": self.fid, "kind": "kernel", "elements": self.elements, "height": round(self.height),
                # "<" escaped: no text of a step can close the <script> that holds the data
                "entries": items, "data": json.dumps({"base": self.base, "steps": steps, "track": self.track_id},
                                                   separators=(",", ":")).replace("<", "\\u003c"),
                "model": self.model, "count": len(steps), "last": len(steps) - 1}


def _pack(bars):
    """Bars (start, end, step) into rows where none overlap, first fit in start order."""
    rows: list[list] = []
    for bar in sorted(bars, key=lambda b: (b[0], b[1])):
        for row in rows:
            if row[-1][1] < bar[0]:
                row.append(bar)
                break
        else:
            rows.append([bar])
    return rows


def _unflatten(b: int, extents: list[int]) -> tuple[int, ...]:
    index = []
    for n in reversed(extents):
        index.append(b % n)
        b //= n
    return tuple(reversed(index))


def css_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _strip_active(cls: str) -> str:
    return " ".join(w for w in cls.split() if w not in ("rd", "wr", "wt", "cur"))


def _shade(cls: str, version: int) -> str:
    words = [w for w in cls.split() if not (w.startswith("v") and w[1:].isdigit())]
    return " ".join(words + [f"v{min(max(version, 0), SHADES - 1)}"])


def _short_at(at) -> str:
    names = {"q": "q", "kv": "kv", "split": "s", "rows": "pass"}
    return " ".join(f"{names[v]}{i}" for v, i in at)
