"""The warp-specialized hopper family's layout: Q, K, V as TMA panels in a ring, O's own panels where they
fit (else staged in Q's), the mbarriers, and a consumer's register budget."""
from __future__ import annotations

from dataclasses import replace

from ..device_limits import DeviceLimits, entry_registers, setmaxnreg_refusal
from ..hw import MBARRIER_BYTES, PANEL_COLUMNS, SWIZZLE_ATOM, TMA_BOX_MAX, WARPGROUP_THREADS, WGMMA_ROWS
from ..spec import KernelSpec, LaunchKind
from .base import Buffer, Layout, Registers, buffers_end, finish, qkv_buffers, require

HOPPER_CONSUMER_OVERHEAD = 16   # a consumer keeps loop state and barrier addresses; the producer computes the copies
WORK_ITEM_BYTES = 8             # launch dynamic: the shared slot through which the producer names the next item
DOCUMENT_SPAN_BYTES = 8         # mask = document: the slot through which the producer hands over an item's keys
# mask = blocks(...): the most kv tiles one work item's list of visible tiles holds (2-byte entries after a
# 4-byte count, twice: the producer lists the next item's tiles while the consumers walk this one's)
LISTED_TILES = 2048
TILE_LIST_BYTES = 16 + 2 * LISTED_TILES


def hopper_barriers(stages: int, transposes_v: bool = False) -> int:
    """mbarriers of the hopper kernel: Q full and empty, then K and V full and empty per stage, and with FP8
    inputs V^T full per stage (the producer's transposing warps have written V's K-major copy)."""
    return 2 + (5 if transposes_v else 4) * stages


# FP8 wgmma reads both operands K-major from shared memory in swizzled rows of 128 bytes, or of 64 where an
# operand's K extent is 64 bytes (head dim 64; a kv tile of 64 keys in V^T). FP8_K_BYTES: one k32 step.
FP8_SWIZZLES = (128, 64)
FP8_K_BYTES = 32
FP8_TRANSPOSERS = 3   # producer warps 1..3 transpose V (warp 0's first lane issues the TMA copies)


def fp8_swizzle(row_bytes: int) -> int:
    """The swizzle width (bytes) of an FP8 operand whose K-major rows hold `row_bytes`; 0: none fits."""
    return next((w for w in FP8_SWIZZLES if row_bytes % w == 0 and (w == 128 or row_bytes == w)), 0)


