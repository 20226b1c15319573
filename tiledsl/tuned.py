"""Tuned defaults: the best known spec per (arch, dtype, head dim, mask), and `attention()`.

    o = tiledsl.attention(q, k, v, causal=True)        # q (batch, heads, seqlen, d), k/v alike

picks the spec from TUNED for the current GPU, compiles it once per process (kernels are cached
per spec) and runs it. A (arch, dtype, head dim, mask) not in the table gets DEFAULT_SCHEDULE
(q128/kv64/4 warps/2 stages, legal and spill-light for head dims up to 128) and a one-line hint,
once per process, to run `tiledsl tune` for it. A window mask uses the causal entry's schedule
(both skip whole tiles); `scale` is passed through as the spec's softmax scale.
"""
from __future__ import annotations

import sys

from .spec import DType, KernelSpec, Mask, Problem, Schedule

# From H200 measurements, peers in the same run (bench/results/2026-11-30-hopper-ablation-3.json,
# `python bench/hopper_ablation.py OUT.json`): the hopper family wins every (head dim, mask) it
# serves; its best schedule per entry, as a ratio to SDPA cuDNN at 4k-16k:
#   d64 none / causal:    3 consumers, q192/kv128, intra overlap       (0.99-1.08 / 0.97-1.06)
#   d128 none:            2 consumers, q128/kv128, intra overlap       (0.99-1.01)
#   d128 causal:          2 consumers, q128/kv128, ping-pong + intra   (0.96-1.02)
#   d256 none / causal:   2 consumers, q128/kv80 / kv64 + intra        (0.91-0.94 / 0.98-1.02)
# fp16 has the same tile shapes, sizes and ptxas reports, so each entry serves both dtypes until
# both are measured. Before the hopper family the table held FA2-on-wgmma schedules
# (bench/results/2026-11-30-tune-bench-3.json), 0.67-0.85x cuDNN.
def _hopper(tile_q: int, tile_kv: int, consumers: int, overlap: str) -> str:
    regs = {2: "producer 1 regs 24, consumer 2 regs 240", 3: "producer 1 regs 32, consumer 3 regs 160"}[consumers]
    lines = [f"tile q = {tile_q}, kv = {tile_kv}", f"warpgroups {regs}", "pipeline 2 stages via tma"]
    return "\n        ".join(lines + ([f"overlap {overlap}"] if overlap else []))


_SCHEDULES = {(64, "none"): _hopper(192, 128, 3, "intra"), (64, "causal"): _hopper(192, 128, 3, "intra"),
              (128, "none"): _hopper(128, 128, 2, "intra"), (128, "causal"): _hopper(128, 128, 2, "pingpong, intra"),
              (256, "none"): _hopper(128, 80, 2, ""), (256, "causal"): _hopper(128, 64, 2, "intra")}
_TEMPLATE = """attention {name} {{
    head_dim = {d}
    dtype    = {dtype}
    mask     = {mask}
    schedule {{
        order q, kv
        {schedule}
    }}
}}
"""


def _entry(dtype: str, d: int, mask: str) -> str:
    return _TEMPLATE.format(name=f"tuned_sm90_{dtype}_d{d}_{mask}", d=d, dtype=dtype, mask=mask,
                            schedule=_SCHEDULES[(d, mask)])


TUNED: dict[tuple[str, str, int, str], str] = {
    ("sm_90", dtype, d, mask): _entry(dtype, d, mask)
    for dtype in ("bf16", "fp16") for d in (64, 128, 256) for mask in ("none", "causal")
}

DEFAULT_SCHEDULE = Schedule(tile_q=128, tile_kv=64, warps=4, stages=2)

_kernels: dict[KernelSpec, object] = {}
_hinted: set[tuple] = set()


def tuned_spec(arch: str, dtype: DType, head_dim: int, mask: Mask, head_dim_v: int | None = None,
               window: tuple[int, int] | None = None, scale: float | None = None) -> tuple[KernelSpec, bool]:
    """(the spec to run, whether it came from the table). Pure: no GPU needed."""
    from .parse import load_spec
    arch = arch.rstrip("a")   # sm_90a compiles sm_90's table entries
    lookup = Mask.CAUSAL if mask is Mask.WINDOW else mask
    text = TUNED.get((arch, dtype.value, head_dim, lookup.value)) if head_dim_v in (None, head_dim) else None
    if text is not None:
        spec, found = load_spec(text), True
        schedule = spec.schedule
    else:
        schedule, found = DEFAULT_SCHEDULE, False
    problem = Problem(head_dim, head_dim_v or head_dim, dtype, mask,
                      window_left=window[0] if window else 0, window_right=window[1] if window else 0,
                      softmax_scale=scale)
    name = f"tuned_{arch}_{dtype.value}_d{head_dim}_{mask.value}" if found else f"default_{dtype.value}_d{head_dim}"
    return KernelSpec(name, problem, schedule), found


def _hint_once(key: tuple, arch: str, dtype: DType, head_dim: int, mask: Mask) -> None:
    if key in _hinted:
        return
    _hinted.add(key)
    print(f"tiledsl: no tuned schedule for {arch} {dtype.value} head_dim {head_dim} mask {mask.value}; using "
          f"q128/kv64/4 warps/2 stages. Run `tiledsl tune SPACE.tile --seqlen N` to find a faster one.",
          file=sys.stderr)


def attention(q, k, v, causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None):
    """Attention of q (batch, heads, seqlen_q, d) over k, v (batch, kv_heads, seqlen_kv, d / dv)
    with the tuned spec for this GPU; returns O (q's dtype). `window=(left, right)` is a sliding
    window (keys visible before / after the bottom-right aligned diagonal); it excludes causal."""
    from .families import compile
    from .runtime import device_arch
    from .tensors import view
    if causal and window is not None:
        raise ValueError("attention: pass causal=True or window=(left, right), not both "
                         "(a causal window is window=(left, 0))")
    qv, vv = view(q, "q"), view(v, "v")
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)
    if not isinstance(qv.dtype, DType):
        from .errors import RuntimeInputError
        raise RuntimeInputError(f"attention: q must be fp16, bf16 or fp32, got {qv.dtype}")
    arch = device_arch()
    dtype, head_dim = qv.dtype, qv.shape[-1]
    spec, found = tuned_spec(arch, dtype, head_dim, mask, vv.shape[-1], window, scale)
    if not found:
        _hint_once((arch.rstrip("a"), dtype, head_dim, mask), arch, dtype, head_dim, mask)
    kernel = _kernels.get(spec)
    if kernel is None:
        kernel = _kernels[spec] = compile(spec)
    out, _ = kernel(q, k, v)
    return out
