"""A schedule unrolled at a small shape: every op instance of the scheduler graph, in emission order, with the
tiles it moves between HBM and one block's on-chip places. `tiledsl explain --html` draws it (cli/html.py); this
module only says what happens, as plain data.

The walk reads the graph and nothing else about the kernel: a loop node runs its trips, an op runs once per trip
of the loops around it, and the trips no query needs are skipped where the traffic model skips them
(schedule/traffic.py): a (q tile, kv tile) pair no query of the q tile sees, a kv tile no query sees. Each HBM
access of an op becomes one Transfer of the current tile's rows (an op of FA1's row passes moves its pass's
rows), so the steps' bytes add up to `hbm_traffic` at the same shape. An op `lag` tiles behind its loop
(Hopper's intra-warpgroup overlap) works on that earlier tile one or two trips later, so such a loop runs its
largest lag in trips past its last tile. What an op reads is what its graph predecessors produced (data edges,
loop-carried ones included); asynchronous work (a cp.async or TMA load, an issued wgmma) is matched with the wait
that completes it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .backward import build_backward_graph
from .graph import ScheduleGraph, has_split_loop
from .masks import key_bounds, tiles_visible
from .ops import EdgeKind, OpKind, Space
from .passes import emission_order
from .splits import split_ranges
from .traffic import element_bytes, hbm_traffic, tile_bounds

# The value each kind of op leaves on chip (one place per name; a ring buffer's place also names its slot).
RESULTS = {
    OpKind.LOAD_Q: ("Q",), OpKind.LOAD_K: ("K",), OpKind.LOAD_V: ("V",), OpKind.LOAD_DO: ("dO",),
    OpKind.LOAD_O: ("O",), OpKind.LOAD_LSE_D: ("LSE", "D"), OpKind.PAGE_LOOKUP: ("pages",),
    OpKind.MMA_QK: ("S",), OpKind.MASK: ("S",), OpKind.LOAD_O_STATE: ("O", "m", "l"),
    OpKind.ONLINE_SOFTMAX: ("P", "m", "l"), OpKind.MMA_PV: ("O",), OpKind.RESCALE_O: ("O",), OpKind.PACK_P: ("P",),
    OpKind.COMBINE_WARPS: ("warp partials", "O", "m", "l"), OpKind.NORMALIZE_O: ("O", "lse"),
    OpKind.MERGE_SPLITS: ("O", "lse"), OpKind.ROWSUM_D: ("D",), OpKind.RECOMPUTE_P: ("P",), OpKind.MMA_DV: ("dV",),
    OpKind.MMA_DP: ("dP",), OpKind.SOFTMAX_GRAD: ("dS",), OpKind.MMA_DK: ("dK",), OpKind.MMA_DQ: ("dQ",),
}
# Register values: their shape in the graph's size symbols (fp32 accumulators; page indices int32, also 4 bytes).
REGISTER_SHAPES = {"S": ("Br", "Bc"), "P": ("Br", "Bc"), "dP": ("Br", "Bc"), "dS": ("Br", "Bc"), "O": ("Br", "dv"),
                   "dO": ("Br", "dv"), "dK": ("Bc", "d"), "dV": ("Bc", "dv"), "dQ": ("Br", "d"), "m": ("Br",),
                   "l": ("Br",), "lse": ("Br",), "LSE": ("Br",), "D": ("Br",), "pages": ("pages",),
                   "warp partials": ("Br", "dv")}
# What a barrier guards, by the first part of its name ("k_full" guards K).
BARRIER_PLACES = {"q": ("Q",), "k": ("K",), "v": ("V",), "kv": ("K", "V"), "scratch": ("warp partials",)}
HBM_SUFFIXES = ("_state", "_part", "_accum")   # O_state, O_part, dQ_accum: on chip they are O, dQ


@dataclass(frozen=True)
class HbmTensor:
    name: str
    axis: str                              # "q" | "kv" | "pages": the tiles that cut its rows
    cols: int
    copies: int                            # split partials: one copy per split; else 1
    element_bytes: int
    tiles: tuple[tuple[int, int], ...]     # [start, stop) rows of each tile

    @property
    def rows(self) -> int:
        return max(stop for _, stop in self.tiles)

    @property
    def bytes(self) -> int:
        return self.copies * self.rows * self.cols * self.element_bytes


@dataclass(frozen=True)
class Place:
    """One on-chip home of a tile or value in one block: a shared buffer (a ring buffer's slot) or registers."""
    name: str                              # "K[1]", "S", "O staging"
    space: str                             # "shared" | "registers"
    bytes: int
    buffer: str = ""                       # the layout buffer a shared place belongs to
    note: str = ""                         # "reuses Q's bytes"; "dense tile model" when no layout sizes it


@dataclass(frozen=True)
class Transfer:
    tensor: str
    mode: str                              # "read" | "write"
    copy: int                              # which split's partial (0 otherwise)
    tile: int                              # which tile of the tensor's axis
    rows: tuple[int, int]                  # [start, stop) rows of the tensor it moves
    cols: int
    bytes: int
    place: str                             # the on-chip place it fills or empties


@dataclass(frozen=True)
class Step:
    op: str                                # graph node
    kind: str
    role: str
    kernel: int                            # index into StepTrace.kernels
    block: tuple[int, ...]                 # trip of each grid loop: the block that runs it
    at: tuple[tuple[str, int], ...]        # (loop var, tile or pass index) of the data it works on, outer -> inner
    trip: int | None                       # the kv loop's trip, where a lag makes it differ from the tile
    text: str
    key: str                               # the DSL setting it comes from
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    waits_on: tuple[str, ...]              # places a barrier guards
    transfers: tuple[Transfer, ...]
    via: str                               # a load's copy: cp.async | tma
    mma: str                               # an MMA's instruction
    barrier: str                           # an arrive's or a wait's barrier
    mask: str                              # a mask op: "full" (nothing masked) | "partial"
    fetched: int                           # HBM bytes read so far, this step included
    stored: int
    done: int | None = None                # asynchronous work: the step that completes it
    issued: int | None = None              # a wait: the step whose work it completes


@dataclass(frozen=True)
class Skip:
    before: int                            # the index of the step it comes before
    kernel: int
    block: tuple[int, ...]
    at: tuple[tuple[str, int], ...]
    why: str


@dataclass(frozen=True)
class KernelTrace:
    name: str                              # the launch: attention | preprocess | backward | convert_dq ...
    grid: tuple[tuple[str, int], ...]      # (var, trips) of its grid loops; () = one block
    places: tuple[Place, ...]
    first: int                             # its steps: [first, stop)
    stop: int


@dataclass(frozen=True)
class StepTrace:
    spec: str
    kernel_name: str
    direction: str                         # forward | backward
    family: str
    seqlen_q: int
    seqlen_kv: int
    tile_q: int
    tile_kv: int
    splits: int | None
    tensors: tuple[HbmTensor, ...]
    kernels: tuple[KernelTrace, ...]
    steps: tuple[Step, ...]
    skips: tuple[Skip, ...]
    tile_map: tuple[tuple[str, ...], ...]  # per (q tile, kv tile): "full" | "partial" | "skipped"

    @property
    def read_bytes(self) -> int:
        return self.steps[-1].fetched if self.steps else 0

    @property
    def write_bytes(self) -> int:
        return self.steps[-1].stored if self.steps else 0


def small_seqlen(tiles) -> int:
    """The step-through's sequence length for kernels with these tile sizes: two whole tiles of the largest and
    a ragged half, so that every kernel of one page walks the same shape (FA1 next to FA2) in a few tiles per axis,
    and the ragged end shows a last tile's mask."""
    largest = max(tiles)
    return 2 * largest + largest // 2


def mask_tile_map(seqlen_q: int, seqlen_kv: int, tile_q: int, tile_kv: int, problem) -> list[list[str]]:
    """Each (q tile, kv tile): "skipped" when no query sees a key, "partial" when a query of the tile does not see
    some column of it (the mask, or keys past the end of a ragged last tile), else "full"."""
    q0, q1 = tile_bounds(seqlen_q, tile_q)
    k0, k1 = tile_bounds(seqlen_kv, tile_kv)
    lo, hi = key_bounds(np.arange(seqlen_q), seqlen_q, seqlen_kv, problem.mask, problem.window_left,
                        problem.window_right)
    out = []
    for a, b in zip(q0, q1):
        row = []
        for c, e in zip(k0, k1):
            seen = int(np.clip(np.minimum(hi[a:b], e) - np.maximum(lo[a:b], c), 0, None).sum())
            # a ragged last tile still computes all Bc columns: its keys past the end are masked
            row.append("skipped" if seen == 0 else "full" if seen == (b - a) * tile_kv else "partial")
        out.append(row)
    return out


class _Walk:
    """One walk over a graph's emission order (see the module docstring)."""

    def __init__(self, graph: ScheduleGraph, seqlen_q: int, seqlen_kv: int, buffers: dict, splits: int | None,
                 rows_per_pass: int):
        self.g, self.spec = graph, graph.spec
        z = graph.sizes
        self.sizes = dict(z, d=self.spec.problem.head_dim_qk, dv=self.spec.problem.head_dim_v)
        p = self.spec.problem
        self.q0, self.q1 = tile_bounds(seqlen_q, z["Br"])
        self.k0, self.k1 = tile_bounds(seqlen_kv, z["Bc"])
        self.page = p.kv_page_size
        self.seen = tiles_visible(self.q0, self.q1, self.k0, self.k1, seqlen_q, seqlen_kv, p.mask, p.window_left,
                                  p.window_right)
        self.tile_map = mask_tile_map(seqlen_q, seqlen_kv, z["Br"], z["Bc"], p)
        self.splits = splits
        self.ranges = split_ranges(len(self.k0), splits) if splits else None
        self.rows_per_pass = rows_per_pass
        self.buffers = buffers               # kernel name -> its layout's Buffers (absent: no layout sizes it)
        self.order = emission_order(graph)
        self.children: dict[str | None, list[str]] = {}
        for n in self.order:
            op = graph.op(n)
            self.children.setdefault(op.loops[-1] if op.loops else None, []).append(n)
        self.preds: dict[str, list[tuple[str, str, EdgeKind]]] = {n: [] for n in self.order}
        for u, v, data in graph.edges():
            self.preds[v].append((u, data["value"], data["kind"]))
        for c in graph.carried:
            self.preds[c.dst].append((c.src, c.value, c.kind))
        self.succs: dict[str, list[tuple[str, str, EdgeKind]]] = {}
        for dst, edges in self.preds.items():
            for src, value, kind in edges:
                self.succs.setdefault(src, []).append((dst, value, kind))
        self.tensors = self._tensors()
        self.steps: list[Step] = []
        self.skips: list[Skip] = []
        self.kernels: list[KernelTrace] = []
        self.places: dict[str, Place] = {}
        self.fetched = self.stored = 0

    # -- HBM tensors and on-chip places
    def _axis_tiles(self, axis: str) -> tuple[tuple[int, int], ...]:
        if axis == "q":
            return tuple(zip(map(int, self.q0), map(int, self.q1)))
        if axis == "kv":
            return tuple(zip(map(int, self.k0), map(int, self.k1)))
        return tuple((int(a) // self.page, -(-int(b) // self.page)) for a, b in zip(self.k0, self.k1))

    def _tensors(self) -> dict[str, HbmTensor]:
        found: dict[str, HbmTensor] = {}
        partials = {a.tensor for n in self.order for a in self.g.op(n).hbm if a.times == "splits"}
        for n in self.order:
            for a in self.g.op(n).hbm:
                if a.tensor not in found:
                    found[a.tensor] = HbmTensor(a.tensor, a.rows, self._cols(a.cols),
                                                self.splits if a.tensor in partials else 1,
                                                element_bytes(a.tensor, self.spec.problem), self._axis_tiles(a.rows))
        return found

    def _cols(self, cols: str) -> int:
        return 1 if cols == "1" else self.sizes[cols]

    def _place(self, kernel: str, name: str, slot: int, op=None) -> str:
        """The place `name` of `kernel` (a ring buffer's slot `slot`), made on first use."""
        buffers = self.buffers.get(kernel)
        buffer = next((b for b in buffers or () if b.name == name), None)
        if buffer is not None:
            label = f"{name}[{slot % buffer.stages}]" if buffer.stages > 1 else name
            if label not in self.places:
                self.places[label] = Place(label, "shared", buffer.stage_bytes if buffer.stages > 1 else buffer.bytes,
                                           name, f"reuses {buffer.reuses}'s bytes" if buffer.reuses else "")
            return label
        if name not in self.places:
            shared = op is not None and op.space is Space.SHARED and name not in REGISTER_SHAPES
            if shared:   # a tile no layout sizes (the backward's helper kernels, a family without a template)
                rows = np.prod([self.sizes[s] for s in op.shape])
                tensor = next((a.tensor for a in op.hbm), name)
                self.places[name] = Place(name, "shared", int(rows) * element_bytes(tensor, self.spec.problem),
                                          "", "dense tile model")
            else:
                shape = REGISTER_SHAPES.get(name, op.shape if op is not None else ())
                self.places[name] = Place(name, "registers", int(np.prod([self.sizes[s] for s in shape])) * 4)
        return name

    def _kernel_places(self, kernel: str) -> None:
        """Every shared buffer of the kernel's layout is a place, used by an op or not (mbarriers, staging)."""
        for b in self.buffers.get(kernel) or ():
            for slot in range(max(b.stages, 1)):
                self._place(kernel, b.name, slot)

    # -- the walk
    def run(self) -> None:
        for top in self.children.get(None, []):
            op = self.g.op(top)
            if op.kind is not OpKind.LOOP:
                raise ValueError(f"{top}: an op outside every loop has no trip to run in")
            self.places = {}
            kernel = op.kernel or top
            self._kernel_places(kernel)
            first = len(self.steps)
            self.kernel = len(self.kernels)
            self.kernel_name = kernel
            self._loop(top, {}, {}, ())
            grid = tuple((self.g.op(n).var, self._trips(n)) for n in self._grid_loops(top))
            self.kernels.append(KernelTrace(kernel, grid, tuple(self.places.values()), first, len(self.steps)))
        self._match_async()

    def _grid_loops(self, top: str) -> list[str]:
        loops, name = [], top
        while name is not None and self.g.op(name).grid:
            loops.append(name)
            name = next((n for n in self.children.get(name, []) if self.g.op(n).kind is OpKind.LOOP
                         and self.g.op(n).grid), None)
        return loops

    def _trips(self, loop: str) -> int:
        var = self.g.op(loop).var
        return {"q": len(self.q0), "kv": len(self.k0), "split": self.splits or 1}[var]

    def _loop(self, loop: str, tile: dict, pos: dict, block: tuple) -> None:
        op = self.g.op(loop)
        var = op.var
        if var == "rows":
            trips = list(range(-(-self.sizes["Br"] // self.rows_per_pass)))
        elif var == "split":
            trips = list(range(self.splits))
        elif var == "q":
            trips = list(range(len(self.q0)))
        elif var == "kv":
            trips = list(range(*self.ranges[tile["split"]])) if "split" in tile else list(range(len(self.k0)))
        else:
            raise ValueError(f"{loop}: no trips for a loop over {var!r}")
        kept, skipped = [], []   # skipped: (the kept trips before it, at, why)
        for t in trips:
            why = self._skip_reason(var, t, tile)
            if why:
                skipped.append((len(kept), tuple(tile.items()) + ((var, t),), why))
            else:
                kept.append(t)
        body = self.children.get(loop, [])
        lag = max((self.g.op(n).lag for n in body), default=0)
        for trip in range(len(kept) + lag + 1):
            for before, at, why in skipped:   # a skipped tile is noted where its trip would have run
                if before == trip:
                    self.skips.append(Skip(len(self.steps), self.kernel, block, at, why))
            for name in body:
                child = self.g.op(name)
                at = trip - child.lag
                if not 0 <= at < len(kept):
                    continue
                inner_tile, inner_pos = dict(tile, **{var: kept[at]}), dict(pos, **{var: at})
                inner_block = block + ((kept[at],) if op.grid else ())
                if child.kind is OpKind.LOOP:
                    self._loop(name, inner_tile, inner_pos, inner_block)
                else:
                    self._emit(name, inner_tile, inner_pos, inner_block, trip if child.lag else None)

    def _skip_reason(self, var: str, t: int, tile: dict) -> str:
        if var == "kv" and "q" in tile and not self.seen[tile["q"], t]:
            return f"no query of q tile {tile['q']} sees a key of kv tile {t}"
        if var == "q" and "kv" in tile and not self.seen[t, tile["kv"]]:
            return f"no query of q tile {t} sees a key of kv tile {tile['kv']}"
        if var == "kv" and "q" not in tile and not self.seen[:, t].any():
            return f"no query sees a key of kv tile {t}"
        return ""

    def _rows(self, axis: str, tile: dict) -> tuple[int, int]:
        if axis == "q":
            start, stop = int(self.q0[tile["q"]]), int(self.q1[tile["q"]])
            if "rows" in tile:   # FA1's row passes: this pass's rows of the q tile
                start, stop = min(start + tile["rows"] * self.rows_per_pass, stop), min(
                    start + (tile["rows"] + 1) * self.rows_per_pass, stop)
            return start, stop
        return self._axis_tiles(axis)[tile["kv"]]

    def _value_places(self, name: str, value: str, seen: set) -> list[tuple[str, str]]:
        """(producer op, value) pairs behind one edge value, looking through barriers to the op that made it."""
        op = self.g.op(name)
        if op.kind in (OpKind.WAIT, OpKind.ARRIVE, OpKind.MMA_WAIT):
            if name in seen:
                return []
            seen.add(name)
            found = []
            for src, _, _ in self.preds[name]:
                found += self._value_places(src, value, seen)
            return found
        return [(name, value)]

    def _reads(self, name: str, slot_of) -> list[str]:
        places = []
        for src, value, kind in self.preds[name]:
            for producer, val in self._value_places(src, value, set()):
                results = RESULTS.get(self.g.op(producer).kind, ())
                # an edge names the values it carries ("Q_i", "m, l"); an unnamed data edge carries all of them
                words = [t.strip().split(" ")[0].split("_")[0] for t in val.split(",")] if val else (
                    list(results) if kind is EdgeKind.DATA else [])
                for word in words:
                    if word in results:
                        places.append(self._place(self.kernel_name, word, slot_of(producer),
                                                  self.g.op(producer)))
        return list(dict.fromkeys(places))

    def _emit(self, name: str, tile: dict, pos: dict, block: tuple, trip: int | None) -> None:
        g, op = self.g, self.g.op(name)

        def slot_of(producer: str) -> int:   # a ring buffer's slot: the trip of the loop its load runs in
            loops = g.op(producer).loops
            return pos.get(g.op(loops[-1]).var, 0) if loops else 0

        reads = self._reads(name, slot_of)
        writes = [self._place(self.kernel_name, r, slot_of(name), op) for r in RESULTS.get(op.kind, ())]
        if op.kind is OpKind.STORE_O and any(b.name == "O staging" for b in self.buffers.get(self.kernel_name) or ()):
            writes.append(self._place(self.kernel_name, "O staging", 0))
        if op.kind is OpKind.CONVERT_GRAD:   # through registers: the fp32 workspace in, the gradient out
            writes = [self._place(self.kernel_name, a.tensor, 0, op) for a in op.hbm if a.mode == "write"]
        waits_on = []
        if op.kind in (OpKind.WAIT, OpKind.ARRIVE):
            for t in BARRIER_PLACES.get(op.barrier.split("_")[0], ()):
                waits_on.append(self._place(self.kernel_name, t, pos.get("kv", 0) if t in ("K", "V") else
                                            pos.get("q", 0)))
        transfers = []
        for a in op.hbm:
            tensor = self.tensors[a.tensor]
            rows = self._rows(a.rows, tile)
            copies = range(self.splits) if a.times == "splits" else [tile.get("split", 0) if tensor.copies > 1 else 0]
            on_chip = a.tensor
            for suffix in HBM_SUFFIXES:
                on_chip = on_chip.removesuffix(suffix)
            mine = writes if a.mode == "read" else writes + reads   # a store leaves from its staging buffer
            place = next((p for p in mine if p.split("[")[0] == on_chip), mine[0] if mine else "")
            if a.mode == "write" and place.split("[")[0] != on_chip and on_chip in REGISTER_SHAPES and not (
                    mine and mine[0] in writes):   # m and l of FA1's state leave from their registers
                place = self._place(self.kernel_name, on_chip, 0)
                reads.append(place)
            for c in copies:
                nbytes = (rows[1] - rows[0]) * tensor.cols * tensor.element_bytes
                transfers.append(Transfer(a.tensor, a.mode, c, tile["kv" if a.rows != "q" else "q"], rows,
                                          tensor.cols, nbytes, place))
                if a.mode == "read":
                    self.fetched += nbytes
                else:
                    self.stored += nbytes
        mask = ""
        if op.kind is OpKind.MASK:
            mask = "partial" if self.tile_map[tile["q"]][tile["kv"]] == "partial" else "full"
        at = tuple((g.op(loop).var, tile[g.op(loop).var]) for loop in op.loops)
        self.steps.append(Step(name, op.kind.value, op.role.value, self.kernel, block, at, trip, op.text, op.key,
                               tuple(reads), tuple(writes), tuple(waits_on), tuple(transfers), op.via, op.mma,
                               op.barrier, mask, self.fetched, self.stored))

    # -- asynchronous work and the waits that complete it
    def _completion(self, name: str) -> str | None:
        """The wait that completes `name`'s asynchronous work: a wait its data flows into, else the first wait its
        sync edges reach through arrives (a TMA load -> arrive k_full -> wait k_full)."""
        succ = self.succs
        waits = (OpKind.WAIT, OpKind.MMA_WAIT)
        for dst, _, kind in succ.get(name, []):
            if kind is EdgeKind.DATA and self.g.op(dst).kind in waits:
                return dst
        frontier, seen = [name], {name}
        while frontier:
            nxt = []
            for n in frontier:
                for dst, _, kind in succ.get(n, []):
                    if kind is not EdgeKind.SYNC or dst in seen:
                        continue
                    if self.g.op(dst).kind in waits:
                        return dst
                    if self.g.op(dst).kind is OpKind.ARRIVE:
                        seen.add(dst)
                        nxt.append(dst)
            frontier = nxt
        return None

    def _is_async(self, name: str) -> bool:
        op = self.g.op(name)
        loads = (OpKind.LOAD_Q, OpKind.LOAD_K, OpKind.LOAD_V)
        return (op.kind in loads and op.via in ("cp.async", "tma")) or (
            op.kind in (OpKind.MMA_QK, OpKind.MMA_PV) and op.mma == "wgmma")

    def _match_async(self) -> None:
        index = {(s.op, s.kernel, s.block, s.at): i for i, s in enumerate(self.steps)}
        completion = {n: self._completion(n) for n in self.order if self._is_async(n)}
        for i, s in enumerate(self.steps):
            wait = completion.get(s.op)
            if wait is None:
                continue
            depth = len(self.g.op(wait).loops)
            j = index.get((wait, s.kernel, s.block, s.at[:depth]))
            if j is not None and j > i:
                self.steps[i] = replace(s, done=j)
                self.steps[j] = replace(self.steps[j], issued=i)


def trace_graph(graph: ScheduleGraph, seqlen_q: int, seqlen_kv: int, buffers: dict | None = None,
                splits: int | None = None, rows_per_pass: int | None = None, direction: str = "forward") -> StepTrace:
    """Unroll `graph` at one (batch, head) of seqlen_q x seqlen_kv. `buffers`: each kernel's layout buffers, by
    the kernel's name; `splits`: the split count of a split-KV graph; `rows_per_pass`: FA1's rows per pass."""
    spec = graph.spec
    w = _Walk(graph, seqlen_q, seqlen_kv, buffers or {}, splits, rows_per_pass or graph.sizes["Br"])
    w.run()
    return StepTrace(spec.name, spec.kernel_name, direction, spec.family.value, seqlen_q, seqlen_kv,
                     graph.sizes["Br"], graph.sizes["Bc"], splits, tuple(w.tensors.values()), tuple(w.kernels),
                     tuple(w.steps), tuple(w.skips), tuple(tuple(r) for r in w.tile_map))


def forward_trace(graph: ScheduleGraph, seqlen_q: int, seqlen_kv: int, blocks_per_sm: int = 1) -> StepTrace:
    """The forward kernel of an annotated graph (schedule/passes.run_passes) at one (batch, head); split kv = auto
    takes the split count the traffic model picks for that shape."""
    splits = None
    if has_split_loop(graph.spec):
        splits = hbm_traffic(graph, 1, 1, seqlen_q, seqlen_kv, blocks_per_sm=blocks_per_sm).splits
    lay = graph.layout
    rows = lay.rows_per_warp if graph.spec.family.value == "fa1" and graph.sizes.get("kv_groups", 1) > 1 else None
    return trace_graph(graph, seqlen_q, seqlen_kv, {"attention": lay.buffers} if lay else {}, splits, rows)


def backward_trace(spec, seqlen_q: int, seqlen_kv: int) -> StepTrace:
    """The backward module of `spec`'s `backward { }` schedule (its kernels in launch order) at one (batch, head);
    the main kernel's and the dQ kernel's buffers from the backward layout when a template builds them."""
    from ..layout.backward import backward_has_template, backward_layout
    graph = build_backward_graph(spec)
    buffers = {}
    if not backward_has_template(spec):
        lay = backward_layout(spec)
        buffers["backward"] = lay.main.buffers
        if lay.dq_kernel:
            buffers["backward_dq"] = lay.dq_kernel
    return trace_graph(graph, seqlen_q, seqlen_kv, buffers, direction="backward")
