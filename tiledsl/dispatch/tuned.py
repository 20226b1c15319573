"""Tuned defaults: the best known spec per (arch, dtype, head dim, mask), and the forward path
`attention()` (tiledsl/api.py) runs on them.

    o = tiledsl.attention(q, k, v, causal=True)        # q (batch, heads, seqlen, d), k/v alike
    o, lse = tiledsl.attention(q, k, v, kv_lens=lens, return_lse=True)

picks the spec from TUNED for the current GPU, compiles it once per process (kernels are cached
per spec) and runs it on the caller's current stream (runtime/device.stream_reader). A q_len of 1..16
runs the decode family (split kv picked at launch); a (arch, dtype, head dim, mask) not in the
table gets the best legal schedule of autoschedule.pick (layout pass + tune model, no GPU) and a
one-line hint, once per process, to run `tiledsl tune` for it. A window mask uses the causal
entry's schedule (both skip whole tiles); `scale` is passed through as the spec's softmax scale.
"""
from __future__ import annotations

import functools
from dataclasses import replace
import sys
from dataclasses import replace

from ..runtime.decode import number_or_none, tensor_or_none
from ..runtime.launch import SignatureCache
from ..runtime.tensors import signature
from ..families import takes_mods
from ..mods.model import NO_MODS, Modifications
from ..spec import CopyVia, DType, Family, ItemOrder, KernelSpec, LaunchKind, Mask, Mma, Problem, Schedule
from .kernels import add, kernel_for

# The table's entries are the hopper family's fastest schedule per (head dim, mask), measured on the
# H200 against SDPA in the same run (bench/NOTES.md, "Why the tables hold what they hold"):
#   d64 none / causal:    3 consumers, q192/kv128, intra overlap
#   d128 none:            2 consumers, q128/kv128, intra overlap
#   d128 causal:          2 consumers, q128/kv128, ping-pong + intra
#   d256 none / causal:   2 consumers, q128/kv80, intra overlap, one block per work item
# and, from LONG_KV keys on (TUNED_LONG), d64 none / causal: 3 consumers, q192/kv192.
# fp16 has the same tile shapes, sizes and ptxas reports, so each entry serves both dtypes until
# both are measured.
def hopper_schedule(tile_q: int, tile_kv: int, consumers: int, pingpong: bool = False, intra: bool = False,
                    launch: LaunchKind | None = None, item_order: ItemOrder | None = None) -> Schedule:
    """A hopper schedule as the checker completes one (frontend.rules.schedule_with_defaults): producer 1,
    the consumers' register split, 2 TMA stages, wgmma, 4 warps a warpgroup; `launch` None leaves the
    tile scheduler to the runtime."""
    producer_regs, consumer_regs = {2: (24, 240), 3: (32, 160)}[consumers]
    return Schedule(tile_q=tile_q, tile_kv=tile_kv, warps=4 * (1 + consumers), stages=2, copy=CopyVia.TMA,
                    mma=Mma.WGMMA, producer_warpgroups=1, producer_regs=producer_regs,
                    consumer_warpgroups=consumers, consumer_regs=consumer_regs, pingpong=pingpong,
                    intra_overlap=intra, launch=launch, item_order=item_order)


_SCHEDULES = {(64, "none"): hopper_schedule(192, 128, 3, intra=True),
              (64, "causal"): hopper_schedule(192, 128, 3, intra=True),
              (128, "none"): hopper_schedule(128, 128, 2, intra=True),
              (128, "causal"): hopper_schedule(128, 128, 2, pingpong=True, intra=True),
              (256, "none"): hopper_schedule(128, 80, 2, intra=True, launch=LaunchKind.GRID),
              (256, "causal"): hopper_schedule(128, 80, 2, intra=True, launch=LaunchKind.GRID)}

# (arch, dtype, head dim, mask) -> the schedule `tiledsl.attention` runs (Schedule objects: no call parses DSL).
TUNED: dict[tuple[str, str, int, str], Schedule] = {
    ("sm_90", dtype, d, mask): _SCHEDULES[(d, mask)]
    for dtype in ("bf16", "fp16") for d in (64, 128, 256) for mask in ("none", "causal")
}