def hopper_layout(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    if spec.problem.fp8:
        return hopper_fp8_layout(spec, limits)
    p, s = spec.problem, spec.schedule
    consumers = s.consumer_warpgroups
    require(p.head_dim_qk % PANEL_COLUMNS == 0 and p.head_dim_v % PANEL_COLUMNS == 0 and p.head_dim_v <= p.head_dim_qk,
             spec, "head_dim", f"the hopper family loads 64-column TMA panels and stages O in Q's: head dims must be "
             f"multiples of 64 with head_dim_v <= head_dim, got {p.head_dim_qk}/{p.head_dim_v}",
             "head_dim = 64, 128 or 256; other head dims: the fa2 family")
    require(16 <= s.tile_kv <= TMA_BOX_MAX and s.tile_kv % 16 == 0, spec, "tile",
             f"tile kv = {s.tile_kv}: a TMA box and a wgmma n hold at most {TMA_BOX_MAX} keys, in steps of 16",
             "tile kv = 64, 128 or 176")
    require(s.tile_q == WGMMA_ROWS * consumers and s.tile_q <= TMA_BOX_MAX, spec, "tile",
             f"tile q = {s.tile_q}: each of the {consumers} consumer warpgroups owns {WGMMA_ROWS} query rows, and Q's "
             f"TMA box holds at most {TMA_BOX_MAX}", f"use tile q = {WGMMA_ROWS * consumers}")
    over = setmaxnreg_refusal(limits, s.producer_warpgroups, s.producer_regs, consumers, s.consumer_regs)
    require(not over, spec, "warpgroups", over)
    threads = WARPGROUP_THREADS * (s.producer_warpgroups + consumers)
    buffers = qkv_buffers(spec, s.tile_q, s.tile_kv, s.stages, p.head_dim_qk * 2, p.head_dim_v * 2, SWIZZLE_ATOM,
                           panels=True)
    kv_end = buffers_end(buffers, SWIZZLE_ATOM)
    barriers = hopper_barriers(s.stages)
    barrier_bytes = MBARRIER_BYTES * barriers
    o_bytes = s.tile_q * p.head_dim_v * 2
    # O gets its own panels when they fit, so the producer can load the next item's Q while the
    # consumers store this one's O (persistent launch); else O is staged in Q's (dv <= d).
    lists = 2 * TILE_LIST_BYTES + 16 if p.mods.blocks is not None else 0   # the kv tile lists, aligned
    o_in_q = kv_end + o_bytes + barrier_bytes + lists > limits.max_shared_per_block
    o_offset = 0 if o_in_q else kv_end
    buffers.append(Buffer("O staging", o_offset, o_bytes, SWIZZLE_ATOM, layout=f"wgmma {PANEL_COLUMNS}-col panels",
                          formula=f"Br*dv*2 = {s.tile_q}*{p.head_dim_v}*2", reuses="Q" if o_in_q else ""))
    bar_offset = kv_end if o_in_q else kv_end + o_bytes
    buffers.append(Buffer("mbarriers", bar_offset, barrier_bytes, MBARRIER_BYTES,
                          formula=f"{barriers} x {MBARRIER_BYTES} (Q full/empty; K, V full/empty x {s.stages})"))
    smem = bar_offset + barrier_bytes
    if s.launch is LaunchKind.DYNAMIC:
        # The producer takes each work item from a global counter and hands its index to the
        # consumers here, published by Q's full barrier.
        buffers.append(Buffer("work item", smem, WORK_ITEM_BYTES, MBARRIER_BYTES,
                              formula="one int32 item index (8-byte slot)"))
        smem += WORK_ITEM_BYTES
    if p.mods.document is not None:
        # The producer's search of document_ids gives an item's keys [start, end); the consumers read them
        # here, published by Q's full barrier.
        buffers.append(Buffer("document span", smem, DOCUMENT_SPAN_BYTES, MBARRIER_BYTES,
                              formula="two int32 key positions (start, end)"))
        smem += DOCUMENT_SPAN_BYTES
    if p.mods.blocks is not None:
        require_tiles_nest(spec)
        # The producer lists each item's visible kv tiles here (block_mask's row), published by Q's full barrier;
        # two lists, so the next item's is written while the consumers read this one's.
        smem = -(-smem // 16) * 16
        buffers.append(Buffer("kv tile lists", smem, 2 * TILE_LIST_BYTES, 16, stages=2, stage_bytes=TILE_LIST_BYTES,
                              formula=f"2 x (16 B count + {LISTED_TILES} x 2-byte kv tile)"))
        smem += 2 * TILE_LIST_BYTES
    # A consumer holds O and S, and under intra overlap tile j-1's P fragments while S_j is computed
    # (P V of j-1 is in flight). Without it P is packed from S after S's last use: S's registers.
    p_fragments = [Registers("P fragments", s.tile_kv // 4, f"Bc/4 = {s.tile_kv}/4", True)] if s.intra_overlap else []
    registers = [Registers("O accumulator", p.head_dim_v // 2, f"dv/2 = {p.head_dim_v}/2", True),
                 Registers("S/P accumulator", s.tile_kv // 2, f"Bc/2 = {s.tile_kv}/2", True), *p_fragments,
                 Registers("loop state, barriers", HOPPER_CONSUMER_OVERHEAD, "allowance (consumer)", True)]
    return finish(spec, "hopper", limits, buffers, smem, registers, threads, 1, s.consumer_regs,
                  launch_registers=entry_registers(limits, threads),
                  stages=s.stages, rows_per_warp=16, keys_per_warp=s.tile_kv)


def require_tiles_nest(spec: KernelSpec) -> None:
    """mask = blocks(q = N, kv = M): the kernel's tiles divide the blocks, so each q tile lies in one row of
    block_mask and each kv tile in one of its blocks (a tile is computed whole or skipped whole, and no score
    needs a per-element test for the blocks)."""
    (block_q, block_kv), s = spec.problem.mods.blocks, spec.schedule
    require(block_q % s.tile_q == 0 and block_kv % s.tile_kv == 0, spec, "mask",
            f"blocks(q = {block_q}, kv = {block_kv}): the hopper kernel's tiles (q {s.tile_q}, kv {s.tile_kv}) must "
            "divide the blocks, so that every tile lies in one block",
            f"blocks whose q size is a multiple of {s.tile_q} and kv size a multiple of {s.tile_kv}, or a `tile` "
            "that divides them")
    # Both pick the kv tiles an item walks (block_mask's list, mask_mod's interval test): one walk a kernel.
    require(spec.problem.mods.mask_mod is None, spec, "mask_mod",
            "mask_mod and blocks(...) together: the hopper kernel walks either block_mask's list of kv tiles or "
            "mask_mod's, not both", "fold the block structure into mask_mod, or drop mask_mod")


def hopper_fp8_layout(spec: KernelSpec, limits: DeviceLimits) -> Layout:
    """FP8 inputs (dtype = e4m3): Q, K and V land by TMA in swizzled K-major rows of bytes; the producer's
    transposing warps copy each V tile into V^T (rows of dv, keys along K), which FP8 wgmma needs as P V's B
    operand; O (16-bit) is staged in its own panels, as wide as Q's and K's bytes are narrow."""
    p, s = spec.problem, spec.schedule
    consumers = s.consumer_warpgroups
    d, dv, bc = p.head_dim_qk, p.head_dim_v, s.tile_kv
    require(fp8_swizzle(d) and fp8_swizzle(dv) and dv <= d, spec, "head_dim",
            f"FP8 wgmma reads rows of 64 or a multiple of 128 bytes: head dims 64, 128, 256 (head_dim_v <= head_dim), "
            f"got {d}/{dv}", "head_dim = 64, 128 or 256")
    require(bc <= TMA_BOX_MAX and fp8_swizzle(bc), spec, "tile",
            f"tile kv = {bc}: V^T's rows hold the tile's keys as bytes, 64 or a multiple of 128 (at most "
            f"{TMA_BOX_MAX}: a TMA box)", "tile kv = 64 or 128")
    require(s.tile_q == WGMMA_ROWS * consumers and s.tile_q <= TMA_BOX_MAX, spec, "tile",
            f"tile q = {s.tile_q}: each of the {consumers} consumer warpgroups owns {WGMMA_ROWS} query rows, and Q's "
            f"TMA box holds at most {TMA_BOX_MAX}", f"use tile q = {WGMMA_ROWS * consumers}")
    over = setmaxnreg_refusal(limits, s.producer_warpgroups, s.producer_regs, consumers, s.consumer_regs)
    require(not over, spec, "warpgroups", over)
    threads = WARPGROUP_THREADS * (s.producer_warpgroups + consumers)
    # V lands in a ring of its own that only the transposers read, each tile right as it lands: as deep as K's
    # where that fits, else one slot (the producer's next V copy then waits for the transpose of the last). A block
    # of one work item (`launch grid`) may stage O in K's ring instead of its own panels, where the ring holds
    # Br rows of dv 16-bit values: the two consumers meet before either writes it (ping-pong's turns would make
    # that meeting wait on a turn, so not there). The first of these that fits: the deeper landing ring first.
    k_ring_holds_o = s.launch is LaunchKind.GRID and not s.pingpong and s.stages * bc * d >= s.tile_q * dv * 2
    placements = (False, True) if k_ring_holds_o else (False,)
    for landing, in_k in [(landing, in_k) for landing in dict.fromkeys((s.stages, 1)) for in_k in placements]:
        buffers, smem = fp8_buffers(spec, landing, o_in_k=in_k)
        if smem <= limits.max_shared_per_block:
            break
    # Under intra overlap tile j-1's e4m3 P fragments (4 keys a register) live while S_j is computed.
    p_fragments = [Registers("P fragments", bc // 8, f"Bc/8 = {bc}/8", True)] if s.intra_overlap else []
    registers = [Registers("O accumulator", dv // 2, f"dv/2 = {dv}/2", True),
                 Registers("S/P accumulator", bc // 2, f"Bc/2 = {bc}/2", True), *p_fragments,
                 Registers("loop state, barriers", HOPPER_CONSUMER_OVERHEAD, "allowance (consumer)", True)]
    return finish(spec, "hopper", limits, buffers, smem, registers, threads, 1, s.consumer_regs,
                  launch_registers=entry_registers(limits, threads),
                  stages=s.stages, rows_per_warp=16, keys_per_warp=bc)


def fp8_buffers(spec: KernelSpec, v_landing: int, o_in_k: bool = False) -> tuple[list[Buffer], int]:
    """(the FP8 kernel's buffers, the shared memory they take) with V landing in `v_landing` slots: Q, the K and V
    rings, V^T's ring (as deep as K's), O's staging and the mbarriers. `o_in_k`: O is staged in K's ring, which a
    block of one work item reads no more once both consumers are past their last Q K^T."""
    p, s = spec.problem, spec.schedule
    d, dv, bc = p.head_dim_qk, p.head_dim_v, s.tile_kv
    buffers = qkv_buffers(spec, s.tile_q, bc, s.stages, d, dv, SWIZZLE_ATOM, panels=True, element_bytes=1)
    if v_landing != s.stages:
        v = buffers[2]
        buffers[2] = replace(v, bytes=v_landing * v.stage_bytes, stages=v_landing,
                             formula=f"{v_landing}x Bc*dv*1 = {v_landing}x {bc}*{dv}*1 (V lands; V^T holds the ring)")
    end = buffers_end(buffers, SWIZZLE_ATOM)
    vt_stage = dv * bc
    buffers.append(Buffer("V^T", end, s.stages * vt_stage, SWIZZLE_ATOM, s.stages, vt_stage,
                          f"K-major: dv rows of Bc key bytes, {fp8_swizzle(bc)} B swizzle",
                          f"{s.stages}x dv*Bc = {s.stages}x {dv}*{bc}"))
    end = buffers_end(buffers, SWIZZLE_ATOM)
    o_bytes = s.tile_q * dv * 2
    k = buffers[1]
    o_offset = k.offset if o_in_k else end
    buffers.append(Buffer("O staging", o_offset, o_bytes, SWIZZLE_ATOM, layout=f"wgmma {PANEL_COLUMNS}-col panels",
                          formula=f"Br*dv*2 = {s.tile_q}*{dv}*2", reuses="K" if o_in_k else ""))
    barriers = hopper_barriers(s.stages, transposes_v=True)
    bar_offset = end if o_in_k else end + o_bytes
    buffers.append(Buffer("mbarriers", bar_offset, MBARRIER_BYTES * barriers, MBARRIER_BYTES,
                          formula=f"{barriers} x {MBARRIER_BYTES} (Q full/empty; K, V full/empty, V^T full x "
                                  f"{s.stages})"))
    return buffers, bar_offset + MBARRIER_BYTES * barriers
