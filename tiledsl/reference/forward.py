"""The float64 reference: the scheduler graph executed in NumPy, and textbook attention.

`reference_attention` walks the graph in emission order, trip by trip, with the schedule's own
tiles (Br, Bc), loop order, tile skipping, split ranges and merge: FA1 keeps O (normalised), m
and l in "HBM" arrays and round-trips them at every kv step; FA2 keeps an unnormalised O on
chip and divides once. Agreement with `naive_attention` to 1e-12 shows the schedule computes
exact attention before any GPU is involved.

Arrays are (batch, heads, seq, dim); k and v may have fewer heads (GQA: query head h reads kv
head h // (heads / kv_heads)). Masks are aligned to the bottom-right corner: with
off = kv_len - q_len, causal shows key j to query i iff j <= i + off, a window iff
i + off - left <= j <= i + off + right. A row that sees no key gets O = 0 and LSE = -inf, and no
NaN is ever formed (no exp(-inf - -inf)).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..device_limits import H200
from ..schedule.ops import OpKind, Space
from ..schedule.graph import ScheduleGraph, has_split_loop
from ..schedule.passes import run_passes
from ..schedule.masks import key_bounds
from ..spec import KernelSpec, Mask
from ..schedule.splits import choose_splits, split_ranges
from ..schedule.tiles import EMPTY, FULL, Tiling, classify
from ..errors import RuntimeInputError
from ..mods.checks import prepare_aux
from ..mods.model import AUX_SINKS
from ..mods.numeric import Grid, dropout_keep, grid, modified_scores
from ..mods.numeric import visible as modified_visible

# naive_attention materialises at most this many scores at a time (32 MB of float64).
CHUNK_ELEMENTS = 1 << 22


def array_module(x):
    """CuPy for a CuPy array (reference/gpu.py checks GPU results on the GPU), else NumPy."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def _finite_or_zero(m, xp=np):
    """The max to subtract: a row that has seen only -inf subtracts 0, so exp gives 0, not NaN."""
    return xp.where(xp.isfinite(m), m, 0.0)


def _lse_and_divide(total, m, acc, xp=np):
    """(acc / total, m + log total) with rows of total 0 giving (0, -inf)."""
    seen = total > 0
    safe = xp.where(seen, total, 1.0)
    o = xp.where(seen[..., None], acc / safe[..., None], 0.0)
    return o, xp.where(seen, m + xp.log(safe), -xp.inf)


def merge_partials(o_parts, lse_parts):
    """Merge k partial results over disjoint key sets: o_parts (k, ..., dv), lse_parts (k, ...).
    lse = max + log sum exp(lse_i - max); weights exp(lse_i - lse); a -inf partial weighs 0."""
    o_parts, lse_parts = np.asarray(o_parts, np.float64), np.asarray(lse_parts, np.float64)
    top = _finite_or_zero(lse_parts.max(axis=0))
    weight = np.exp(lse_parts - top)
    return _lse_and_divide(weight.sum(axis=0), top, (weight[..., None] * o_parts).sum(axis=0))


def check_inputs(q, k, v, kv_lens, xp=np):
    """q, k, v as float64 arrays of `xp`; kv_lens as host int64 lengths (all kv_len if None)."""
    q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be (batch, heads, seq, dim)")
    B, H, _, d = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    if H % k.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {k.shape[1]} kv heads")
    nk = k.shape[2]
    lens = np.full(B, nk, dtype=np.int64) if kv_lens is None else np.asarray(kv_lens, dtype=np.int64)
    if lens.shape != (B,) or (lens < 0).any() or (lens > nk).any():
        raise ValueError(f"kv_lens must be {B} lengths in [0, {nk}]")
    return q, k, v, lens