# Calls with at least LONG_KV keys take TUNED_LONG's schedule where it has one: d64's 192-key tiles are faster once
# the partly filled last kv tile is a small share of the row (at 1k keys it is a sixth of the tile, and they lose).
LONG_KV = 2048
TUNED_LONG: dict[tuple[str, str, int, str], Schedule] = {
    ("sm_90", dtype, 64, mask): hopper_schedule(192, 192, 3)
    for dtype in ("bf16", "fp16") for mask in ("none", "causal")
}

_hinted: set[tuple] = set()


@functools.lru_cache(maxsize=None)
def tuned_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
               window: tuple[int, int] | None = None, scale: float | None = None,
               q_len: int | None = None, mods: Modifications = NO_MODS,
               long_kv: bool = False) -> tuple[KernelSpec, bool]:
    """(the spec to run, whether it came from the table). Pure and cached: no GPU needed. A q_len
    of 1..16 picks the decode family where it serves the shape (autoschedule.pick); the table
    holds prefill schedules only. `mods`: score and mask modifications, on the table's schedule.
    `long_kv`: the call has at least LONG_KV keys (TUNED_LONG's schedule where it has one)."""
    from ..spec import DECODE_MAX_QUERIES
    from .autoschedule import pick
    problem = Problem(head_dim, head_dim_v or head_dim, dtype, mask,
                      window_left=window[0] if window else 0, window_right=window[1] if window else 0,
                      softmax_scale=scale, mods=mods)
    # a few queries run on decode kernels where the decode template spells the modifications (the rest: prefill's).
    # Expressions stay on prefill's: attention's q_idx is a query's index among the queries, the decode kernels'
    # its position in the sequence (the serving API's paged_attention, whose queries are their sequences' last).
    expressions = mods.score_mod is not None or mods.mask_mod is not None
    if q_len is not None and 1 <= q_len <= DECODE_MAX_QUERIES and takes_mods(Family.DECODE, mods) and not expressions:
        spec = pick(arch, problem, q_len)
        if spec.family is Family.DECODE:
            return spec, False
    lookup = Mask.CAUSAL if mask is Mask.WINDOW else mask
    table_arch = arch.rstrip("a")   # sm_90a compiles sm_90's table entries
    key = (table_arch, dtype.value, head_dim, lookup.value)
    schedule = None
    if head_dim_v in (None, head_dim):
        schedule = (TUNED_LONG.get(key) if long_kv and not mods.active else None) or TUNED.get(key)
    if schedule is None:
        return pick(arch, problem), False
    if mods.blocks is not None:
        schedule = nested_schedule(schedule, mods.blocks)
    return KernelSpec(f"tuned_{table_arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, schedule), True


def nested_schedule(schedule: Schedule, blocks: tuple[int, int]) -> Schedule:
    """The table's schedule with tiles that divide block-sparse attention's blocks (layout.hopper.
    require_tiles_nest: a tile then lies in one block, computed or skipped whole): two consumers' 128 queries
    where the q tile does not divide the q block, and the largest kv tile up to the table's that divides the kv
    block. Blocks no 128-query tile divides keep the table's tiles (the layout refuses them, naming the tiles)."""
    block_q, block_kv = blocks
    if block_q % schedule.tile_q:
        if block_q % 128:
            return schedule
        schedule = replace(hopper_schedule(128, schedule.tile_kv, 2, intra=schedule.intra_overlap),
                           pingpong=schedule.pingpong, launch=schedule.launch)
    if block_kv % schedule.tile_kv:
        tile_kv = next((t for t in range(schedule.tile_kv - 16, 15, -16) if block_kv % t == 0), schedule.tile_kv)
        schedule = replace(schedule, tile_kv=tile_kv)
    return schedule


def _hint_once(key: tuple, arch: str, spec: KernelSpec) -> None:
    if key in _hinted:
        return
    _hinted.add(key)
    p = spec.problem
    print(f"tiledsl: no tuned schedule for {arch} {p.dtype.value} head_dim {p.head_dim_qk} mask {p.mask.value}; "
          f"using {spec.kernel_name} (the tune model's pick). Run `tiledsl tune SPACE.tile --seqlen N` to find a "
          f"faster one.", file=sys.stderr)


_resolved: dict[tuple, tuple] = {}


def resolve(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
            window: tuple[int, int] | None = None, scale: float | None = None, q_len: int | None = None,
            kv_len: int | None = None):
    """(the loaded kernel for this call, whether the tuned table had it): from this process's memo,
    else the warm record on disk (runtime/warm.py: no front end, no NVRTC), else tuned_spec + compile, whose
    result is recorded for the next process. Prefill lengths share one lookup per side of LONG_KV."""
    from ..runtime import warm
    from ..spec import DECODE_MAX_QUERIES
    decode_q = q_len if q_len is not None and 1 <= q_len <= DECODE_MAX_QUERIES else None
    long_kv = decode_q is None and kv_len is not None and kv_len >= LONG_KV
    lookup = (dtype.value, head_dim, mask.value, head_dim_v or head_dim, window, scale, decode_q, long_kv)
    hit = _resolved.get((arch, lookup))
    if hit is None:
        hit = warm.load(arch, lookup)
        if hit is None:
            spec, found = tuned_spec(arch, dtype, head_dim, mask, head_dim_v, window, scale, decode_q,
                                     long_kv=long_kv)
            hit = kernel_for(spec), found
            warm.save(arch, lookup, *hit)
        else:
            hit[0].function()   # load the module now, not under a later graph capture
            add(hit[0])
        _resolved[(arch, lookup)] = hit
    return hit


def _fp8_kernel(qv, kv, vv, mask, window, scale, k_scale, v_scale):
    """The decode kernel of an attention() call over an FP8 KV cache (kv_dtype = e4m3; not in the warm
    records yet: the first call of a configuration compiles)."""
    from .autoschedule import pick_decode
    from ..errors import RuntimeInputError
    from ..runtime.kv_fp8 import granularity
    from ..spec import DECODE_MAX_QUERIES, Problem
    if kv.dtype is not DType.E4M3 or vv.dtype is not DType.E4M3:
        raise RuntimeInputError("attention: k_scale / v_scale go with an FP8 KV cache: k and v both float8_e4m3fn; "
                                f"got k {getattr(kv.dtype, 'value', kv.dtype)}, v "
                                f"{getattr(vv.dtype, 'value', vv.dtype)}")
    q_len = qv.shape[2]
    if not 1 <= q_len <= DECODE_MAX_QUERIES:
        raise RuntimeInputError(f"attention: an FP8 KV cache is served by the decode kernel, 1..{DECODE_MAX_QUERIES} "
                                f"queries per sequence; q has {q_len} (prefill over FP8 K/V is not implemented)")
    if len(kv.shape) != 4:
        raise RuntimeInputError(f"attention: k must be 4-d (batch, kv_heads, seqlen, head_dim), got {kv.shape}")
    problem = Problem(qv.shape[-1], vv.shape[-1], qv.dtype, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=None if scale is None else float(scale),
                      kv_dtype=DType.E4M3, kv_scale=granularity(k_scale, v_scale, kv.shape[1]))
    spec = pick_decode(problem, q_len)
    if spec is None:
        raise RuntimeInputError(f"attention: no decode kernel for an FP8 KV cache at head dims {qv.shape[-1]} / "
                                f"{vv.shape[-1]} (FP8 needs multiples of 32)")
    return kernel_for(spec)


def window_ints(window):
    """attention's `window` as (left, right) ints >= 0, None for None; ValueError naming it otherwise."""
    if window is None:
        return None
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValueError(f"attention: window must be (left, right), two ints >= 0, got {window!r}") from None
    if left < 0 or right < 0:
        raise ValueError(f"attention: window must be (left, right), two ints >= 0, got {window!r}")
    return left, right


def check_q_v(dtype, q_shape: tuple, v_shape: tuple) -> None:
    """attention's refusals of q and v by dtype and rank (eager here; the fake op repeats them at
    trace time, tiledsl/dispatch/autograd.py)."""
    from ..errors import RuntimeInputError
    if dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"attention: q must be fp16 or bf16, got {getattr(dtype, 'value', dtype)}")
    if len(q_shape) != 4 or len(v_shape) != 4:
        raise RuntimeInputError(f"attention: q and v must be 4-d (batch, heads, seqlen, head_dim), got shapes "
                                f"{q_shape} and {v_shape}")


