"""The schedule `tiledsl.attention` runs where the tuned table (dispatch/tuned.py) has no entry: a small
candidate set per family, filtered by the layout pass (families.layout_of refuses what does not fit)
and ranked without a GPU.

  prefill (fa2): tile q 64/128 x tile kv 32/64/128 x 4/8 warps x 1/2 stages on mma.sync, plus
                 whole-warpgroup wgmma tiles where the head dims are multiples of 64 on sm_90;
                 ranked by the tuner's model (tune_model.predict) on REPRESENTATIVE_SHAPE with the
                 layout's register estimate (no ptxas), configs whose estimate exceeds the
                 register limit (they would spill) last.
  decode:        (FP8 KV: FP8_DECODE_SCHEDULE first) the bundled decode schedule (specs/decode_d128.tile: q16, kv128, 4
  warps along kv,
                 1 stage, split kv auto) first, then smaller kv tiles and 2 stages; the first the
                 layout accepts wins (the tuner's model prices FA2 only).

Both templates run m16n8k16 MMAs on 16-column steps; fa2 on mma.sync pads a head dim that is a
multiple of 8 but not of 16 (8, 24, 40, ...) to the next 16 on chip (layout.mma_width), so every
multiple of 8 up to MAX_HEAD_DIM has a schedule (wgmma only multiples of 64; decode, DECODE_HEAD_DIMS).
`pick` refuses any other head dim by name with the list of those that work (`supported_head_dims`). Choices are pure
functions of their arguments and
cached, so they are deterministic and cost nothing after the first call."""
from __future__ import annotations

import functools
import itertools

from ..errors import RuntimeInputError, SpecError
from ..families import layout_of
from ..schedule.cost import Resources
from ..spec import AUTO, DECODE_MAX_QUERIES, Axis, DType, KernelSpec, Mask, Mma, Problem, Schedule

MAX_HEAD_DIM = 256        # the largest head dim the API serves (and the GPU tests cover)
# Head dims the decode kernel serves for every query count and GQA group on the GPU
# (tests/test_gpu_decode.py's sweep, tests/test_gpu_paged.py). Every lane of the merge takes every
# shuffle, so head dims that are not a multiple of 128 merge correctly too.
DECODE_HEAD_DIMS = tuple(range(16, MAX_HEAD_DIM + 1, 16))
# The shape candidates are ranked on: long enough that tails and launch costs don't decide.
REPRESENTATIVE_SEQLEN = 4096
REPRESENTATIVE_BATCH_HEADS = (4, 16)

_SYNC_TILES = ((64, 4), (128, 4), (128, 8))   # (tile q, warps): 16 or 32 rows per warp
_WGMMA_TILES = ((64, 4), (128, 8))            # one 64-row warpgroup per 4 warps
_DECODE = tuple(Schedule(tile_q=16, tile_kv=kv, warps=4, warp_axis=Axis.KV, stages=stages, split_kv=AUTO)
                for stages, kv in ((1, 128), (1, 64), (2, 64), (2, 32)))
# FP8 (e4m3) KV decode: Schedule fields over _DECODE[0] (e.g. tile_kv, stages, fp8_convert,
# min_blocks), tried before _DECODE; None: the bf16 order. The `fragments` conversion (ldmatrix on
# the e4m3 ring, no 16-bit tile) with the bf16 tile and depth was the fastest variant measured, on a
# contiguous and on a paged cache (bench/NOTES.md, "Why the tables hold what they hold").
FP8_DECODE_SCHEDULE: dict | None = {"fp8_convert": "fragments"}
# Above this head dim the FP8 schedule takes 64-key tiles: with 128 keys ptxas spills there, with 64
# it does not, up to 256.
FP8_DECODE_KV128_MAX_HEAD_DIM = 192


def fp8_decode_schedule(head_dim: int = 128) -> Schedule:
    """The decode schedule the API runs first for an FP8 KV cache of this head dim (the larger of k's and v's)."""
    from dataclasses import replace
    schedule = replace(_DECODE[0], **(FP8_DECODE_SCHEDULE or {}))
    if head_dim > FP8_DECODE_KV128_MAX_HEAD_DIM and schedule.tile_kv > 64:
        schedule = replace(schedule, tile_kv=64)
    return schedule


def prefill_candidates(problem: Problem, arch: str) -> list[Schedule]:
    """The fa2 schedules tried for `problem` on `arch` (before the layout pass filters them)."""
    out = [Schedule(tile_q=q, tile_kv=kv, warps=w, stages=stages)
           for (q, w), kv, stages in itertools.product(_SYNC_TILES, (32, 64, 128), (1, 2))]
    if arch.startswith("sm_9") and problem.head_dim_qk % 64 == 0 and problem.head_dim_v % 64 == 0:
        out += [Schedule(tile_q=q, tile_kv=kv, warps=w, stages=stages, mma=Mma.WGMMA)
                for (q, w), kv, stages in itertools.product(_WGMMA_TILES, (64, 128), (1, 2))]
    return out


