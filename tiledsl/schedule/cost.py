"""The tuner's pruning model: predicted time of one FA2-family config on one problem shape.

Pure and CPU-only (no CuPy, no compiler): it reads a KernelSpec, its lowered plan's numbers
(shared memory, threads, whether Q stays in registers), the ptxas report when there is one (else
the plan's register estimate) and the device limits, and predicts milliseconds from:

  per kv step of one block (one Br x Bc tile of S), in SM cycles:
    mma      2 Br Bc (d + dv) flops at the mma.sync rate (about 2/3 of Hopper's wgmma peak), or at
             the wgmma rate for `mma wgmma` configs
    smem     bytes read by ldmatrix: every warp reads the whole K and V tile, so shared-memory
             traffic per flop is 1 / rows-per-warp. At 16 rows per warp it is twice that at 32,
             which is what makes the 8-warp, 16-row configs slower; wgmma reads K, V and its 64 Q
             rows once per warpgroup
    softmax  per S element (max, exp2, sum, convert) and per O element (the rescale)
    the three run on different units; how much they overlap grows with the resident warps
  + a sync latency per kv step (cp.async wait + barrier), hidden by the other resident blocks;
    one stage has no prefetch, so it waits for the whole load
  x a spill penalty per byte of ptxas spill traffic (local memory inside the loop)
  occupancy: blocks per SM from registers (allocated 8 at a time), shared memory and threads
  waves:    blocks (each with its own number of kv steps: causal skips tiles) assigned in launch
            order to the earliest free block slot; the predicted time is the last slot's finish.
            A hopper spec that writes `launch` is modelled as launched: items longest first;
            `grid` and `dynamic` hand each to the earliest free slot, `persistent` walks a fixed
            stride; `grid` also pays ITEM_EDGE_STEPS per item (the walks overlap each item's Q load
            and epilogue with the next item's work)
  HBM:      the traffic model (schedule/traffic.py, no-cache count), divided by an L2 reuse factor; the
            time is the larger of compute and memory.

A config is *hopeless* (pruned before timing, whatever the budget) when no block fits on an SM
or when ptxas spills more than SPILL_HOPELESS_BYTES. The rest are ranked by predicted time and
the best `budget` are timed. Constants are calibrated on an H200 sweep of the bundled spaces
(bench/NOTES.md); tests/test_tune_model.py checks that the measured best of every shape there
ranks in the model's top 30%.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..device_limits import H200, DeviceLimits, resident_blocks
from ..hw import WARPGROUP_WARPS, WGMMA_ROWS
from ..spec import AUTO, DTYPE_BYTES, Axis, Family, KernelSpec, LaunchKind, Mask, Mma
from .masks import key_bounds, tiles_visible


@dataclass(frozen=True)
class Resources:
    """What one kernel uses per thread and block. From a ptxas report (`source` "ptxas"), or the
    plan's register estimate with no spill information (`source` "estimate"); the tuner adds the
    plan's dynamic shared memory, threads and whether Q stays in registers."""
    registers: int
    spill_stores: int = 0            # bytes per thread
    spill_loads: int = 0
    smem_bytes: int = 0              # dynamic shared memory per block (the plan's)
    threads: int = 0
    q_in_registers: bool = True
    source: str = "estimate"
    stack_bytes: int = 0             # per thread
    static_shared_bytes: int = 0     # __shared__ declared in the source
    report: str = ""                 # the ptxas text it was read from
    advisories: tuple[str, ...] = ()  # ptxas's numbered notes, e.g. "C7517 warpgroup.wait is injected ..."


# ---- machine constants (sm_90, mma.sync path) --------------------------------------------------
CLOCK_HZ = 1.755e9              # sustained SM clock under tensor-core load (boost is 1.98 GHz)
MMA_FLOPS_PER_CLOCK = 2730      # mma.sync m16n8k16 per SM per clock: ~2/3 of wgmma's 4096
WGMMA_FLOPS_PER_CLOCK = 4096    # wgmma m64nNk16 (dense bf16/fp16 peak per SM per clock)
SMEM_BYTES_PER_CLOCK = 128      # ldmatrix + cp.async: 32 banks x 4 bytes per clock
CYCLES_PER_S_ELEMENT = 0.06     # scale, max, exp2 (MUFU 16/clock), row sum, convert to 16 bits
CYCLES_PER_O_ELEMENT = 1 / 128  # the O rescale: one FMA per element per kv step
WARPS_FOR_FULL_OVERLAP = 16     # resident warps at which MMA, ldmatrix and softmax fully overlap
SYNC_CYCLES = 800               # cp.async wait + __syncthreads per kv step, 2+ stages
SYNC_CYCLES_ONE_STAGE = 1500    # one stage: the whole K/V load is exposed each step
SPILL_COST_PER_BYTE = 0.0005    # slowdown per byte of spill stores + loads (per thread)
SPILL_HOPELESS_BYTES = 128      # spill stores above this: pruned before timing
L2_REUSE = 3.0                  # HBM bytes the no-cache traffic count overstates by (K/V re-reads)
PRUNE_FRACTION = 0.30           # by default at most this share of the legal configs is timed