# call key -> (PreparedCall, whether it takes the FP8 scales): a warm call is this lookup and a launch.
_calls = SignatureCache()


def modified_forward(q, k, v, causal: bool, window, scale, kv_lens, mods: Modifications, aux: dict,
                     validate: bool | None = None, recorded: bool = False):
    """(O, LSE) of attention with score and mask modifications (dispatch/modified.py): the tuned table's
    schedule with them, its aux tensors checked against the launch before anything runs (their data too,
    where `validate` checks index tensors on the host: runtime/index_checks.py). `recorded`: autograd records
    the call (dispatch/autograd.py, which checked that a backward takes the modifications); otherwise inputs
    that need a gradient are refused, since nothing would give it."""
    if not recorded and _needs_gradient(q, k, v, *aux.values()):
        from ..errors import RuntimeInputError
        raise RuntimeInputError(f"attention: the kernels with score modifications ({', '.join(mods.config())}) "
                                "give gradients through PyTorch's autograd only (torch tensors); call under "
                                "torch.no_grad() or pass tensors that do not require grad")
    from ..runtime.aux_args import launch_aux
    passed = launch_aux(aux)   # dropout's (seed, offset) as the call's two values
    key = (signature(q), signature(k), signature(v), signature(kv_lens), causal, window, scale, validate, mods,
           tuple((name, signature(t)) for name, t in sorted(passed.items())))
    hit = _modified_calls.get(key)
    if hit is None:
        hit = _modified_calls.put(key, _prepare_modified(q, k, v, causal, window, scale, kv_lens, mods, aux, validate))
    call, scale_slots, names = hit
    return call(q, k, v, kv_lens, None, None, *scale_slots, *[passed[n] for n in names])