def naive_attention(q, k, v, mask: Mask | str = Mask.NONE, window_left: int = 0, window_right: int = 0,
                    scale: float | None = None, kv_lens=None):
    """Textbook attention in float64: (o (B, H, Nq, dv), lse (B, H, Nq)). Scores are formed a
    chunk of queries at a time (CHUNK_ELEMENTS), so 4*8*4096^2 fits in a few hundred MB. CuPy
    inputs are computed on their GPU (kv_lens stay on the host either way)."""
    xp = array_module(q)
    q, k, v, lens = check_inputs(q, k, v, kv_lens, xp)
    B, H, nq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    group = H // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = xp.zeros((B, H, nq, dv))
    lse = xp.full((B, H, nq), -np.inf)
    for b in range(B):
        n = int(lens[b])
        if n == 0 or nq == 0:
            continue
        chunk = max(1, CHUNK_ELEMENTS // (group * n))
        for h in range(hkv):
            heads = slice(h * group, (h + 1) * group)
            for r0 in range(0, nq, chunk):
                rows = slice(r0, min(r0 + chunk, nq))
                lo, hi = key_bounds(np.arange(rows.start, rows.stop), nq, n, mask, window_left, window_right)
                first, stop = int(lo.min()), int(hi.max())    # keys no row of the chunk sees are left out
                if stop <= first:
                    continue
                s = q[b, heads, rows] @ k[b, h, first:stop].T   # (group, rows, keys)
                s *= scale
                cols = np.arange(first, stop)
                hidden = (cols < lo[:, None]) | (cols >= hi[:, None])
                if hidden.any():
                    s[:, xp.asarray(hidden)] = -np.inf   # (CuPy's copyto takes no scalar source)
                m = _finite_or_zero(s.max(axis=-1), xp)
                xp.subtract(s, m[..., None], out=s)
                xp.exp(s, out=s)
                o[b, heads, rows], lse[b, heads, rows] = _lse_and_divide(s.sum(axis=-1), m, s @ v[b, h, first:stop], xp)
    return o, lse


def reference_attention(spec: KernelSpec, q, k, v, kv_lens=None, split_kv=None, *, tile_q=None, tile_kv=None,
                        aux=None):
    """Run `spec`'s schedule in float64: (o, lse). tile_q / tile_kv / split_kv override the spec's;
    `split kv = auto` picks the count with choose_splits for the H200's SM count. `aux`: the aux
    tensors of the spec's modifications by name (mods/model.py; checked by mods/checks.prepare_aux)."""
    changes = {name: value for name, value in (("tile_q", tile_q), ("tile_kv", tile_kv), ("split_kv", split_kv))
               if value is not None}
    if changes:
        spec = replace(spec, schedule=replace(spec.schedule, **changes))
    q, k, v, lens = check_inputs(q, k, v, kv_lens)
    if q.shape[3] != spec.problem.head_dim_qk or v.shape[3] != spec.problem.head_dim_v:
        raise ValueError(f"{spec.name} is built for head dims {spec.problem.head_dim_qk}/{spec.problem.head_dim_v}, "
                         f"got {q.shape[3]}/{v.shape[3]}")
    graph = run_passes(spec, check_legality=False)
    splits = graph.sizes["splits"]
    if has_split_loop(spec) and splits is None:
        splits, _ = choose_splits(q.shape[0], k.shape[1], int(lens.max(initial=0)), graph.sizes["Bc"], H200.sm_count)
    return Executor(graph, q, k, v, lens, splits, aux).run()


class Executor:
    """Interprets the graph: loops iterate their tiles, each op kind is one method below. `env` is
    a block's on-chip state; `hbm` holds the tensors a kernel reads and writes."""

    def __init__(self, graph: ScheduleGraph, q, k, v, kv_lens, splits, aux=None):
        p = graph.spec.problem
        self.g, self.splits, self.kv_lens = graph, splits, kv_lens
        self.mask_kind, self.left, self.right, self.scale = p.mask, p.window_left, p.window_right, p.scale
        self.Br, self.Bc, self.groups = graph.sizes["Br"], graph.sizes["Bc"], graph.sizes["kv_groups"]
        heads = np.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
        self.q, self.k, self.v = q, k[:, heads], v[:, heads]
        B, H, self.nq, _ = q.shape
        self.nk, self.dv = k.shape[2], v.shape[3]
        self.hbm = {"O": np.zeros((B, H, self.nq, self.dv)), "lse": np.full((B, H, self.nq), -np.inf)}
        # Score and mask modifications: their aux tensors, and every tile's class (schedule/tiles.py), which
        # the executor trusts as a kernel does: empty tiles are skipped, full ones are not masked.
        self.mods, self.aux, self.classes = p.mods, {}, None
        if p.mods.active:
            self.aux = prepare_aux(p.mods, aux, B, H, self.nq, self.nk, kv_lens)
            self.classes = classify(p, Tiling(self.nq, self.nk, self.Br, self.Bc), B, H, kv_lens, self.aux)
        elif aux:
            raise RuntimeInputError(f"reference: aux tensors {sorted(aux)} given, but {graph.spec.name} modifies "
                                    "nothing")

    def run(self):
        self.scope(None, {}, {})
        if self.g.has(OpKind.STORE_O_STATE):   # FA1 leaves (O, m, l); its lse is m + log l
            m, l = self.hbm["m"], self.hbm["l"]
            seen = l > 0
            return self.hbm["O_state"], np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
        return self.hbm["O"], self.hbm["lse"]

    # -- loops
    def scope(self, loop, at, env):
        # An op `lag` tiles behind its loop's tile (Hopper's intra overlap) only runs later on the
        # GPU; it computes the same on its own tile, so each trip runs the tile's ops lag by lag.
        for name in sorted(self.g.children(loop), key=lambda n: self.g.op(n).lag):
            op = self.g.op(name)
            if op.kind is OpKind.LOOP:
                self.init(op, at, env)
                for trip in self.trips(op, at):
                    self.scope(name, {**at, **trip}, dict(env) if op.grid else env)
            else:
                getattr(self, op.kind.value)(op, at, env)

    def init(self, op, at, env):
        if not op.init:
            return
        B, H = self.q.shape[:2]
        rows = self.nq if op.init_space is Space.HBM else at["q"][1] - at["q"][0]
        target = self.hbm if op.init_space is Space.HBM else env
        for name, value in op.init:
            shape = (B, H, rows, self.dv) if name.startswith("O") else (B, H, rows)
            if "sink" in value:   # m = sink_h, l = 1: the sink joins the softmax (split 0's only)
                first = at.get("split", 0) == 0
                sink = np.broadcast_to(self.aux[AUX_SINKS][None, :, None], shape) if first else np.full(shape, -np.inf)
                target[name] = np.array(sink) if name == "m" else np.full(shape, 1.0 if first else 0.0)
            else:
                target[name] = np.full(shape, float(value))

    def tile_class(self, q_range, k_range):
        """(batch, heads) classes of this tile pair (schedule/tiles.py), or None without modifications."""
        if self.classes is None:
            return None
        return self.classes[:, :, q_range[0] // self.Br, k_range[0] // self.Bc]

    def visible(self, q_range, k_range) -> bool:
        """Tile skipping: does any query of q_range see any key of k_range, in any sequence? (A range
        may span several tiles: FA1's kv loop asks for all the queries.)"""
        if self.classes is not None:
            rows = slice(q_range[0] // self.Br, (q_range[1] - 1) // self.Br + 1)
            cols = slice(k_range[0] // self.Bc, (k_range[1] - 1) // self.Bc + 1)
            return bool((self.classes[:, :, rows, cols] != EMPTY).any())
        lo, _ = key_bounds(q_range[0], self.nq, self.kv_lens, self.mask_kind, self.left, self.right)
        _, hi = key_bounds(q_range[1] - 1, self.nq, self.kv_lens, self.mask_kind, self.left, self.right)
        return bool((np.maximum(lo, k_range[0]) < np.minimum(hi, k_range[1])).any())

    def trips(self, op, at):
        tiles = math.ceil(self.nk / self.Bc)
        if op.var == "q":
            for q0 in range(0, self.nq, self.Br):
                q_range = (q0, min(q0 + self.Br, self.nq))
                if "kv" not in at or self.visible(q_range, at["kv"]):
                    yield {"q": q_range}
        elif op.var == "split":
            for s, owned in enumerate(split_ranges(tiles, self.splits)):
                yield {"split": s, "tiles": owned}
        elif op.var == "rows":
            # FA1's row passes partition the q tile's rows, and rows never mix: one trip over all
            # of them computes what the passes do.
            yield {}
        elif op.var == "kv":
            first, stop = at.get("tiles", (0, tiles))
            for t in range(first, stop):
                k_range = (t * self.Bc, min((t + 1) * self.Bc, self.nk))
                if self.visible(at.get("q", (0, self.nq)), k_range):
                    yield {"kv": k_range}
        else:
            raise ValueError(f"unknown loop variable {op.var!r}")

    # -- ops, one method per OpKind
    def load_q(self, op, at, env):
        env["Q"] = self.q[:, :, slice(*at["q"])]

    def load_k(self, op, at, env):
        env["K"] = self.k[:, :, slice(*at["kv"])]

    def load_v(self, op, at, env):
        env["V"] = self.v[:, :, slice(*at["kv"])]

    def arrive(self, op, at, env):
        """Barriers order the GPU's warps; one NumPy thread needs none."""

    wait = arrive
    mma_wait = arrive   # an async wgmma is waited for; here it has finished already

    def page_lookup(self, op, at, env):
        """Paged KV: the executor takes K and V already gathered (serving_reference.gather_pages)."""

    def pack_p(self, op, at, env):
        """P -> the P V wgmma's 16-bit A fragments: the executor keeps P in float64."""

    def load_o_state(self, op, at, env):
        """FA1: the q tile's state from HBM; O is kept normalised there, so it is multiplied back by l."""
        rows = slice(*at["q"])
        o, env["m"], env["l"] = (self.hbm[t][:, :, rows].copy() for t in ("O_state", "m", "l"))
        env["O"] = o * env["l"][..., None]

    def store_o_state(self, op, at, env):
        rows = slice(*at["q"])
        self.hbm["O_state"][:, :, rows], _ = _lse_and_divide(env["l"], env["m"], env["O"])
        self.hbm["m"][:, :, rows], self.hbm["l"][:, :, rows] = env["m"], env["l"]

    def mma_qk(self, op, at, env):
        env["S"] = (env["Q"] @ np.swapaxes(env["K"], -1, -2)) * self.scale

    def grid(self, at) -> Grid:
        return grid(self.q.shape[0], self.q.shape[1], np.arange(*at["q"]), np.arange(*at["kv"]), self.kv_lens,
                    self.nq)

    def score_mod(self, op, at, env):
        env["S_raw"] = env["S"]   # the backward's chain rule reads the score before its modification
        env["S"] = modified_scores(self.mods, env["S"], self.grid(at), self.aux)

    def mask(self, op, at, env):
        rows, cols = np.arange(*at["q"]), np.arange(*at["kv"])
        lo, hi = key_bounds(rows[None, :], self.nq, self.kv_lens[:, None], self.mask_kind, self.left, self.right)
        seen = ((cols >= lo[..., None]) & (cols < hi[..., None]))[:, None]   # (B, 1, rows, cols)
        classes = self.tile_class(at["q"], at["kv"])
        if classes is not None:   # a full tile is not masked (its class is trusted, as a kernel trusts it)
            seen = (seen & modified_visible(self.mods, self.grid(at), self.aux)) | (classes == FULL)[..., None, None]
        env["S"] = np.where(seen, env["S"], -np.inf)

    def dropout(self, op, at, env):
        """P V reads the dropped P (l has summed the undropped one)."""
        keep = dropout_keep(self.mods, self.grid(at), self.aux)
        for state, cols in self._states(env):
            state["P"] = state["P"] * keep[..., cols]

    def _states(self, env):
        """The running (m, l, O) states and the key columns of S each one sees: the block's, or with
        split-K warps one per warp over its own column slice of every tile (warp 0 starts from the
        block's state, the others empty), kept until combine_warps merges them."""
        if self.groups == 1:
            return [(env, slice(None))]
        if "warps" not in env:
            empty = {"m": np.full_like(env["m"], -np.inf), "l": np.zeros_like(env["l"]), "O": np.zeros_like(env["O"])}
            env["warps"] = [{"m": env["m"], "l": env["l"], "O": env["O"]}] + [dict(empty)
                                                                              for _ in range(self.groups - 1)]
        width = math.ceil(self.Bc / self.groups)
        return [(state, slice(g * width, (g + 1) * width)) for g, state in enumerate(env["warps"])]

    def online_softmax(self, op, at, env):
        for state, cols in self._states(env):
            s = env["S"][..., cols]
            m_new = np.maximum(state["m"], s.max(axis=-1, initial=-np.inf))
            top = _finite_or_zero(m_new)
            state["alpha"] = np.exp(state["m"] - top)
            state["P"] = np.exp(s - top[..., None])
            state["l"] = state["alpha"] * state["l"] + state["P"].sum(axis=-1)
            state["m"] = m_new

    def mma_pv(self, op, at, env):
        for state, cols in self._states(env):
            state["PV"] = state["P"] @ env["V"][:, :, cols]
            if op.variant == "accumulate":   # Hopper: the wgmma adds onto O, rescaled before it
                state["O"] = state["O"] + state["PV"]

    def rescale_o(self, op, at, env):
        for state, _ in self._states(env):
            if op.variant == "before_pv":
                state["O"] = state["alpha"][..., None] * state["O"]
            else:
                state["O"] = state["alpha"][..., None] * state["O"] + state["PV"]

    def combine_warps(self, op, at, env):
        warps = env.pop("warps", None)
        if warps is None:      # no kv tile ran: the block's state is untouched
            return
        m = np.max([w["m"] for w in warps], axis=0)
        weights = [np.exp(w["m"] - _finite_or_zero(m)) for w in warps]
        env["m"] = m
        env["l"] = sum(wt * w["l"] for wt, w in zip(weights, warps))
        env["O"] = sum(wt[..., None] * w["O"] for wt, w in zip(weights, warps))

    def normalize_o(self, op, at, env):
        env["O"], env["lse"] = _lse_and_divide(env["l"], env["m"], env["O"])

    def _output(self, tensor, at):
        if tensor.endswith("_part"):
            if tensor not in self.hbm:
                full = self.hbm[tensor[:-5]]
                self.hbm[tensor] = np.zeros((self.splits,) + full.shape)
            return self.hbm[tensor][at["split"]]
        return self.hbm[tensor]

    def store_o(self, op, at, env):
        self._output(op.hbm[0].tensor, at)[:, :, slice(*at["q"])] = env["O"]

    def store_lse(self, op, at, env):
        self._output(op.hbm[0].tensor, at)[:, :, slice(*at["q"])] = env["lse"]

    def merge_splits(self, op, at, env):
        rows = slice(*at["q"])
        env["O"], env["lse"] = merge_partials(self.hbm["O_part"][:, :, :, rows], self.hbm["lse_part"][:, :, :, rows])
