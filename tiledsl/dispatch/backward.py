"""The backward's choice of schedule: `attention_backward(q, k, v, o, lse, do, ...)` picks the backward spec
(BACKWARD_TUNED / BACKWARD_WGMMA_TUNED, measured on the H200, or the first fallback tile that fits) and runs
its module (runtime/backward.py).

    o, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = tiledsl.attention_backward(q, k, v, o, lse, do, causal=True)

With BACKWARD_WGMMA on, head dims 64 and 128 on Hopper take the wgmma main kernel
(templates/backward_wgmma.cu.j2); `attention_backward(..., mma=...)` forces either.

GQA: a main-kernel block loops over the query heads of its kv head itself (dK, dV stay in registers), so
the group's sum has a fixed order and needs no fp32 workspace, atomics or convert kernel; the price is
fewer blocks (kv tiles x batch x kv heads) when kv heads are few."""
from __future__ import annotations

import functools
from dataclasses import replace

from ..errors import RuntimeInputError, SpecError
from ..layout.backward import BACKWARD_DIM_MULTIPLE, backward_has_template, backward_layout
from ..layout.backward_ws import ws_mods_refusal, ws_ordered_refusal
from ..mods.model import NO_MODS, Modifications
from ..runtime.arguments import mask_arguments, switch
from ..runtime.launch import SignatureCache
from ..runtime.tensors import leading_columns, signature, view, zero_padded
from ..spec import (BackwardSchedule, CopyVia, DqAccumulate, DType, KernelSpec, Mask, Mma, Problem, Schedule,
                    default_softmax_scale)

# (head dim) -> (tile q, tile kv, warps, stages) of the mma.sync kernel, dq atomic: the fastest measured
# at 4k on the H200 (bench/NOTES.md, "Why the tables hold what they hold"). fp16 has the same shapes.
# Other head dims take the first fallback that fits.
BACKWARD_TUNED: dict[int, BackwardSchedule] = {64: BackwardSchedule(tile_q=128, tile_kv=128, warps=8, stages=2),
                                               128: BackwardSchedule(tile_q=64, tile_kv=128, warps=8, stages=2)}

_FALLBACKS = tuple(BackwardSchedule(tile_q=q, tile_kv=kv, warps=w, stages=s)
                   for q, kv, w, s in ((64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 8, 2), (16, 128, 8, 2), (16, 64, 4,
                                                                                                           1)))

# The wgmma main kernel (templates/backward_wgmma.cu.j2): attention_backward uses it when this is on,
# the GPU is a Hopper (sm_90a) and BACKWARD_WGMMA_TUNED has the head dim (same qk and v head dims, atomic dQ);
# everything else keeps the mma.sync kernel. On: validated on the H200 (tests/test_gpu_backward_wgmma.py) and
# faster than the mma.sync kernel at every measured shape (bench/NOTES.md, "Why the tables hold what they hold").
BACKWARD_WGMMA = True

# (head dim) -> (tile q, tile kv, warps, stages) of the wgmma kernel: 2 warpgroups x 64 keys.
# d64 tile q 128 (dQ split by rows), d128 tile q 64 (split by columns); d64 q64 would split dQ by keys,
# twice the atomics.
BACKWARD_WGMMA_TUNED: dict[int, BackwardSchedule] = {
    64: BackwardSchedule(tile_q=128, tile_kv=128, warps=8, stages=2, mma=Mma.WGMMA),
    128: BackwardSchedule(tile_q=64, tile_kv=128, warps=8, stages=2, mma=Mma.WGMMA)}


# The warp-specialized backward (templates/backward_ws.cu.j2: a TMA producer warpgroup, two consumer warpgroups,
# a dQ writer warp): attention_backward takes it when BACKWARD_WS is on (or warp_specialized=True) on a Hopper
# GPU for the head dims below. On: validated on the H200 (tests/test_gpu_backward_ws.py) and faster than the
# wgmma backward at d128 everywhere measured, at d64 from 16k, and the only backward for d256
# (bench/NOTES.md, "Why the tables hold what they hold").
BACKWARD_WS = True


def _ws(tile_q: int, tile_kv: int, dq: DqAccumulate, stages: int = 2) -> BackwardSchedule:
    return BackwardSchedule(tile_q=tile_q, tile_kv=tile_kv, warps=8, stages=stages, mma=Mma.WGMMA, dq=dq,
                            producer_warpgroups=1, producer_regs=24, consumer_warpgroups=2, consumer_regs=240,
                            copy=CopyVia.TMA)