_modified_calls = SignatureCache()


def _prepare_modified(q, k, v, causal, window, scale, kv_lens, mods: Modifications, aux: dict, validate):
    """(PreparedCall, the FP8 scales' slots its CALL has before the aux tensors, the aux tensors' names in CALL
    order) of modified_forward's first call of a signature: the inputs and aux tensors checked, the kernel
    picked."""
    from ..errors import RuntimeInputError, SpecError
    from ..runtime.device import device_arch
    from ..runtime.tensors import view
    from .modified import check_launch
    from ..runtime.arguments import mask_arguments
    mask, window, scale = mask_arguments("attention", causal, window, scale)
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    check_q_v(qv.dtype, qv.shape, vv.shape)
    batch, heads, q_len, d = qv.shape
    check_launch(mods, aux, batch, heads, q_len, kv.shape[2], ragged=kv_lens is not None)
    spec, _ = tuned_spec(device_arch(), qv.dtype, d, mask, vv.shape[-1], window,
                         None if scale is None else float(scale), q_len, mods)
    try:
        kernel = kernel_for(spec)
    except SpecError as err:
        raise RuntimeInputError(f"attention: {err.message} (tiledsl.spec_for(...) prints the spec; the float64 "
                                "reference, tiledsl.reference.forward.reference_attention, runs it)") from None
    # the decode kernels' CALL has FP8 scales' slots (unused: 16-bit caches) before the aux tensors
    scale_slots = (None, None) if kernel.spec.family is Family.DECODE else ()
    tensors = (q, k, v, kv_lens, None, None) + scale_slots + kernel.aux_tensors(aux)
    return kernel.prepare_call(tensors, validate=validate), scale_slots, kernel.aux_names