@dataclass(frozen=True)
class Shape:
    """The problem the configs are tuned for: q (batch, heads, seqlen_q, d), k/v (.., seqlen_kv, d)."""
    batch: int
    heads: int
    seqlen_q: int
    seqlen_kv: int

    def key(self) -> dict:
        return {"batch": self.batch, "heads": self.heads, "seqlen_q": self.seqlen_q, "seqlen_kv": self.seqlen_kv}


@dataclass(frozen=True)
class Prediction:
    kernel: str
    time_ms: float
    tflops: float
    blocks_per_sm: int
    occupancy_limit: str        # what limits blocks per SM: registers | shared | threads
    wave_efficiency: float      # work / (slots x makespan): 1.0 = no tail
    rows_per_warp: int
    bound: str                  # mma | smem | softmax | hbm: the largest term
    hbm_bytes: int
    resources: Resources
    hopeless: str | None = None  # why it is pruned whatever the budget

    @property
    def pruned_reason(self) -> str | None:
        return self.hopeless


# ---- the model ------------------------------------------------------------------------------------

def blocks_per_sm(resources: Resources, limits: DeviceLimits = H200) -> tuple[int, str]:
    """(resident blocks per SM, the resource that limits it)."""
    return resident_blocks(limits, resources.registers, resources.threads, resources.smem_bytes)


def _tiles_seen(spec: KernelSpec, shape: Shape) -> np.ndarray:
    """Whether each q tile visits each kv tile (causal and window masks skip the tiles no query sees)."""
    p, s = spec.problem, spec.schedule
    q0 = np.arange(0, shape.seqlen_q, s.tile_q)
    k0 = np.arange(0, shape.seqlen_kv, s.tile_kv)
    return tiles_visible(q0, np.minimum(q0 + s.tile_q, shape.seqlen_q), k0,
                         np.minimum(k0 + s.tile_kv, shape.seqlen_kv), shape.seqlen_q, shape.seqlen_kv,
                         p.mask, p.window_left, p.window_right)


def kv_steps_per_q_tile(spec: KernelSpec, shape: Shape) -> np.ndarray:
    """Kv tiles each q tile visits (causal and window masks skip the tiles no query sees)."""
    return _tiles_seen(spec, shape).sum(axis=1)


def splits_of(spec: KernelSpec, shape: Shape, resident: int, limits: DeviceLimits = H200) -> int:
    """The split-KV count a launch of `spec` on `shape` runs with: the spec's, or `auto`'s choice
    (schedule/splits.py, as the runtime picks it); 1 for a kernel without a split loop."""
    from .graph import has_split_loop
    from .splits import choose_splits
    if not has_split_loop(spec):
        return 1
    if spec.schedule.split_kv == AUTO:
        return choose_splits(shape.batch, shape.heads, shape.seqlen_kv, spec.schedule.tile_kv, limits.sm_count,
                             resident)[0]
    return int(spec.schedule.split_kv)


def kv_steps_per_block(spec: KernelSpec, shape: Shape, splits: int) -> np.ndarray:
    """Kv tiles each block of one (batch, head) visits: one block per q tile, or with split-KV one per
    (q tile, split), each split owning its share of the kv tiles (schedule/splits.split_ranges)."""
    from .splits import split_ranges
    seen = _tiles_seen(spec, shape)
    if splits == 1:
        return seen.sum(axis=1)
    ranges = split_ranges(seen.shape[1], splits)
    return np.array([seen[:, start:stop].sum(axis=1) for start, stop in ranges]).T.reshape(-1)


