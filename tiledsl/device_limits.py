"""Limits of the target GPU, as plain data.

The legality pass checks a schedule's shared memory and register estimates against these
numbers, the split-KV heuristic reads the SM count, and explain prints them. H200 (sm_90) is
the default target; `read_device_limits()` asks a live device through CuPy when one is present,
so a kernel built on the GPU box is checked against what that GPU really reports.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .hw import WARPGROUP_THREADS


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    arch: str                       # e.g. "sm_90"
    max_shared_per_block: int       # bytes of dynamic shared memory one block may opt in to
    shared_per_sm: int              # bytes of shared memory per SM
    registers_per_sm: int           # 32-bit registers per SM
    max_registers_per_thread: int
    max_threads_per_block: int
    sm_count: int
    l2_bytes: int
    hbm_bytes_per_s: float = 0.0    # peak HBM bandwidth (0: unknown)
    dense_flops_per_s: float = 0.0  # peak dense 16-bit tensor-core FLOP/s (0: unknown)
    link_bytes_per_s: float = 0.0   # peak GPU-to-GPU bandwidth one way (NVLink; 0: unknown)
    warp_size: int = 32


# NVIDIA H200 SXM (Hopper, compute capability 9.0): 228 KB shared memory per SM of which 227 KB
# one block can opt in to, 64 K registers per SM, 132 SMs, 50 MB L2, 4.8 TB/s HBM3e,
# 989 TFLOP/s dense bf16; NVLink 4, 18 links: 900 GB/s both ways together, 450 GB/s each way.
H200 = DeviceLimits(
    name="NVIDIA H200",
    arch="sm_90",
    max_shared_per_block=227 * 1024,      # 232448
    shared_per_sm=228 * 1024,             # 233472
    registers_per_sm=65536,
    max_registers_per_thread=255,
    max_threads_per_block=1024,
    sm_count=132,
    l2_bytes=50 * 1024 * 1024,
    hbm_bytes_per_s=4.8e12,
    dense_flops_per_s=989e12,
    link_bytes_per_s=450e9,
)


REGISTER_GRANULE = 8            # registers are allocated per thread in multiples of 8
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED_PER_BLOCK = 1024  # the driver reserves 1 KB of shared memory per block on sm_8x/9x


def resident_blocks(limits: DeviceLimits, registers: int, threads: int, smem_bytes: int) -> tuple[int, str]:
    """(blocks of one kernel resident on an SM at once, the resource that limits it: registers,
    shared, threads or blocks). 0 when one block does not fit."""
    regs = -(-registers // REGISTER_GRANULE) * REGISTER_GRANULE
    by = {
        "registers": limits.registers_per_sm // max(regs * threads, 1),
        "shared": limits.shared_per_sm // (smem_bytes + SMEM_RESERVED_PER_BLOCK),
        "threads": MAX_THREADS_PER_SM // max(threads, 1),
        "blocks": MAX_BLOCKS_PER_SM,
    }
    limit = min(by, key=lambda k: (by[k], k != "registers"))
    return by[limit], limit


def entry_registers(limits: DeviceLimits, threads: int) -> int:
    """Registers per thread of a kernel launched under __launch_bounds__(threads, 1): what ptxas gives a
    setmaxnreg kernel at entry, and so the block's whole register pool (threads x this)."""
    return limits.registers_per_sm // threads // REGISTER_GRANULE * REGISTER_GRANULE


def register_ceiling(limits: DeviceLimits, threads: int, min_blocks: int = 1) -> int:
    """The most registers per thread ptxas may give a kernel under __launch_bounds__(threads, min_blocks): the
    SM's registers shared by min_blocks blocks, in whole allocation granules, at most the per-thread maximum."""
    per_thread = limits.registers_per_sm // max(threads * min_blocks, 1) // REGISTER_GRANULE * REGISTER_GRANULE
    return min(limits.max_registers_per_thread, per_thread)


def setmaxnreg_budget(limits: DeviceLimits, warpgroups: int) -> int:
    """The most that the setmaxnreg counts of a block's `warpgroups` warpgroups may add up to. setmaxnreg moves
    registers between the warps of one block through a per-block pool that holds what the block launched with
    (entry_registers per thread); an .inc that asks for more than the others released waits forever."""
    return warpgroups * entry_registers(limits, warpgroups * WARPGROUP_THREADS)


def consumer_regs_fit(limits: DeviceLimits, producers: int, producer_regs: int, consumers: int) -> int:
    """The most registers per consumer thread (a multiple of 8) that the budget holds beside the producers'."""
    spare = setmaxnreg_budget(limits, producers + consumers) - producers * producer_regs
    return spare // max(consumers, 1) // REGISTER_GRANULE * REGISTER_GRANULE


def setmaxnreg_refusal(limits: DeviceLimits, producers: int, producer_regs: int, consumers: int,
                       consumer_regs: int) -> str:
    """Why the warpgroups' setmaxnreg counts cannot all be granted ("" when they can)."""
    warpgroups = producers + consumers
    total, budget = producers * producer_regs + consumers * consumer_regs, setmaxnreg_budget(limits, warpgroups)
    if total <= budget:
        return ""
    threads = warpgroups * WARPGROUP_THREADS
    return (f"setmaxnreg: {producers} x {producer_regs} + {consumers} x {consumer_regs} = {total} registers per "
            f"thread of a warpgroup, but the block launches with {entry_registers(limits, threads)} per thread "
            f"({limits.registers_per_sm} per SM / {threads} threads) and its warpgroups share only those: "
            f"{warpgroups} x {entry_registers(limits, threads)} = {budget} (an .inc past them waits forever)")


def read_device_limits(device: int = 0) -> DeviceLimits | None:
    """The limits a live GPU reports through CuPy, or None when CuPy or a GPU is not there.

    Bandwidths and peak FLOP/s are not device attributes; they are kept from H200 when the
    device is an sm_90 part and left 0 (unknown) otherwise."""
    try:
        import cupy   # optional: only the GPU box has it
        props = cupy.cuda.runtime.getDeviceProperties(device)
    except Exception:   # no CuPy, no driver, no device: all mean "not present"
        return None
    arch = f"sm_{props['major']}{props['minor']}"
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    limits = DeviceLimits(
        name=name,
        arch=arch,
        max_shared_per_block=int(props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"])),
        shared_per_sm=int(props["sharedMemPerMultiprocessor"]),
        registers_per_sm=int(props["regsPerMultiprocessor"]),
        max_registers_per_thread=255,
        max_threads_per_block=int(props["maxThreadsPerBlock"]),
        sm_count=int(props["multiProcessorCount"]),
        l2_bytes=int(props["l2CacheSize"]),
    )
    if arch == H200.arch:
        limits = replace(limits, hbm_bytes_per_s=H200.hbm_bytes_per_s, dense_flops_per_s=H200.dense_flops_per_s,
                         link_bytes_per_s=H200.link_bytes_per_s)
    return limits


def current_limits(device: int = 0) -> DeviceLimits:
    """The live device's limits when there is one, else the H200 defaults."""
    return read_device_limits(device) or H200
