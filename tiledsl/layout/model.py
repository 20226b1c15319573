"""The layout of a config no template builds (fp32, or a family and MMA without a template): the scheduler
graph's dense-tile model, so `explain` still shows a budget; lowering refuses it."""
from __future__ import annotations

import math

from ..device_limits import DeviceLimits, setmaxnreg_refusal
from ..hw import MBARRIER_BYTES, WGMMA_ROWS
from ..spec import DTYPE_BYTES, Axis, DType, Family, KernelSpec
from .base import REGISTER_OVERHEAD, Buffer, Layout, Registers, finish, refuse, require


def graph_model_layout(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    """Dense tiles, no alignment, fp32 accumulators: the model `explain` shows for a family (or
    dtype) that has no CUDA template yet; lowering refuses such specs by name."""
    p, s = spec.problem, spec.schedule
    hopper = spec.family is Family.HOPPER
    mma_divisibility(spec)
    e, S = DTYPE_BYTES[p.dtype], s.stages
    Br, Bc, d, dv = s.tile_q, s.tile_kv, p.head_dim_qk, p.head_dim_v
    buffers = [Buffer("Q", 0, Br * d * e, e, formula=f"Br*d*{e} = {Br}*{d}*{e}"),
               Buffer("K", Br * d * e, S * Bc * d * e, e, S, Bc * d * e, formula=f"{S}x Bc*d*{e} = {S}x {Bc}*{d}*{e}"),
               Buffer("V", (Br + S * Bc) * d * e, S * Bc * dv * e, e, S, Bc * dv * e,
                      formula=f"{S}x Bc*dv*{e} = {S}x {Bc}*{dv}*{e}")]
    if hopper:
        count = 4 * S + 1   # full and empty per K and V slot, plus Q's
        buffers.append(Buffer("mbarriers", buffers[-1].offset + buffers[-1].bytes, MBARRIER_BYTES * count,
                              MBARRIER_BYTES, formula=f"{count} x {MBARRIER_BYTES}"))
        threads = 128 * (s.producer_warpgroups + s.consumer_warpgroups)
        mma_threads, rows = 128 * s.consumer_warpgroups, Br / max(4 * s.consumer_warpgroups, 1)
    else:
        threads = mma_threads = 32 * s.warps
        rows = Br if s.warp_axis is Axis.KV else Br / max(s.warps, 1)
    o_threads = 32 if s.warp_axis is Axis.KV and not hopper and s.warps > 1 else mma_threads
    registers = [Registers("O accumulator", math.ceil(Br * dv / o_threads),
                           f"Br*dv/{o_threads} = {Br}*{dv}/{o_threads}", True),
                 Registers("S/P accumulator", math.ceil(Br * Bc / mma_threads),
                           f"Br*Bc/{mma_threads} = {Br}*{Bc}/{mma_threads}",
                           True),
                 Registers("m, l", 4 * math.ceil(rows / 16), f"2 x 2 rows x ceil({rows:g}/16)", True),
                 Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    smem = sum(b.bytes for b in buffers)
    reg_limit = (s.consumer_regs or limits.max_registers_per_thread) if hopper else None
    layout = finish(spec, "graph model (no template)", limits, buffers, smem, registers, threads, 1, reg_limit,
                     stages=S, generated=False)
    if hopper and s.producer_regs and s.consumer_regs:
        over = setmaxnreg_refusal(limits, s.producer_warpgroups, s.producer_regs, s.consumer_warpgroups,
                                  s.consumer_regs)
        require(not over, spec, "warpgroups", over)
    return layout


def mma_divisibility(spec: KernelSpec) -> None:
    """The graph model's MMA shape rules: m16n8k16 (k8 for tf32) in whole steps; wgmma 64 rows
    per consumer warpgroup."""
    p, s = spec.problem, spec.schedule
    k = 8 if p.dtype is DType.FP32 else 16
    if p.head_dim_qk % k or p.head_dim_v % 8:
        refuse(spec, "head_dim", f"head dim qk {p.head_dim_qk} / v {p.head_dim_v} is not a whole number of MMA "
                f"steps (qk must divide by {k}, v by 8)", f"use a head dim that is a multiple of {k}")
    if spec.family is Family.HOPPER:
        rows = WGMMA_ROWS * max(s.consumer_warpgroups, 1)
        require(s.tile_q % rows == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of {rows} "
                 f"({WGMMA_ROWS} rows per consumer warpgroup for wgmma)", f"use tile q = {rows} or a multiple")
        cols, key = s.tile_kv, "tile"
    elif s.warp_axis is Axis.Q:
        require(s.tile_q % s.warps == 0 and (s.tile_q // s.warps) % 16 == 0, spec, "warps",
                 f"{s.warps} warps along q give {s.tile_q / s.warps:g} rows each; mma.sync needs a multiple of 16",
                 f"use tile q = {16 * s.warps} or a multiple")
        cols, key = s.tile_kv, "tile"
    else:
        require(s.tile_q % 16 == 0, spec, "tile", f"tile q = {s.tile_q} is not a multiple of 16 (mma.sync rows)",
                 "use a multiple of 16")
        require(s.tile_kv % s.warps == 0, spec, "warps",
                f"{s.warps} warps along kv do not divide tile kv = {s.tile_kv}")
        cols, key = s.tile_kv // s.warps, "warps"
    require(cols % k == 0, spec, key, f"each warp's kv columns ({cols}) are not a multiple of {k} "
             "(the k step of the P V MMA)",
             f"use tile kv = a multiple of {k * (s.warps if s.warp_axis is Axis.KV else 1)}")