def step_cycles(spec: KernelSpec, resources: Resources, resident_blocks: int) -> tuple[float, dict]:
    """SM cycles one kv step of one block costs when `resident_blocks` share the SM, and its terms."""
    p, s = spec.problem, spec.schedule
    e = DTYPE_BYTES[p.dtype]
    br, bc, d, dv = s.tile_q, s.tile_kv, p.head_dim_qk, p.head_dim_v
    if s.mma is Mma.WGMMA:
        # each warpgroup's wgmmas read the K and V tiles and its 64 Q rows once; plus the cp.async fill
        smem_read = (br // WGMMA_ROWS) * (bc * (d + dv) + WGMMA_ROWS * d) * e + bc * (d + dv) * e
        rate = WGMMA_FLOPS_PER_CLOCK
    else:
        smem_read = s.warps * bc * (d + dv) * e + bc * (d + dv) * e   # ldmatrix by every warp + cp.async fill
        if not resources.q_in_registers:
            smem_read += br * d * e
        rate = MMA_FLOPS_PER_CLOCK
    terms = {"mma": 2 * br * bc * (d + dv) / rate,
             "smem": smem_read / SMEM_BYTES_PER_CLOCK,
             "softmax": br * bc * CYCLES_PER_S_ELEMENT + br * dv * CYCLES_PER_O_ELEMENT}
    busiest = max(terms.values())
    if spec.family is Family.HOPPER:
        # The producer warpgroup only issues copies; with intra overlap a consumer's softmax runs
        # under its own P V, so the terms overlap fully (bench/NOTES.md, the hopper family).
        warps = WARPGROUP_WARPS * s.consumer_warpgroups
        overlap = 1.0 if s.intra_overlap else min(1.0, resident_blocks * warps / WARPS_FOR_FULL_OVERLAP)
    else:
        overlap = min(1.0, resident_blocks * s.warps / WARPS_FOR_FULL_OVERLAP)
    busy = busiest + (1.0 - overlap) * (sum(terms.values()) - busiest)
    sync = SYNC_CYCLES if s.stages > 1 else SYNC_CYCLES_ONE_STAGE
    cycles = busy + sync / max(resident_blocks, 1)
    cycles *= 1.0 + SPILL_COST_PER_BYTE * (resources.spill_stores + resources.spill_loads)
    return cycles, terms


# An item's Q load, first Q K^T and O store, in kv steps, where nothing of the next item runs under them
# (one block per item); bench/NOTES.md, the persistent launch and the tile scheduler.
ITEM_EDGE_STEPS = 1.0


def launched_makespan(steps_per_item: np.ndarray, slots: int, launch: LaunchKind) -> tuple[float, float]:
    """makespan_steps for a hopper kernel's `launch`: items longest first (block_order), to the earliest
    free slot (grid: plus its edges; dynamic) or at a fixed stride of the slots (persistent)."""
    ordered = np.sort(steps_per_item)[::-1].astype(float)
    if launch is LaunchKind.GRID:
        return makespan_steps(ordered + ITEM_EDGE_STEPS, slots)
    if launch is LaunchKind.DYNAMIC:
        return makespan_steps(ordered, slots)
    total = float(ordered.sum())
    per_slot = np.bincount(np.arange(len(ordered)) % slots, weights=ordered, minlength=min(slots, len(ordered)))
    last = float(per_slot.max()) if len(ordered) else 0.0
    return last, total / (slots * last) if last else 1.0


def makespan_steps(steps_per_block: np.ndarray, slots: int) -> tuple[float, float]:
    """(kv steps of the slot that finishes last, wave efficiency) when blocks, in launch order, go
    to the earliest free slot. Equal blocks take the closed form; unequal ones (causal) a heap."""
    total = float(steps_per_block.sum())
    if total == 0:
        return 0.0, 1.0
    if np.all(steps_per_block == steps_per_block[0]):
        last = math.ceil(len(steps_per_block) / slots) * float(steps_per_block[0])
    else:
        finish = [0.0] * min(slots, len(steps_per_block))
        heapq.heapify(finish)
        for steps in steps_per_block:
            heapq.heapreplace(finish, finish[0] + float(steps))
        last = max(finish)
    return last, total / (slots * last)


def shape_flops(spec: KernelSpec, shape: Shape) -> float:
    """FLOPs under the FlashAttention papers' convention (bench.attention_flops): 2 (d + dv) per
    (query, key) pair, i.e. 4 B H N^2 d, halved for causal; so TFLOP/s compare with PEERS.md. A window
    counts the pairs it shows (schedule/masks.py): the dense count would put a narrow window past the
    GPU's peak."""
    p = spec.problem
    if p.mask is Mask.WINDOW:
        lo, hi = key_bounds(np.arange(shape.seqlen_q), shape.seqlen_q, shape.seqlen_kv, p.mask, p.window_left,
                            p.window_right)
        per_head = float((hi - lo).sum())
    else:
        per_head = shape.seqlen_q * shape.seqlen_kv * (0.5 if p.mask is Mask.CAUSAL else 1.0)
    return 2.0 * shape.batch * shape.heads * per_head * (p.head_dim_qk + p.head_dim_v)


def predict(spec: KernelSpec, shape: Shape, resources: Resources, limits: DeviceLimits = H200,
            hbm_bytes: int | None = None, flops: float | None = None) -> Prediction:
    """The predicted time of `spec` on `shape`. `hbm_bytes` (no-cache traffic) comes from
    schedule/traffic.py when the caller has the graph; else it is counted here from the tiles (FA2: Q and
    O once, K and V once per q tile). `flops` defaults to shape_flops (for TFLOP/s)."""
    p, s = spec.problem, spec.schedule
    rows_per_warp = s.tile_q // s.warps if s.warp_axis is Axis.Q else s.tile_q
    blocks, limit = blocks_per_sm(resources, limits)
    per_q_tile = kv_steps_per_q_tile(spec, shape)
    per_block = kv_steps_per_block(spec, shape, splits_of(spec, shape, max(blocks, 1), limits))
    heads = shape.batch * shape.heads
    if hbm_bytes is None:
        e = DTYPE_BYTES[p.dtype]
        kv_rows = int(np.minimum(per_q_tile * s.tile_kv, shape.seqlen_kv).sum())
        hbm_bytes = heads * e * (shape.seqlen_q * (p.head_dim_qk + p.head_dim_v)
                                 + kv_rows * (p.head_dim_qk + p.head_dim_v))
    if flops is None:
        flops = shape_flops(spec, shape)
    hopeless = None
    if blocks == 0:
        hopeless = f"no block fits on an SM ({limit})"
    elif resources.spill_stores > SPILL_HOPELESS_BYTES:
        hopeless = f"ptxas spills {resources.spill_stores} B per thread (> {SPILL_HOPELESS_BYTES})"
    resident = max(blocks, 1)
    cycles, terms = step_cycles(spec, resources, resident)
    steps = np.tile(per_block, heads)
    if spec.family is Family.HOPPER and s.launch is not None:
        last, efficiency = launched_makespan(steps, limits.sm_count * resident, s.launch)
    else:
        last, efficiency = makespan_steps(steps, limits.sm_count * resident)
    # `resident` slots share one SM, so each slot advances one step per resident x cycles.
    compute_s = last * cycles * resident / CLOCK_HZ
    memory_s = hbm_bytes / L2_REUSE / (limits.hbm_bytes_per_s or H200.hbm_bytes_per_s)
    seconds = max(compute_s, memory_s)
    bound = "hbm" if memory_s > compute_s else max(terms, key=terms.get)
    return Prediction(kernel=spec.kernel_name, time_ms=seconds * 1e3, tflops=flops / seconds / 1e12 if seconds else 0.0,
                      blocks_per_sm=blocks, occupancy_limit=limit, wave_efficiency=efficiency,
                      rows_per_warp=rows_per_warp, bound=bound, hbm_bytes=int(hbm_bytes), resources=resources,
                      hopeless=hopeless)


# ---- selection ------------------------------------------------------------------------------------

def default_budget(legal: int, fraction: float = PRUNE_FRACTION) -> int:
    """Configs to time by default: at most `fraction` of the legal ones, at least one."""
    return max(1, math.floor(legal * fraction + 1e-9)) if legal else 0


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """Hopeful configs by predicted time (ties: kernel name, so the order is deterministic)."""
    return sorted((p for p in predictions if p.hopeless is None), key=lambda p: (p.time_ms, p.kernel))


def select(predictions: list[Prediction], budget: int) -> tuple[list[Prediction], list[tuple[Prediction, str]]]:
    """(the `budget` best hopeful configs, [(config, why it is not timed)] for the others)."""
    ranked = rank(predictions)
    chosen = ranked[:max(budget, 0)]
    chosen_names = {p.kernel for p in chosen}
    dropped = [(p, p.hopeless) for p in predictions if p.hopeless is not None]
    dropped += [(p, f"model rank {i + 1} > budget {budget}") for i, p in enumerate(ranked)
                if p.kernel not in chosen_names]
    return chosen, dropped