# (head dim) -> its schedule: d64 and d128 as the wgmma kernel's tiles (each consumer owns 64 keys of 128), dQ
# staged and added by TMA reduce-add; d256 shares 64 keys between the consumers by head-dim columns, with dQ
# staged for the TMA reduce-add beside a 1-slot ring (the staging buffer does not fit beside two slots; adding
# dQ from registers with two slots measured slower).
BACKWARD_WS_TUNED: dict[int, BackwardSchedule] = {64: _ws(128, 128, DqAccumulate.TMA_REDUCE),
                                                  128: _ws(64, 128, DqAccumulate.TMA_REDUCE),
                                                  256: _ws(64, 64, DqAccumulate.TMA_REDUCE, stages=1)}
# deterministic=True: `dq accumulate ordered` (staged, added in kv tile order); at d256 the staging buffer fits
# beside a 1-slot ring only.
BACKWARD_WS_DETERMINISTIC: dict[int, BackwardSchedule] = {64: _ws(128, 128, DqAccumulate.ORDERED),
                                                          128: _ws(64, 128, DqAccumulate.ORDERED),
                                                          256: _ws(64, 64, DqAccumulate.ORDERED, stages=1)}


# mask = blocks(...) with deterministic dQ: the dQ writer also counts each step's turn in its q tile's row of
# block_mask (templates/block_mask.cuh), which the producer warpgroup's 24 registers do not hold without spills;
# (producer, consumer) registers, the consumers' accumulators fitting 232
ORDERED_BLOCKS_REGS = (32, 232)


