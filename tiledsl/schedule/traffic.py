"""HBM traffic and FLOPs of a schedule, counted from its graph.

Every op that touches HBM lists its accesses (graph.Access: tensor, read/write, rows of the
current q or kv tile, columns). An op runs once per trip of its enclosing loops, so its traffic
is the sum over those trips; which loops enclose it is exactly what tells FA1 from FA2 (FA1's
load_q and O/m/l round trip sit inside the kv loop, FA2's do not). Tiles that no query sees
(causal, window) are skipped, as the kernels and the reference executor skip them. The count
assumes no cache: every tile read is an HBM read (the L2 serves many re-reads in practice).

Closed forms per head, in elements, Nq queries, Nk keys, no mask (ragged tiles included):
    standard     4 Nq Nk + Nq d + Nk d + Nk dv + Nq dv          (= 4N^2 + 4Nd)
    FA1          Nk (d + dv) + ceil(Nk/Bc) Nq (d + 2 dv + 4)      (= 2Nd + N/Bc (3Nd + 4N))
    FA2          Nq (d + dv + 1) + ceil(Nq/Br) Nk (d + dv)        (= 2Nd + 2N^2 d/Br + N)
    split-KV     S Nq d + ceil(Nq/Br) Nk (d + dv) + 2 S Nq (dv + 1) + Nq (dv + 1)
A spec's score and mask modifications skip their empty tiles too, as far as the indices decide them
(schedule/tiles.py; terms that read aux data count as computed); the useful FLOPs count the none /
causal / window mask's visible pairs only.
Paged KV adds the block table: every (q tile, kv tile) step reads the kv tile's page indices,
ceil(Nq/Br) Nk/page int32 per head when pages hold whole tiles' worth of keys or less.
Element sizes (`element_bytes`): Q in the spec's dtype, O in its output type (bf16 or fp16 for FP8 attention), K
and V in the KV cache's (kv_dtype: 1 byte for e4m3; Q, K and V are e4m3 with dtype = e4m3);
block-table entries int32; FA1's O state, split partials, m, l and lse in fp32 (accumulator precision: rounding them
to 16 bits at every step would compound), as are the backward's D and its fp32 workspaces (dQ_accum, dK_accum,
dV_accum), which the kernels keep in fp32 for the same reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device_limits import H200
from .graph import ScheduleGraph, has_split_loop
from .masks import key_bounds, tiles_visible
from ..spec import AUTO, DTYPE_BYTES
from .splits import choose_splits, split_ranges

FP32_TENSORS = frozenset({"O_state", "O_part", "m", "l", "lse", "lse_part", "D", "dQ_accum", "dK_accum", "dV_accum"})
INT32_TENSORS = frozenset({"block_table"})   # paged KV: page indices, read by every block per kv tile


@dataclass(frozen=True)
class OpTraffic:
    op: str
    tensor: str
    mode: str            # "read" | "write"
    elements: int
    bytes: int


@dataclass(frozen=True)
class Traffic:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_kv: int
    ops: tuple[OpTraffic, ...]
    read_bytes: int
    write_bytes: int
    elements: int               # all reads and writes, in elements
    standard_elements: int      # three-kernel attention (S and P through HBM)
    standard_bytes: int
    flops: int                  # 2(d + dv) per visible (query, key) pair, counted exactly
    flops_executed: int         # the same over whole computed tiles (masked entries included)
    splits: int | None = None
    split_reason: str = ""

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def ratio(self) -> float:
        """Standard attention's bytes over this schedule's."""
        return self.standard_bytes / self.bytes if self.bytes else float("inf")


def standard_elements(seqlen_q: int, seqlen_kv: int, d: int, dv: int) -> int:
    """Per head: S = QK^T (read Q, K; write S), P = softmax(S) (read S, write P), O = PV (read P, V; write O)."""
    return 4 * seqlen_q * seqlen_kv + seqlen_q * d + seqlen_kv * d + seqlen_kv * dv + seqlen_q * dv


def visible_pairs(seqlen_q: int, seqlen_kv: int, mask, left: int = 0, right: int = 0) -> int:
    """(query, key) pairs the mask lets through, exactly."""
    lo, hi = key_bounds(np.arange(seqlen_q), seqlen_q, seqlen_kv, mask, left, right)
    return int((hi - lo).sum())


def element_bytes(tensor: str, problem) -> int:
    """Bytes per element of HBM tensor `tensor` (an Access's name) of a spec's problem."""
    if tensor in FP32_TENSORS or tensor in INT32_TENSORS:
        return 4
    if tensor == "O":
        return DTYPE_BYTES[problem.output_dtype]
    return DTYPE_BYTES[problem.kv_dtype or problem.dtype] if tensor in ("K", "V") else DTYPE_BYTES[problem.dtype]


def tile_bounds(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) of each tile of `size` over `n` rows (the last one ragged)."""
    starts = np.arange(0, n, size, dtype=np.int64)
    return starts, np.minimum(starts + size, n)


# The traffic model and the tuner's model hold a (q tiles x kv tiles) table of which tiles some query sees:
# its size, not the sequence length alone, is their time and memory (2^23 cells: about a second).
MAX_TILE_PAIRS = 1 << 23


def tile_pairs(tile_q: int, tile_kv: int, seqlen_q: int, seqlen_kv: int) -> int:
    """Cells of the (q tiles x kv tiles) table the models walk for one shape."""
    return -(-seqlen_q // tile_q) * -(-seqlen_kv // tile_kv)


def model_too_big(tile_q: int, tile_kv: int, seqlen_q: int, seqlen_kv: int) -> str:
    """Why the models would not model this shape in a few seconds ("" when they do), with the longest
    sequence they take for these tiles."""
    pairs = tile_pairs(tile_q, tile_kv, seqlen_q, seqlen_kv)
    if pairs <= MAX_TILE_PAIRS:
        return ""
    longest = int((MAX_TILE_PAIRS * tile_q * tile_kv) ** 0.5)
    return (f"seqlen q {seqlen_q:,} x kv {seqlen_kv:,} with tile q = {tile_q}, kv = {tile_kv} is {pairs:,} tile pairs; "
            f"the traffic model walks at most {MAX_TILE_PAIRS:,} (for these tiles: sequences of about {longest:,})")


def hbm_traffic(graph: ScheduleGraph, batch: int, heads: int, seqlen_q: int, seqlen_kv: int,
                kv_heads: int | None = None, sm_count: int = H200.sm_count, blocks_per_sm: int = 1) -> Traffic:
    """Bytes each HBM-touching op of `graph` moves, summed over its loop trips, for batch x heads.
    `blocks_per_sm` (resident blocks of the lowered kernel) feeds `split kv = auto`."""
    spec, z = graph.spec, graph.sizes
    too_big = model_too_big(z["Br"], z["Bc"], seqlen_q, seqlen_kv)
    if too_big:
        raise ValueError(too_big)
    p = spec.problem
    d, dv, elem = p.head_dim_qk, p.head_dim_v, DTYPE_BYTES[p.dtype]
    q0, q1 = tile_bounds(seqlen_q, z["Br"])
    k0, k1 = tile_bounds(seqlen_kv, z["Bc"])
    rows = {"q": q1 - q0, "kv": k1 - k0}
    if p.kv_page_size is not None:   # block-table entries per kv tile: the pages its keys touch
        rows["pages"] = -(-k1 // p.kv_page_size) - k0 // p.kv_page_size
    seen = tiles_visible(q0, q1, k0, k1, seqlen_q, seqlen_kv, p.mask, p.window_left, p.window_right)
    if p.mods.modifies_mask:   # the modifications' empty tiles are skipped too (data-dependent terms: computed),
        from .tiles import EMPTY, Tiling, classify   # as a share of the heads where a mask_mod reads h
        classes = classify(p, Tiling(seqlen_q, seqlen_kv, z["Br"], z["Bc"]), 1, heads)
        seen = seen * (classes[0] != EMPTY).mean(axis=0)
    splits, reason = None, ""
    if has_split_loop(spec):
        if spec.schedule.split_kv == AUTO:
            splits, reason = choose_splits(batch, kv_heads or heads, seqlen_kv, z["Bc"], sm_count, blocks_per_sm)
        else:
            splits = int(spec.schedule.split_kv)
    _check_split_partition(splits, len(k0))

    def row_sum(loop_vars: set[str], tile: str) -> int:
        """Sum of the current `tile`'s rows over every trip the op runs."""
        if {"q", "kv"} <= loop_vars:      # (q tile, kv tile) pairs some query sees
            weight = rows["q"][:, None] if tile == "q" else rows[tile][None, :]
            return int((seen * weight).sum())
        if loop_vars == {"kv"}:           # FA1's outer loop: kv tiles some query sees
            return int((rows[tile] * seen.any(axis=0)).sum())
        if loop_vars in ({"q"}, {"q", "split"}) and tile == "q":
            return int(rows["q"].sum()) * (splits if "split" in loop_vars else 1)
        raise ValueError(f"no trip count for rows of {tile} inside loops {sorted(loop_vars)}")

    cols = {"d": d, "dv": dv, "1": 1}
    ops = []
    for name in graph.names():
        op = graph.op(name)
        for access in op.hbm:
            count = row_sum(set(graph.loop_vars(name)), access.rows) * cols[access.cols]
            count *= splits if access.times == "splits" else 1
            count *= batch * heads
            size = element_bytes(access.tensor, p)
            ops.append(OpTraffic(name, access.tensor, access.mode, count, count * size))
    executed = int((seen * rows["q"][:, None] * rows["kv"][None, :]).sum())
    std = standard_elements(seqlen_q, seqlen_kv, d, dv) * batch * heads
    return Traffic(
        batch, heads, seqlen_q, seqlen_kv, tuple(ops),
        read_bytes=sum(o.bytes for o in ops if o.mode == "read"),
        write_bytes=sum(o.bytes for o in ops if o.mode == "write"),
        elements=sum(o.elements for o in ops),
        standard_elements=std, standard_bytes=std * elem,
        flops=2 * (d + dv) * visible_pairs(seqlen_q, seqlen_kv, p.mask, p.window_left, p.window_right) * batch * heads,
        flops_executed=2 * (d + dv) * executed * batch * heads,
        splits=splits, split_reason=reason)


def _check_split_partition(splits: int | None, tiles: int) -> None:
    """The model counts a split's kv tiles through the (q, kv) pairs; that is exact only because the
    splits partition the kv tiles, which split_ranges promises. Check it rather than trust it."""
    if splits is None:
        return
    ranges = split_ranges(tiles, splits)
    owned = [t for a, b in ranges for t in range(a, b)]
    if owned != list(range(tiles)):
        raise AssertionError("split ranges do not partition the kv tiles")


def traffic_by_tensor(traffic: Traffic) -> dict[tuple[str, str], int]:
    """Bytes per (tensor, mode), in first-seen order."""
    out: dict[tuple[str, str], int] = {}
    for o in traffic.ops:
        out[(o.tensor, o.mode)] = out.get((o.tensor, o.mode), 0) + o.bytes
    return out


def elements_by_tensor(traffic: Traffic) -> dict[tuple[str, str], int]:
    """Elements per (tensor, mode), in first-seen order (times element_bytes: the bytes of any element types)."""
    out: dict[tuple[str, str], int] = {}
    for o in traffic.ops:
        out[(o.tensor, o.mode)] = out.get((o.tensor, o.mode), 0) + o.elements
    return out