def _needs_gradient(*tensors) -> bool:
    """Whether autograd would record a call on these (torch tensors that require grad, grad mode on)."""
    wants = [t for t in tensors if getattr(t, "requires_grad", False)]
    if not wants:
        return False
    import torch
    return torch.is_grad_enabled()


def forward(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
            kv_lens=None, k_scale=None, v_scale=None, validate: bool | None = None):
    """(O, LSE) of attention with the tuned spec: the path `attention` takes for CuPy inputs and FP8
    KV caches, and the custom op's implementation for torch tensors. float8_e4m3fn k and v are an FP8
    KV cache (decode only: seqlen_q <= 16), dequantized on chip with `k_scale` / `v_scale` (float32
    (kv_heads,) tensors, or Python floats / 1-element tensors; None: 1.0). `validate`: check kv_lens
    on the host (runtime/index_checks.py). The first call of a signature resolves the kernel and
    prepares the launch; later ones only launch (runtime/launch.py)."""
    ks, vs = tensor_or_none(k_scale), tensor_or_none(v_scale)
    call, scaled = _prepared(q, k, v, kv_lens, ks, vs, k_scale, v_scale, causal, window, scale, validate)
    if scaled:
        return call(q, k, v, kv_lens, None, None, ks, vs)
    return call(q, k, v, kv_lens, None, None)


def forward_call(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
                 kv_lens=None, validate: bool | None = None):
    """The PreparedCall forward() runs without FP8 scales: `call(q, k, v, kv_lens, None, None)` -> (O, LSE). One
    object per call signature, so it also stands for the signatures of the O and LSE it allocates (EagerAttention's
    backward keys on it)."""
    return _prepared(q, k, v, kv_lens, None, None, None, None, causal, window, scale, validate)[0]


def _prepared(q, k, v, kv_lens, ks, vs, k_scale, v_scale, causal, window, scale, validate):
    """(PreparedCall, takes the scales) of a forward call: the cache lookup, or the signature's first call."""
    if window is not None and type(window) is not tuple:
        try:
            window = tuple(window)
        except TypeError:   # not a pair: _prepare_forward's checks name it
            pass
    key = (signature(q), signature(k), signature(v), signature(kv_lens), signature(ks), signature(vs),
           number_or_none(k_scale), number_or_none(v_scale), causal, window, scale, validate)
    hit = _calls.get(key)
    if hit is None:
        hit = _calls.put(key, _prepare_forward(q, k, v, causal, window, scale, kv_lens, k_scale, v_scale, validate))
    return hit


def _prepare_forward(q, k, v, causal, window, scale, kv_lens, k_scale, v_scale, validate):
    """(PreparedCall, takes scales) of forward()'s first call of a signature."""
    from ..runtime.arguments import mask_arguments
    from ..runtime.device import device_arch
    from ..runtime.tensors import view
    mask, window, scale = mask_arguments("attention", causal, window, scale)   # a signature's first call only
    qv, vv = view(q, "q"), view(v, "v")
    check_q_v(qv.dtype, qv.shape, vv.shape)
    kv8 = view(k, "k")
    if DType.E4M3 in (kv8.dtype, vv.dtype) or k_scale is not None or v_scale is not None:
        kernel = _fp8_kernel(qv, kv8, vv, mask, window, scale, k_scale, v_scale)
        tensors = (q, k, v, kv_lens, None, None, tensor_or_none(k_scale), tensor_or_none(v_scale))
        return kernel.prepare_call(tensors, validate=validate, k_scale=k_scale, v_scale=v_scale), True
    arch = device_arch()
    kernel, found = resolve(arch, qv.dtype, qv.shape[-1], mask, vv.shape[-1], window, scale, qv.shape[2],
                            view(k, "k").shape[2])
    if not found and kernel.spec.family is not Family.DECODE:
        _hint_once((arch.rstrip("a"), kernel.spec.problem), arch, kernel.spec)
    return kernel.prepare_call((q, k, v, kv_lens, None, None), validate=validate), False