def _legal(spec: KernelSpec):
    """The spec's layout, or None when the layout pass refuses it."""
    try:
        return layout_of(spec)
    except SpecError:
        return None


def _lowers(spec: KernelSpec) -> bool:
    from ..families import lower
    try:
        lower(spec)
    except SpecError:
        return False
    return True


def _rank_prefill(name: str, problem: Problem, arch: str) -> list[KernelSpec]:
    """Legal fa2 specs, best predicted first (ties by kernel name: deterministic)."""
    from ..schedule.cost import Shape, predict
    batch, heads = REPRESENTATIVE_BATCH_HEADS
    shape = Shape(batch, heads, REPRESENTATIVE_SEQLEN, REPRESENTATIVE_SEQLEN)
    scored = []
    for schedule in prefill_candidates(problem, arch):
        spec = KernelSpec(name, problem, schedule)
        layout = _legal(spec)
        if layout is None:
            continue
        resources = Resources(layout.register_estimate, smem_bytes=layout.smem_bytes, threads=layout.threads,
                              q_in_registers=layout.q_in_registers)
        prediction = predict(spec, shape, resources)
        if prediction.hopeless:
            continue
        spills = layout.register_estimate > layout.register_limit
        scored.append(((spills, prediction.time_ms, spec.kernel_name), spec))
    return [spec for _, spec in sorted(scored, key=lambda item: item[0])]


@functools.lru_cache(maxsize=None)
def pick(arch: str, problem: Problem, q_len: int | None = None) -> KernelSpec:
    """The spec to run `problem` with on `arch`: decode when 1 <= q_len <= DECODE_MAX_QUERIES and
    a decode schedule is legal, else the best-ranked legal fa2 schedule. RuntimeInputError names
    a head dim nothing serves."""
    d, dv = problem.head_dim_qk, problem.head_dim_v
    if max(d, dv) > MAX_HEAD_DIM or not (_supported(problem.dtype, d) and _supported(problem.dtype, dv)):
        supported = supported_head_dims(problem.dtype)
        raise RuntimeInputError(
            f"attention: head dim {d}" + (f" / v {dv}" if dv != d else "") + " is not supported: the fa2 "
            f"template reads 16-byte rows (head dims in steps of 8); supported head dims: "
            f"{', '.join(map(str, supported))}")
    if q_len is not None and 1 <= q_len <= DECODE_MAX_QUERIES and problem.head_dim_qk in DECODE_HEAD_DIMS:
        decode = pick_decode(problem, q_len)
        if decode is not None:
            return decode
    tag = f"{problem.dtype.value}_d{d}" + (f"v{dv}" if dv != d else "") + f"_{problem.mask.value}"
    for spec in _rank_prefill(f"auto_{tag}", problem, arch):
        if _lowers(spec):
            return spec
    raise RuntimeInputError(f"attention: no legal fa2 schedule for head dim {d} / v {dv}, "
                            f"{problem.dtype.value}, mask {problem.mask.value}")


@functools.lru_cache(maxsize=None)
def pick_decode(problem: Problem, q_len: int) -> KernelSpec | None:
    """The first decode schedule (bundled one first) that the layout pass and lowering accept
    (pure and cached: a problem's pick builds its graphs once)."""
    from dataclasses import replace
    decode_problem = replace(problem, queries_per_seq=q_len)
    schedules = _DECODE
    if problem.kv_fp8 and FP8_DECODE_SCHEDULE is not None:
        schedules = (fp8_decode_schedule(max(problem.head_dim_qk, problem.head_dim_v)),) + _DECODE
    for schedule in schedules:
        spec = KernelSpec(f"auto_decode_{problem.dtype.value}_d{problem.head_dim_qk}_nq{q_len}", decode_problem,
                          schedule)
        if _legal(spec) is not None and _lowers(spec):
            return spec
    return None


@functools.lru_cache(maxsize=None)
def _supported(dtype: DType, head_dim: int) -> bool:
    """Whether some fa2 schedule is legal for a square head dim (layout only: cheap)."""
    if head_dim <= 0 or head_dim > MAX_HEAD_DIM:
        return False
    problem = Problem(head_dim, head_dim, dtype, Mask.NONE)
    return any(_legal(KernelSpec("probe", problem, s)) is not None for s in prefill_candidates(problem, "sm_90a"))


def supported_head_dims(dtype: DType = DType.BF16) -> list[int]:
    """Head dims (multiples of 8 up to MAX_HEAD_DIM) that some fa2 schedule serves."""
    return [d for d in range(8, MAX_HEAD_DIM + 1, 8) if _supported(dtype, d)]
