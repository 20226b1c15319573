"""The warp-specialized backward's layout (templates/backward_ws.cu.j2): one block per (kv tile, batch * kv
head) of a producer warpgroup and two consumer warpgroups.

The producer's warp 0 issues the TMA copies (K and V once, Q, dO, LSE and D per q tile into a ring of
`stages` slots); its other warps are the dQ writer (WRITER_WARPS), which adds each q tile's staged dQ_i to
dQ_accum. The consumers hold dK and dV in wgmma accumulators for the whole q loop, and share the kv tile
one of two ways:

    keys      tile kv = 128: each consumer owns 64 keys (S^T, dP^T, dK, dV of its rows; dV += P^T dO and
              dK += dS^T Q with P^T, dS^T in registers); dQ_i = dS K splits by query rows (tile q 128) or by
              head-dim columns (tile q 64, head dim a multiple of 128)
    columns   tile kv = 64: both consumers see the same 64 keys; each computes S^T and dP^T for half the
              query columns, P^T and dS^T meet in shared memory, and dK, dV, dQ_i split by head-dim columns
              (whole 64-column panels each): head dims 256 fit, since dK and dV hold half the columns

dQ_i leaves a consumer one of two ways: staged in fp32 shared memory for the writer (boxes of 32 columns x
tile q rows, 128-byte swizzled: the TMA reduce-add's box, also read by the writer's red.global.add.v4), or,
where no staging buffer fits beside the ring (`dq accumulate atomic` only), added from the consumers'
registers by red.global.add.v4. Sizes here are the ones the lowering writes and the runtime launches with."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..device_limits import H200, DeviceLimits, consumer_regs_fit, entry_registers, setmaxnreg_refusal
from ..hw import MBARRIER_BYTES, PANEL_COLUMNS, PANEL_ROW_BYTES, SWIZZLE_ATOM, WARP_THREADS, WARPGROUP_THREADS, \
    WGMMA_ROWS
from ..mods.expr import depends_on_score, derivative
from ..mods.model import MASK_MODS, SCORE_MODS
from ..spec import DqAccumulate, KernelSpec
from .base import REGISTER_OVERHEAD, TEMPLATE_DTYPES, Buffer, Layout, Registers, align, finish, require

WS_CONSUMERS = 2               # consumer warpgroups: the kv tile's two halves (keys) or the head dim's (columns)
WS_PRODUCER_MIN_REGS = 24      # setmaxnreg's floor; the copy thread and the dQ writer need little
STAGING_BOX_COLUMNS = PANEL_ROW_BYTES // 4   # fp32 columns of one staged dQ_i box: one 128-byte swizzled row
DQ_STAGING_MAX = 2             # staged dQ_i buffers: the consumers write step s+1's while the writer drains s's
# warps of the producer warpgroup that add staged dQ_i (warp 0 issues the copies): one thread issues the TMA
# reduce-adds; red.global.add.v4 takes a 16-byte chunk per lane, so three warps share a tile's chunks
WRITER_WARPS = {"writer_tma": 1, "writer_red": 3}
WS_DQ_MODES = (DqAccumulate.ATOMIC, DqAccumulate.TMA_REDUCE, DqAccumulate.ORDERED)
# The modifications the warp-specialized backward spells (mods/model.py's field names): softcap's and ALiBi's
# scores recomputed as the forward's (dS through softcap's 1 - tanh^2), sinks' gradient by a kernel of its own;
# documents and prefix(n) narrow a block's q tiles and mask its partial ones (templates/backward_mask_mods.cuh);
# blocks(...) walks only the steps block_mask keeps (templates/block_mask.cuh); score_mod is the forward's tree
# (lower/expressions.py) with dS through its derivative, mask_mod skips the steps its box shows empty in every role
# and tests the elements of partial ones. softcap with ALiBi: softcap's 1 - tanh^2 is read back from P with ALiBi's
# bias taken out again. dropout redraws the forward's keep bits (templates/dropout.cuh).
WS_BUILT_MODS = SCORE_MODS + MASK_MODS + ("blocks", "score_mod", "mask_mod", "dropout")
# mask = blocks(...): the (query head of the GQA group, q tile) steps one kv tile may walk, one bit each in shared
# memory (a bit set where block_mask's entry is nonzero)
STEP_BITS = 4096


@dataclass(frozen=True)
class WsBarrier:
    """One barrier of the kernel: an mbarrier (`copies` of it, one per ring slot) or the consumers' named
    barrier; `count` arrivals complete a phase, together with `tx_bytes` of TMA copies on full barriers."""
    name: str
    kind: str                  # "mbarrier" | "named"
    count: int
    tx_bytes: int
    copies: int
    arrive_role: str
    wait_role: str
    what: str


@dataclass(frozen=True)
class BackwardWsLayout:
    main: Layout
    split: str                 # "keys" | "columns" (module docstring)
    dq_split: str              # dQ_i between the consumers: "m" (query rows) | "n" (head-dim columns)
    dq_path: str               # "writer_tma" | "writer_red" (staged) | "consumer_red" (from registers)
    staging: int               # staged dQ_i buffers (0: consumer_red)
    roles: dict                # role -> {"warpgroups", "threads", "registers"} (explain's role lines)
    role_registers: dict       # role -> tuple[Registers]: the per-role estimate against its setmaxnreg
    role_peaks: dict           # role -> registers live at its peak (what must fit its setmaxnreg)
    barriers: tuple[WsBarrier, ...]
    dq_kernel: tuple = ()      # (the mma.sync module's `separate` dQ kernel: none here)
    dq_kernel_smem: int = 0
    dq_kernel_threads: int = 0
    notes: tuple[str, ...] = field(default=())

    def barrier(self, name: str) -> WsBarrier:
        return next(b for b in self.barriers if b.name == name)


def ws_has_template(spec: KernelSpec) -> str:
    """Why the warp-specialized template can't build `spec`'s backward ("" when it can)."""
    b, p = spec.backward, spec.problem
    if p.dtype not in TEMPLATE_DTYPES:
        return f"the warp-specialized backward computes in fp16 or bf16, not {p.dtype.value}"
    why = ws_mods_refusal(p.mods)
    if why:
        return why
    if b.dq not in WS_DQ_MODES:
        return (f"the warp-specialized backward sums dQ as {', '.join(m.value for m in WS_DQ_MODES)}, not "
                f"`dq accumulate {b.dq.value}`")
    return ws_ordered_refusal(p.mods) if b.dq is DqAccumulate.ORDERED else ""


def ws_ordered_refusal(mods) -> str:
    """Why ordered (deterministic) dQ can't take these modifications ("" when it can). Documents start each q tile's
    semaphore past every kv tile before its first document, while blocks(...) count a writer's turn over the
    block-visible kv tiles only: together the two counts disagree and a writer would wait for a turn that never
    comes."""
    if mods.document is not None and mods.blocks is not None:
        return ("the warp-specialized backward's deterministic dQ takes documents or blocks(...), not both yet "
                "(deterministic=False takes both)")
    return ""


def ws_mods_refusal(mods) -> str:
    """Why the warp-specialized backward can't take these score and mask modifications ("" when it can)."""
    missing = [key for key in mods.config() if key not in WS_BUILT_MODS]
    if missing:
        return (f"the warp-specialized backward has no template for the modifications {', '.join(missing)} yet "
                f"(it spells {', '.join(k for k in WS_BUILT_MODS if k != 'softcap_via')})")
    if mods.score_mod is not None and mods.softcap is not None:
        return ("the warp-specialized backward takes softcap or a score_mod, not both (softcap's 1 - tanh^2 is read "
                "back from P, which the score_mod changes): write the cap in the score_mod, "
                "`score_mod = 30 * tanh(score / 30) + ...`")
    if mods.mask_mod is not None:
        others = [name for name, on in (("document", mods.document is not None), ("prefix", mods.prefix is not None),
                                         ("blocks", mods.blocks is not None)) if on]
        if others:
            return (f"the warp-specialized backward takes a mask_mod without {' or '.join(others)} (write the whole "
                    "mask as the mask_mod)")
    if mods.dropout is not None and (mods.score_mod is not None or mods.mask_mod is not None):
        # each was built and GPU-tested beside the other modifications, not beside each other
        return "the warp-specialized backward takes dropout or an expression (score_mod, mask_mod), not both yet"
    return ""