# FP8 prefill (dtype = e4m3): per head dim, the schedules the bench times side by side (bench/fp8_forward_bench.py
# --variants) and, in TUNED_FP8, the one attention() runs: the fastest over none and causal at 16k tokens
# (bench/NOTES.md has the numbers): 256-key tiles at d64 and d128 (V landing in one slot at d128), 128-key tiles at
# d256 one work item a block (O staged in K's ring). The producer keeps 40 registers for its V-transposing warps, the
# consumers 232 each. Per-block descales are one per kernel tile: TUNED_FP8_BLOCK keeps the 128-key tiles
# quantize_fp8(block=128) and its docs name, with the fastest of those schedules.
def fp8_schedule(tile_kv: int, pingpong: bool = False, intra: bool = False, stages: int = 2) -> Schedule:
    return Schedule(tile_q=128, tile_kv=tile_kv, warps=12, stages=stages, copy=CopyVia.TMA, mma=Mma.WGMMA,
                    producer_warpgroups=1, producer_regs=40, consumer_warpgroups=2, consumer_regs=232,
                    pingpong=pingpong, intra_overlap=intra)


def _fp8_variants(tile_kv: int) -> dict[str, Schedule]:
    return {"base": fp8_schedule(tile_kv), "intra": fp8_schedule(tile_kv, intra=True),
            "pingpong": fp8_schedule(tile_kv, pingpong=True),
            "pingpong_intra": fp8_schedule(tile_kv, pingpong=True, intra=True)}


# 256-key tiles halve the per-tile work of the softmax and O's rescale; their S takes the registers intra overlap
# would need, and V lands in one slot (layout/hopper.fp8_buffers) to fit shared memory.
_FP8_WIDE = {"kv256": fp8_schedule(256), "kv256_pingpong": fp8_schedule(256, pingpong=True)}
# (d256's 64-key tiles fit three stages of K and V^T with V landing in one slot, fp8_schedule(64, stages=3); slower
# than two on the H200, bench/NOTES.md, so not a variant.) A block of one work item (`launch grid`) may stage O in
# K's ring, free after its last Q K^T (layout/hopper.hopper_fp8_layout): d256's 128-key tiles fit only so, and
# d128's 256-key tiles so keep V's landing ring two deep.
FP8_VARIANTS: dict[int, dict[str, Schedule]] = {
    # d64's 256-key tiles leave registers for intra overlap and shared memory for a third stage
    64: _fp8_variants(128) | _FP8_WIDE | {"kv256_intra": fp8_schedule(256, intra=True),
                                          "kv256_s3": fp8_schedule(256, stages=3),
                                          "kv256_s3_intra": fp8_schedule(256, intra=True, stages=3)},
    128: _fp8_variants(128) | _FP8_WIDE | {"kv256_grid": replace(fp8_schedule(256), launch=LaunchKind.GRID)},
    256: _fp8_variants(64) | {"kv128_grid": replace(fp8_schedule(128), launch=LaunchKind.GRID)},
}

TUNED_FP8: dict[tuple[str, int], Schedule] = {("sm_90", d): FP8_VARIANTS[d][name]
                                              for d, name in {64: "kv256", 128: "kv256", 256: "kv128_grid"}.items()}
TUNED_FP8_BLOCK: dict[tuple[str, int], Schedule] = {("sm_90", d): FP8_VARIANTS[d][name]
                                                    for d, name in {64: "base", 128: "intra",
                                                                    256: "kv128_grid"}.items()}


def fp8_descale_kind(q_descale, k_descale, v_descale):
    """The granularity FP8 attention's descales have: 3-d -> per block, (batch, kv_heads) of more than one value ->
    per head, else (one value each, or None: 1.0) per tensor."""
    from ..spec import Descale
    shapes = [tuple(getattr(x, "shape", ())) for x in (q_descale, k_descale, v_descale) if x is not None]
    if any(len(s) == 3 for s in shapes):
        return Descale.PER_BLOCK
    if any(len(s) == 2 and s[0] * s[1] > 1 for s in shapes):
        return Descale.PER_HEAD
    return Descale.PER_TENSOR