@functools.lru_cache(maxsize=None)
def backward_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
                  window: tuple[int, int] | None = None, scale: float | None = None,
                  deterministic: bool = False, mma: Mma = Mma.SYNC, warp_specialized: bool = False,
                  mods: Modifications = NO_MODS) -> KernelSpec:
    """The backward spec for a problem: BACKWARD_TUNED's schedule for the head dim, else the first of
    the fallback tiles that fits (layout.backward_layout); `deterministic` sums dQ on chip
    (`dq accumulate separate`) instead of with atomics. `mma` wgmma: BACKWARD_WGMMA_TUNED's schedule
    (RuntimeInputError where the wgmma kernel has none). `warp_specialized`: BACKWARD_WS_TUNED's schedule
    (RuntimeInputError where ws_refusal objects). `mods`: score modifications, which only the warp-specialized
    backward spells (RuntimeInputError naming what is missing elsewhere). `arch` is for the table's future rows."""
    problem = Problem(head_dim, head_dim_v or head_dim, dtype, mask, window_left=window[0] if window else 0,
                      window_right=window[1] if window else 0, softmax_scale=scale, mods=mods)
    if mods.active and not warp_specialized:
        raise RuntimeInputError(f"attention_backward: {modified_refusal(mods)}")
    if warp_specialized:
        why = ws_refusal(arch, head_dim, head_dim_v, deterministic)
        if why:
            raise RuntimeInputError(f"attention_backward: the warp-specialized backward {why}"
                                    + (f" ({modified_refusal(mods)})" if mods.active else ""))
        b = (BACKWARD_WS_DETERMINISTIC if deterministic else BACKWARD_WS_TUNED)[head_dim]
        if mods.blocks is not None and deterministic:
            b = replace(b, producer_regs=ORDERED_BLOCKS_REGS[0], consumer_regs=ORDERED_BLOCKS_REGS[1])
        spec = KernelSpec(f"backward_{arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, Schedule(), backward=b)
        why = backward_has_template(spec) if mods.active else ""
        if why:
            raise RuntimeInputError(f"attention_backward: {why}; the float64 reference "
                                    "(tiledsl.reference.backward.reference_backward) takes them")
        backward_layout(spec)
        return spec
    dq = DqAccumulate.SEPARATE if deterministic else DqAccumulate.ATOMIC
    if mma is Mma.WGMMA:
        why = wgmma_refusal(arch, head_dim, head_dim_v, deterministic)
        if why:
            raise RuntimeInputError(f"attention_backward: the wgmma backward {why}")
        b = replace(BACKWARD_WGMMA_TUNED[head_dim], dq=dq)
        spec = KernelSpec(f"backward_{arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, Schedule(), backward=b)
        backward_layout(spec)
        return spec
    tuned = BACKWARD_TUNED.get(head_dim) if head_dim_v in (None, head_dim) else None
    error = None
    for candidate in ((tuned,) if tuned else ()) + _FALLBACKS:
        b = replace(candidate, dq=dq)
        spec = KernelSpec(f"backward_{arch}_{dtype.value}_d{head_dim}_{mask.value}", problem, Schedule(), backward=b)
        try:
            backward_layout(spec)
            return spec
        except SpecError as err:
            error = err
    raise RuntimeInputError(f"attention_backward: no backward schedule fits head dim {head_dim}/{head_dim_v}: {error}")


def modified_refusal(mods: Modifications) -> str:
    """What a backward with score modifications needs: the warp-specialized Hopper backward's head dims."""
    return (f"modifications ({', '.join(mods.config())}) have a backward only in the warp-specialized Hopper "
            f"backward (sm_90a, head dims {sorted(BACKWARD_WS_TUNED)} with qk = v); the wgmma and mma.sync backwards "
            "spell none")


def modified_backward_refusal(arch: str, head_dim: int, head_dim_v: int | None, mods: Modifications,
                              deterministic: bool = False) -> str:
    """Why attention_backward can't differentiate attention with `mods` ("" when it can): asked by the forward
    before it runs, so a call that needs a gradient is refused before any kernel launches."""
    why = ws_mods_refusal(mods) or (ws_ordered_refusal(mods) if deterministic else "")
    if why:
        return why
    if ws_refusal(arch, head_dim, head_dim_v, False):
        return f"head dims {head_dim}/{head_dim_v or head_dim} on {arch}: {modified_refusal(mods)}"
    if mods.blocks is not None:   # the backward's tiles must divide the blocks (layout.backward_ws)
        try:
            chosen_backward_spec(arch, DType.BF16, head_dim, Mask.NONE, head_dim_v, mods=mods)
        except SpecError as err:
            return f"head dim {head_dim}: {err.message}"
    return ""


def wgmma_refusal(arch: str, head_dim: int, head_dim_v: int | None, deterministic: bool) -> str:
    """Why the wgmma backward can't take a problem ("" when it can)."""
    if not arch.startswith("sm_90"):
        return f"needs a Hopper GPU (sm_90a), this one is {arch}"
    if head_dim not in BACKWARD_WGMMA_TUNED or head_dim_v not in (None, head_dim):
        return (f"is built for head dims {sorted(BACKWARD_WGMMA_TUNED)} (qk = v), not "
                f"{head_dim}/{head_dim_v or head_dim}; "
                "the mma.sync backward takes the others")
    if deterministic:
        return "sums dQ with fp32 atomics; deterministic=True takes the mma.sync backward"
    return ""


def ws_refusal(arch: str, head_dim: int, head_dim_v: int | None, deterministic: bool) -> str:
    """Why the warp-specialized backward can't take a problem ("" when it can; it has a deterministic schedule
    for every head dim it serves)."""
    if not arch.startswith("sm_90"):
        return f"needs a Hopper GPU (sm_90a), this one is {arch}"
    if head_dim not in BACKWARD_WS_TUNED or head_dim_v not in (None, head_dim):
        return (f"is built for head dims {sorted(BACKWARD_WS_TUNED)} (qk = v), not {head_dim}/{head_dim_v or head_dim}"
                "; the wgmma or mma.sync backward takes the others")
    return ""


# call key -> PreparedCall of the backward's three launches: a warm backward is this lookup and the launches.
_calls = SignatureCache()


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, window: tuple[int, int] | None = None,
                       scale: float | None = None, kv_lens=None, deterministic: bool = False, mma: str | None = None,
                       validate: bool | None = None, warp_specialized: bool | None = None, softcap=None,
                       alibi_slopes=None, sinks=None, document_ids=None, document_bounds=None, prefix=None,
                       block_mask=None, block_size=None, score_mod=None, mask_mod=None, aux=None, dropout_p=0.0,
                       dropout_rng=None):
    """(dq, dk, dv) of attention: q, o, do (batch, heads, q_len, d[v]); k, v (batch, kv_heads, kv_len,
    d[v]); lse fp32 (batch, heads, q_len), natural log, as tiledsl.attention(..., return_lse=True)
    returns it. Masks and kv_lens as the forward's. `deterministic`: bit-identical results run to
    run (dQ summed on chip by a second kernel instead of fp32 atomics). Outputs in q's framework and
    dtype, shaped like q, k, v; launched on the caller's stream. `mma`: "wgmma" or "mma.sync" forces the
    main kernel's instruction (wgmma refuses problems it has no kernel for); None: wgmma when
    BACKWARD_WGMMA is on and it takes the problem, else mma.sync. `warp_specialized`: True runs the
    warp-specialized backward (refusing problems it has no kernel for), False never; None: when BACKWARD_WS is on
    and it takes the problem (`mma` unset). `validate`: True checks kv_lens on the host (a copy: a sync); left
    out, the kernels bound it on the device (a bad entry: NaN dQ, dK, dV for its sequence and a report that
    tiledsl.check_errors() raises; runtime/index_checks.py). The first call of a signature picks the spec and
    prepares the three launches; later ones only launch.

    `softcap`, `alibi_slopes` and `sinks` are the forward's score modifications (tiledsl.attention's keywords;
    pass the same ones): the warp-specialized backward recomputes the modified scores and takes dS through
    them; with `sinks` the result is (dq, dk, dv, dsink), dsink float32 (heads,). `block_mask` / `block_size`
    (block-sparse attention, as the forward's): each kv tile walks only the q tiles whose block is nonzero. Other
    modifications, and
    problems the warp-specialized backward does not take, are refused (RuntimeInputError naming what is
    missing).

    `document_ids` (int32 (batch, kv_len)) or `document_bounds` (int32 (batch, documents + 1)) are the forward's
    document mask (the same tensor): a block of keys walks only the q tiles of its keys' documents. Their order is
    checked on the host as the forward's (mods/checks; a copy, skipped with validate=False). `prefix` (an int N >= 1,
    with causal=False and no window) is the forward's prefix-LM mask: a kv tile of prefix keys walks every q tile.

    `score_mod`, `mask_mod` and `aux` are the forward's expressions and their aux tensors (tiledsl.attention's
    keywords): the scores are recomputed through score_mod and dS taken through its derivative (a score_mod with
    none, such as floor of the score, is refused before launch); a kv tile walks only the steps mask_mod can show a
    key of. The aux tensors get no gradient (FlexAttention's rule for captured buffers).

    `dropout_p` with `dropout_rng` = the forward's (seed, offset) (tiledsl.attention(..., dropout_seed=S) draws
    (S, 0); autograd saves the pair it drew): the backward redraws the forward's keep mask from them."""
    mask, window, scale = mask_arguments("attention_backward", causal, window, scale)   # every call, before any spec
    causal, deterministic = mask is Mask.CAUSAL, switch("attention_backward", "deterministic", deterministic)
    mods, aux_tensors = NO_MODS, ()
    if not (softcap is None and alibi_slopes is None and sinks is None and document_ids is None
            and document_bounds is None and prefix is None and block_mask is None and block_size is None
            and score_mod is None and mask_mod is None and aux is None and not dropout_p and dropout_rng is None):
        from .modified import check_mask, modifications
        mods, named = modifications("attention_backward", softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                    document_ids=document_ids, document_bounds=document_bounds, prefix=prefix,
                                    block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                                    mask_mod=mask_mod, aux=aux, dropout_p=dropout_p, differentiable=True)
        check_mask("attention_backward", mods, mask)
        aux_tensors = tuple(named[a.name] for a in mods.user_aux())   # the kernel's CALL order after kv_lens
        aux_tensors += dropout_values("attention_backward", mods, dropout_rng)
    tensors = (q, k, v, o, lse, do, kv_lens) + aux_tensors
    return prepared_backward(tensors, causal, window, scale, deterministic, mma, validate, warp_specialized,
                             mods)(*tensors)


def dropout_values(where: str, mods: Modifications, rng) -> tuple:
    """The backward kernel's dropout seed and offset (runtime/aux_args.launch_aux) from the forward's pair."""
    from ..mods.model import AUX_DROPOUT, DROPOUT_PARAMETERS
    from ..runtime.aux_args import launch_aux
    if mods.dropout is None:
        if rng is not None:
            raise RuntimeInputError(f"{where}: dropout_rng is the forward's dropout (seed, offset); pass "
                                    "dropout_p with it")
        return ()
    if rng is None:
        raise RuntimeInputError(f"{where}: dropout_p needs dropout_rng, the forward's (seed, offset), to redraw its "
                                "keep mask")
    try:
        values = launch_aux({AUX_DROPOUT: rng})
    except RuntimeInputError as err:
        raise RuntimeInputError(f"{where}: {err}") from None
    return tuple(values[name] for name in DROPOUT_PARAMETERS)


def prepared_backward(tensors: tuple, causal: bool, window: tuple[int, int] | None, scale: float | None,
                      deterministic: bool, mma: str | None = None, validate: bool | None = None,
                      warp_specialized: bool | None = None, mods: Modifications = NO_MODS):
    """The PreparedCall of attention_backward on `tensors` (q, k, v, o, lse, do, kv_lens, then the aux tensors of
    `mods.user_aux()`) with checked scalars (runtime/arguments.mask_arguments): `call(*tensors)` -> (dq, dk, dv),
    and dsink fourth with sinks."""
    key = (tuple(map(signature, tensors)), causal, window, scale, deterministic, mma, validate, warp_specialized,
           BACKWARD_WS) + ((mods,) if mods.active else ())
    call = _calls.get(key)
    if call is None:
        call = _calls.put(key, _prepare_backward(tensors, causal, window, scale, deterministic, mma, validate,
                                                 warp_specialized, mods))
    return call


# (the forward's PreparedCall, its scalars, dO's signature, BACKWARD_WS) -> the backward's PreparedCall: what
# EagerAttention's backward looks up. The forward's call is one object per signature of q, k, v and kv_lens and
# allocates O and the LSE alike every time, so it stands for five of the seven signatures prepared_backward reads.
_after_forward = SignatureCache()


def backward_after_forward(forward_call, scalars: tuple, q, k, v, o, lse, do, kv_lens):
    """(dq, dk, dv) of attention_backward with the defaults of `mma` and `warp_specialized`, for O and the LSE
    that `forward_call` (tuned.forward_call) returned; `scalars` (causal, window, scale, deterministic,
    validate) as the forward's call checked them."""
    key = (forward_call, scalars, signature(do), BACKWARD_WS)
    call = _after_forward.get(key)
    if call is None:
        tensors = (q, k, v, o, lse, do, kv_lens)
        causal, window, scale, deterministic, validate = scalars
        call = _after_forward.put(key, prepared_backward(tensors, causal, window, scale, deterministic, None,
                                                         validate))
    return call(q, k, v, o, lse, do, kv_lens)


def _prepare_backward(tensors, causal, window, scale, deterministic, mma, validate, warp_specialized, mods=NO_MODS):
    from ..runtime.device import device_arch
    from .kernels import BACKWARD, kernel_for
    q, v = tensors[0], tensors[2]
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)   # checked by the caller
    qv, vv = view(q, "q"), view(v, "v")
    if qv.dtype not in (DType.FP16, DType.BF16):
        raise RuntimeInputError(f"attention_backward: q must be fp16 or bf16, got "
                                f"{getattr(qv.dtype, 'value', qv.dtype)}")
    if len(qv.shape) != 4 or len(vv.shape) != 4:
        raise RuntimeInputError(f"attention_backward: q and v must be 4-d (batch, heads, seqlen, head_dim), got "
                                f"shapes {qv.shape} and {vv.shape}")
    d, dv = qv.shape[-1], vv.shape[-1]
    if d % HEAD_DIM_MULTIPLE or dv % HEAD_DIM_MULTIPLE:
        raise RuntimeInputError(f"attention_backward: head dims must be multiples of {HEAD_DIM_MULTIPLE}, got q {d}, "
                                f"v {dv}")
    padded_d, padded_dv = (-(-n // BACKWARD_DIM_MULTIPLE) * BACKWARD_DIM_MULTIPLE for n in (d, dv))
    if (padded_d, padded_dv) != (d, dv) and mods.active:
        raise RuntimeInputError(f"attention_backward: head dims {d}/{dv}: {modified_refusal(mods)}")
    if (padded_d, padded_dv) != (d, dv):
        return PaddedBackward.prepare(tensors, d, dv, padded_d, padded_dv, causal, window, scale, deterministic, mma,
                                      validate, warp_specialized)
    spec = chosen_backward_spec(device_arch(), qv.dtype, d, mask, dv, window, scale, deterministic, mma,
                                warp_specialized, mods)
    return kernel_for(spec, BACKWARD).prepare_call(tensors, validate)


HEAD_DIM_MULTIPLE = 8   # the head dims attention_backward takes: the forward's (fa2 pads them on chip)


class PaddedBackward:
    """attention_backward where a head dim is a multiple of 8 but not of BACKWARD_DIM_MULTIPLE: q, k (the qk
    dim) and v, O, dO (the v dim) zero-padded to the next multiple, in their framework on the caller's stream
    (arrays from its allocator, per call); the padded problem's prepared backward with the softmax scale of the
    unpadded head dim; dQ, dK, dV cut back to their columns (contiguous). Exact: zero columns add nothing to
    S = Q K^T, D = rowsum(dO o O) or dP = dO V^T, and the gradients' padded columns are dropped."""

    def __init__(self, call, d: int, dv: int, padded_d: int, padded_dv: int):
        self.call, self.d, self.dv = call, d, dv
        self.extra_d, self.extra_dv = padded_d - d, padded_dv - dv

    @classmethod
    def prepare(cls, tensors, d, dv, padded_d, padded_dv, causal, window, scale, deterministic, mma, validate,
                warp_specialized):
        padded = cls(None, d, dv, padded_d, padded_dv)
        scale = default_softmax_scale(d) if scale is None else scale   # the unpadded head dim's default
        try:
            padded.call = prepared_backward(padded.pad(tensors), causal, window, scale, deterministic, mma, validate,
                                            warp_specialized)
        except RuntimeInputError as err:
            raise RuntimeInputError(f"{err} (head dims {d}/{dv} padded to {padded_d}/{padded_dv})") from None
        return padded

    def pad(self, tensors: tuple) -> tuple:
        q, k, v, o, lse, do, kv_lens = tensors
        qk, vo = self.extra_d, self.extra_dv
        return (zero_padded(q, qk) if qk else q, zero_padded(k, qk) if qk else k, *(
            zero_padded(x, vo) if vo else x for x in (v, o)), lse, zero_padded(do, vo) if vo else do, kv_lens)

    def __call__(self, *tensors):
        dq, dk, dv = self.call(*self.pad(tensors))
        if self.extra_d:
            dq, dk = leading_columns(dq, self.d), leading_columns(dk, self.d)
        return dq, dk, leading_columns(dv, self.dv) if self.extra_dv else dv


def chosen_backward_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
                         window: tuple[int, int] | None = None, scale: float | None = None, deterministic: bool = False,
                         mma: str | None = None, warp_specialized: bool | None = None,
                         mods: Modifications = NO_MODS) -> KernelSpec:
    """The spec attention_backward runs: the warp-specialized backward when `warp_specialized` is True (or None
    with BACKWARD_WS on, `mma` unset and ws_refusal without objection); else `mma` "wgmma" / "mma.sync" forced,
    or None: wgmma when BACKWARD_WGMMA is on and wgmma_refusal has no objection, else mma.sync. Score
    modifications (`mods`) take the warp-specialized backward unless `warp_specialized` is False or `mma` is given
    (refused then: no other backward spells them)."""
    if warp_specialized is None:
        warp_specialized = (BACKWARD_WS or mods.active) and mma is None and (
            mods.active or not ws_refusal(arch, head_dim, head_dim_v, deterministic))
    if warp_specialized:
        return backward_spec(arch, dtype, head_dim, mask, head_dim_v, window, scale, deterministic, Mma.WGMMA, True,
                             mods)
    if mods.active:
        raise RuntimeInputError(f"attention_backward: {modified_refusal(mods)}"
                                + (f"; mma={mma!r} was asked for" if mma is not None else
                                   "; warp_specialized=False was asked for"))
    if mma is None:
        chosen = Mma.WGMMA if BACKWARD_WGMMA and not wgmma_refusal(arch, head_dim, head_dim_v,
                                                                   deterministic) else Mma.SYNC
    else:
        table = {m.value: m for m in Mma}
        if mma not in table:
            raise ValueError(f"attention_backward: mma must be one of {sorted(table)} or None, got {mma!r}")
        chosen = table[mma]
    return backward_spec(arch, dtype, head_dim, mask, head_dim_v, window, scale, deterministic, chosen)