def require_tiles_nest(spec: KernelSpec) -> None:
    """mask = blocks(q = N, kv = M): the backward's tiles divide the blocks, so a step is computed whole or skipped
    whole (no score needs a per-element test for the blocks)."""
    (block_q, block_kv), b = spec.problem.mods.blocks, spec.backward
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    require(block_q % b.tile_q == 0 and block_kv % b.tile_kv == 0, spec, tile_key,
            f"blocks(q = {block_q}, kv = {block_kv}): the backward's tiles (q {b.tile_q}, kv {b.tile_kv}) must divide "
            "the blocks, so that every tile lies in one block",
            f"blocks whose q size is a multiple of {b.tile_q} and kv size a multiple of {b.tile_kv}")


def gradient_reads_score(mods) -> bool:
    """Whether score_mod's derivative reads the score: the consumers then evaluate it at score_mod's step and hold
    it until dS (templates/backward_expression_grads.cuh)."""
    return mods.score_mod is not None and depends_on_score(derivative(mods.score_mod))


def ws_split(tile_kv: int) -> str:
    """How the consumers share a kv tile: "keys" (64 each) or "columns" (the same 64 keys)."""
    return "keys" if tile_kv == WGMMA_ROWS * WS_CONSUMERS else "columns"


def backward_ws_layout(spec: KernelSpec, limits: DeviceLimits = H200) -> BackwardWsLayout:
    """Shared memory, per-role registers and barriers of the warp-specialized backward; SpecError at the
    backward block's line when it does not fit."""
    b, p = spec.backward, spec.problem
    d, dv, Br, Bc, S = p.head_dim_qk, p.head_dim_v, b.tile_q, b.tile_kv, b.stages
    tile_key = "backward.tile" if spec.span_of("backward.tile") else "backward"
    wg_key = "backward.warpgroups"
    require(d % PANEL_COLUMNS == 0 and dv % PANEL_COLUMNS == 0, spec, "head_dim",
            f"the warp-specialized backward loads 64-column TMA panels: head dims must be multiples of 64, got "
            f"{d}/{dv}", "other head dims: the mma.sync backward (remove `warpgroups`)")
    require(b.consumer_warpgroups == WS_CONSUMERS and b.producer_warpgroups == 1, spec, wg_key,
            f"the warp-specialized backward runs producer 1, consumer {WS_CONSUMERS} (each consumer owns half the "
            f"kv tile's keys or half its head-dim columns), got producer {b.producer_warpgroups}, consumer "
            f"{b.consumer_warpgroups}", f"warpgroups producer 1 regs 24, consumer {WS_CONSUMERS} regs 240")
    require(b.producer_regs >= WS_PRODUCER_MIN_REGS, spec, wg_key,
            f"producer regs {b.producer_regs}: setmaxnreg takes at least {WS_PRODUCER_MIN_REGS}")
    over = setmaxnreg_refusal(limits, 1, b.producer_regs, WS_CONSUMERS, b.consumer_regs)
    require(not over, spec, wg_key, over, f"warpgroups producer 1 regs {WS_PRODUCER_MIN_REGS}, consumer "
            f"{WS_CONSUMERS} regs {consumer_regs_fit(limits, 1, WS_PRODUCER_MIN_REGS, WS_CONSUMERS)}")
    require(Bc in (WGMMA_ROWS, WGMMA_ROWS * WS_CONSUMERS), spec, tile_key,
            f"tile kv = {Bc}: the consumers own 64 keys each (tile kv = 128) or share 64 keys by head-dim columns "
            "(tile kv = 64)", "tile kv = 128 (head dims up to 128) or 64 (head dim 256)")
    split = ws_split(Bc)
    if split == "keys":
        require(Br in (WGMMA_ROWS, 2 * WGMMA_ROWS), spec, tile_key,
                f"tile q = {Br}: S^T's columns and dQ_i's rows are 64 or 128 query rows", "tile q = 64 or 128")
        dq_split = "m" if Br == 2 * WGMMA_ROWS else "n"
        require(dq_split == "m" or d % (2 * PANEL_COLUMNS) == 0, spec, tile_key,
                f"tile q = 64 at head dim {d}: dQ_i splits between the consumers by whole 64-column panels of K, "
                f"and {d} has {d // PANEL_COLUMNS}", "tile q = 128 (dQ_i split by query rows)")
    else:
        require(Br == WGMMA_ROWS, spec, tile_key,
                f"tile q = {Br}: with tile kv = 64 the consumers split one 64-column panel of P^T and dS^T",
                "tile q = 64")
        require(d % (2 * PANEL_COLUMNS) == 0 and dv % (2 * PANEL_COLUMNS) == 0, spec, "head_dim",
                f"tile kv = 64 splits dK, dV and dQ_i into whole 64-column panels per consumer: head dims must be "
                f"multiples of 128, got {d}/{dv}", "tile kv = 128 for head dims up to 128")
        dq_split = "n"

    buffers: list[Buffer] = []
    end = 0

    def add(name, nbytes, copies=1, formula="", layout="wgmma 64-col panels", alignment=SWIZZLE_ATOM):
        nonlocal end
        end = align(end, alignment)
        buffers.append(Buffer(name, end, nbytes * copies, alignment, copies, nbytes if copies > 1 else 0, layout,
                              formula))
        end += nbytes * copies
    add("K", Bc * d * 2, formula=f"Bc*d*2 = {Bc}*{d}*2 (kept for the whole q loop)")
    add("V", Bc * dv * 2, formula=f"Bc*dv*2 = {Bc}*{dv}*2 (kept for the whole q loop)")
    add("Q", Br * d * 2, S, f"{S}x Br*d*2 = {S}x {Br}*{d}*2")
    add("dO", Br * dv * 2, S, f"{S}x Br*dv*2 = {S}x {Br}*{dv}*2")
    if split == "columns":
        add("P^T", Bc * Br * 2, 2, f"2x Bc*Br*2 = 2x {Bc}*{Br}*2 (A of dV += P^T dO; two: a consumer writes step "
            "s+1's while the other may still read step s's)")
    add("dS^T", Bc * Br * 2, 2, f"2x Bc*Br*2 = 2x {Bc}*{Br}*2 (A of dK += dS^T Q and, read MN-major, of dQ_i = dS K)")
    add("LSE", Br * 4, S, f"{S}x Br*4", "fp32 (padded rows: +inf)", 16)
    add("D", Br * 4, S, f"{S}x Br*4", "fp32 (padded rows: 0)", 16)
    if p.mods.blocks is not None:
        require_tiles_nest(spec)
    if p.mods.blocks is not None or p.mods.mask_mod is not None:
        what = "block-sparse" if p.mods.blocks is not None else "mask_mod's"
        require(S <= 3, spec, "backward.pipeline", f"{S} stages: {what} steps are named per ring slot in the "
                "step bits' 16-byte header (at most 3 slots)", "pipeline 2 stages via tma")
        add("step bits", 16 + STEP_BITS // 8, formula=f"16 B count + {STEP_BITS} bits: (query head, q tile) steps "
            + ("with a nonzero block" if p.mods.blocks is not None else "mask_mod can show a key of"),
            layout="u32 words", alignment=16)
    before_staging = end
    stage_bytes = Br * d * 4
    barrier_bytes = lambda staging: MBARRIER_BYTES * (1 + 2 * S + 2 * staging)   # noqa: E731
    fits = lambda staging: align(before_staging, SWIZZLE_ATOM) + staging * stage_bytes + barrier_bytes(staging) \
        <= limits.max_shared_per_block   # noqa: E731
    staging = next((n for n in range(DQ_STAGING_MAX, 0, -1) if fits(n)), 0)
    if b.dq is not DqAccumulate.ATOMIC:
        require(staging > 0, spec, "backward.dq",
                f"`dq accumulate {b.dq.value}` stages dQ_i ({stage_bytes} B) in shared memory, and with "
                f"{S} stage(s) it does not fit beside the ring ({before_staging} B)",
                "use `pipeline 1 stage via tma`, or `dq accumulate atomic` (added from registers)")
    if staging:
        add("dQ_i staging", stage_bytes, staging, f"{staging}x Br*d*4 = {staging}x {Br}*{d}*4 (boxes of "
            f"{STAGING_BOX_COLUMNS} fp32 columns, 128 B swizzle: the TMA reduce box)", "fp32 boxes")
    bars = 1 + 2 * S + 2 * staging
    add("mbarriers", MBARRIER_BYTES * bars, formula=f"{bars} x {MBARRIER_BYTES} (kv full; Q ring full/empty x {S}"
        + (f"; dQ_i full/empty x {staging}" if staging else "") + ")", layout="", alignment=MBARRIER_BYTES)
    smem = end
    require(smem <= limits.max_shared_per_block, spec, "backward.pipeline" if S > 1 else tile_key,
            f"shared memory: {smem} bytes needed (" + " + ".join(f"{x.name} {x.bytes}" for x in buffers)
            + f") > {limits.max_shared_per_block} available", "use fewer stages or a smaller tile q")
    dq_path = ("writer_tma" if b.dq is not DqAccumulate.ATOMIC else "writer_red") if staging else "consumer_red"

    cols = 1 if split == "keys" else 2   # a consumer's share of dK, dV columns and of S^T's query columns
    dq_cols = d if dq_split == "m" else d // 2
    consumer = [Registers("dK accumulator", d // 2 // cols, f"64 x d/{cols} over a warpgroup: d/{2 * cols}", True),
                Registers("dV accumulator", dv // 2 // cols, f"dv/{2 * cols}", True),
                Registers("S^T/P^T", Br // 2 // cols, f"64 x Br/{cols}: Br/{2 * cols}", True),
                Registers("dP^T/dS^T", Br // 2 // cols, f"Br/{2 * cols}", True),
                # held beside S^T and dP^T inside the allowance below, as ptxas allocates them (no spills at d128
                # tile q 64: tests/test_backward_expressions_cpu.py compiles it)
                *([Registers("dS^T factors", Br // 4 // cols, f"Br/{4 * cols}: score_mod' as bf16 pairs")]
                  if gradient_reads_score(p.mods) else []),
                Registers("dQ_i accumulator", dq_cols // 2, f"64 x {dq_cols}: {dq_cols}/2 (after S^T, dP^T die)"),
                Registers("addresses, indices", REGISTER_OVERHEAD, "allowance (ptxas ballpark)", True)]
    live = sum(r.amount for r in consumer if r.accumulator)
    scores = sum(r.amount for r in consumer if r.name.startswith(("S^T", "dP^T", "dS^T")))   # dead once dQ_i is made
    live = max(live, live - scores + next(r.amount for r in consumer if r.name == "dQ_i accumulator"))
    require(live <= b.consumer_regs, spec, wg_key,
            f"registers: ~{live} per consumer thread at the peak (" + " + ".join(
                f"{r.name} {r.amount}" for r in consumer if r.accumulator) + f") > consumer regs {b.consumer_regs}",
            "use tile q = 64, or tile kv = 64 (dK, dV split by columns)")
    producer = [Registers("copy thread, dQ writer", WS_PRODUCER_MIN_REGS, "loop state and addresses")]
    threads = WARPGROUP_THREADS * (1 + WS_CONSUMERS)
    main = finish(spec, "backward_ws", limits, buffers, smem, consumer, threads, 1, b.consumer_regs,
                  launch_registers=entry_registers(limits, threads), stages=S, rows_per_warp=16, tile_kv=Bc)
    q_tx = (Br * d + Br * dv) * 2 + 2 * Br * 4   # Q_i, dO_i, LSE_i, D_i of one slot
    consumer_warps = WS_CONSUMERS * WARPGROUP_THREADS // WARP_THREADS
    barriers = [
        WsBarrier("kv_full", "mbarrier", 1, buffers[0].bytes + buffers[1].bytes, 1, "producer", "consumer",
                  "K_j and V_j have landed (once per block)"),
        WsBarrier("q_full", "mbarrier", 1, q_tx, S, "producer", "consumer",
                  "Q_i, dO_i, LSE_i and D_i of a ring slot have landed"),
        WsBarrier("q_empty", "mbarrier", consumer_warps, 0, S, "consumer", "producer",
                  "every consumer warp is done with the slot (one arrival per warp)"),
        WsBarrier("ds_ready", "named", WS_CONSUMERS * WARPGROUP_THREADS, 0, 1, "consumer", "consumer",
                  "both consumers' " + ("P^T and dS^T" if split == "columns" else "dS^T") + " are in shared memory"),
    ]
    if staging:
        barriers += [
            WsBarrier("dq_full", "mbarrier", WS_CONSUMERS * WARPGROUP_THREADS, 0, staging, "consumer", "writer",
                      "every consumer thread has staged its part of dQ_i"),
            WsBarrier("dq_empty", "mbarrier", WARP_THREADS * WRITER_WARPS[dq_path], 0, staging, "writer", "consumer",
                      "the writer has read the staged dQ_i (its reduce-add's reads are done)")]
    roles = {"producer": {"warpgroups": 1, "threads": WARPGROUP_THREADS, "registers": b.producer_regs},
             "consumer": {"warpgroups": WS_CONSUMERS, "threads": WS_CONSUMERS * WARPGROUP_THREADS,
                          "registers": b.consumer_regs}}
    if staging:   # warps of the producer warpgroup, under its setmaxnreg
        roles["writer"] = {"warpgroups": 0, "threads": WARP_THREADS * WRITER_WARPS[dq_path],
                           "registers": b.producer_regs}
    return BackwardWsLayout(main, split, dq_split, dq_path, staging, roles,
                            {"producer": tuple(producer), "consumer": tuple(consumer)},
                            {"producer": WS_PRODUCER_MIN_REGS, "consumer": live}, tuple(barriers))