def fp8_spec(arch: str, head_dim: int, mask: Mask, window, scale, descale, out_dtype: DType,
             where: str = "attention") -> KernelSpec:
    """The FP8 prefill spec of a call: TUNED_FP8's schedule for the head dim (TUNED_FP8_BLOCK's for per-block
    descales); RuntimeInputError (naming `where`, the API call) where there is none."""
    from ..errors import RuntimeInputError
    from ..spec import Descale
    table = TUNED_FP8_BLOCK if descale is Descale.PER_BLOCK else TUNED_FP8
    schedule = table.get((arch.rstrip("a"), head_dim))
    if schedule is None:
        raise RuntimeInputError(f"{where}: FP8 (float8_e4m3fn) q, k, v run on the hopper family (sm_90) at head dims "
                                f"{', '.join(str(d) for _, d in TUNED_FP8)}; got head dim {head_dim} on {arch}")
    problem = Problem(head_dim, head_dim, DType.E4M3, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=scale,
                      out_dtype=None if out_dtype is DType.BF16 else out_dtype,
                      descale=None if descale is Descale.PER_HEAD else descale)
    return KernelSpec(f"tuned_fp8_d{head_dim}_{mask.value}", problem, schedule)


def fp8_out_dtype(out_dtype, where: str) -> DType:
    """FP8 attention's `out_dtype` (a torch dtype, a DType or its name; None: bf16) as bf16 or fp16; anything else is a
    RuntimeInputError naming `where`."""
    from ..errors import RuntimeInputError
    if out_dtype is None:
        return DType.BF16
    name = str(out_dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float16", "fp16")
    found = next((d for d in (DType.BF16, DType.FP16) if name in (d.value, str(d))), None)
    if found is None:
        raise RuntimeInputError(f"{where}: out_dtype of FP8 attention is bf16 or fp16, got "
                                f"{getattr(out_dtype, 'value', out_dtype)}")
    return found


def fp8_forward(q, k, v, causal: bool = False, window=None, scale=None, kv_lens=None, q_descale=None, k_descale=None,
                v_descale=None, out_dtype=None, validate: bool | None = None):
    """(O, LSE) of FP8 attention: float8_e4m3fn q, k, v (batch, heads, seqlen, d) with float32 descales
    (runtime/fp8_descales.py: per tensor, per (batch, kv head), or per tile: tiledsl.quantize_fp8), O in `out_dtype`
    (bf16 or fp16; None: bf16)."""
    from ..errors import RuntimeInputError
    from ..runtime.arguments import mask_arguments
    from ..runtime.device import device_arch
    from ..runtime.tensors import view
    out_dtype = fp8_out_dtype(out_dtype, "attention")
    key = ("fp8", signature(q), signature(k), signature(v), signature(kv_lens), signature(q_descale),
           signature(k_descale), signature(v_descale), causal, window, scale, out_dtype, validate)
    call = _calls.get(key)
    if call is None:
        mask, window, scale = mask_arguments("attention", causal, window, scale)
        views = [view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
        for t in views:
            if t.dtype is not DType.E4M3:
                raise RuntimeInputError(f"attention: FP8 attention takes float8_e4m3fn q, k and v; {t.name} is "
                                        f"{getattr(t.dtype, 'value', t.dtype)}")
            if len(t.shape) != 4:
                raise RuntimeInputError(f"attention: {t.name} must be 4-d (batch, heads, seqlen, head_dim), got "
                                        f"{t.shape}")
        kind = fp8_descale_kind(q_descale, k_descale, v_descale)
        kernel = kernel_for(fp8_spec(device_arch(), views[0].shape[-1], mask, window, scale, kind, out_dtype))
        tensors = (q, k, v, kv_lens, None, None, q_descale, k_descale, v_descale)
        call = _calls.put(key, kernel.prepare_call(tensors, validate=validate))
    return call(q, k, v, kv_lens, None, None, q_descale, k_descale, v_descale)
