"""Lowering of the backward: a spec's `backward { }` schedule -> the plan of
templates/backward.cu.j2 (preprocess, kv-outer main kernel on mma.sync, and convert or the q-outer dQ
kernel), or with `mma wgmma` of templates/backward_wgmma.cu.j2 (the same preprocess and convert, the
main kernel on Hopper's warpgroup MMA: lower_backward_wgmma below).

Sizes come from layout.backward_layout; the main kernel's q-loop body is the backward graph's
(schedule/backward.py) ops in emission order, one LoopOp each (`stage_ds`, the dS^T store the dQ MMA
reads, is placed before mma_dq)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..device_limits import H200, DeviceLimits
from ..errors import SpecError
from .fa2_wgmma import WgmmaAsm
from ..schedule.backward import build_backward_graph
from ..layout.backward import (BACKWARD_DQ_TILE_KV, BACKWARD_DQ_VECTORS, BACKWARD_PRE_ROWS, BACKWARD_PRE_THREADS,
    backward_has_template, backward_wgmma_dq_stage_row_bytes, backward_wgmma_dv_schedule, backward_layout)
from ..layout.base import tile_row_bytes
from .backward_ws import lower_backward_ws
from .plan import (INDEX_ERRORS, BackwardWgmma, Constant, KernelPlan, Launch, LoopOp, Parameter, Region, SharedBuffer,
                   make_plan)
from .steps import (IN16, INT32S, OUT16, OUT32, graph_loop_body, parameters, smem_constants, softmax_constants,
                    spec_line, stride_lines, tile_row_constants)
from ..spec import DqAccumulate, Family, KernelSpec, Mma

TEMPLATE = "backward.cu.j2"
WGMMA_TEMPLATE = "backward_wgmma.cu.j2"
# Graph ops of the q loop that the template's `issue` (the Q_i, dO_i, LSE_i, D_i ring) covers.
_LOADS = {"load_q", "load_do", "load_lse_d"}
_TEXT = {
    "mma_qk": "S^T = K_j Q_i^T (transposed: P^T is then the A operand of dV)",
    "mask": "mask keys outside the sequence / diagonal / window and rows past q_len (only tiles that need it)",
    "recompute_p": "P^T = exp(scale S^T - LSE_i); 0 where LSE = -inf",
    "mma_dv": "dV += P^T dO_i",
    "mma_dp": "dP^T = V_j dO_i^T",
    "softmax_grad": "dS^T = P^T * (dP^T - D_i)",
    "mma_dk": "dK += dS^T Q_i   (scale at the store)",
    "stage_ds": "dS^T -> shared memory for dQ_i = dS K_j",
    "mma_dq": "dQ_i = dS K_j (this warp's rows and columns)",
    "accumulate": "dQ_accum += dQ_i (red.global.add.v4.f32 or .v2; scale at the convert)",
}


@dataclass(frozen=True)
class BackwardPlan(KernelPlan):
    kernel_names: dict = field(default_factory=dict)   # preprocess, main, convert | dq
    dq_mode: str = "atomic"                             # atomic | separate
    pre_rows: int = BACKWARD_PRE_ROWS
    pre_threads: int = BACKWARD_PRE_THREADS
    tile_kv: int = 0
    dq_launch: Launch | None = None                     # separate: the q-outer dQ kernel's launch
    wgmma_ops: tuple = ()                               # wgmma: the BackwardWgmma wrappers the template declares
    wgmma: dict = field(default_factory=dict)           # wgmma: role (s, dv, dk, dq) -> wrapper name
    dp_wait_note: str = ""                              # wgmma: what is in flight when dS^T starts
    kernel_class: str = ""                              # "module:Class" that launches it ("": BackwardKernel)

    @property
    def loop_bodies(self):
        return (("loop_q", self.loop_body),)


# The main kernel's parameters (mma.sync and wgmma: plan.parameters, the signature and the launch's order);
# the error word after kv_lens: the kernel bounds kv_lens (templates/index_bounds.cuh).
MAIN_PARAMETERS: tuple[tuple[Parameter, ...], ...] = (
    parameters(IN16, "q", "k", "v", "dout"),
    parameters("const float* __restrict__", "lse", "d_rows") + parameters(OUT32, "dq_accum"),
    parameters(OUT16, "dk", "dv") + parameters(INT32S, "kv_lens") + (INDEX_ERRORS,),
    parameters("int", "q_len", "kv_len", "heads", "kv_group"),
    *stride_lines("q", "k", "v", "do", "dk", "dv"))


def backward_kernel_name(spec: KernelSpec) -> str:
    """The backward module's name: the spec's kernel name (which names its backward schedule) + _backward."""
    return spec.kernel_name + "_backward"


def _loop_body(spec: KernelSpec, atomic: bool) -> tuple[LoopOp, ...]:
    def lower_op(name, op):
        kind = op.kind.value
        if kind in _LOADS:
            return []
        where = spec_line(spec, op.key or "backward")
        if kind == "mma_dq":
            return [LoopOp("stage_ds", where, _TEXT["stage_ds"]), LoopOp("mma_dq", where, _TEXT["mma_dq"])]
        if kind == "accumulate":
            return [LoopOp("accumulate_dq", where, _TEXT["accumulate"])]
        if kind in _TEXT:
            return [LoopOp(kind, where, _TEXT[kind])]
        raise AssertionError(f"backward lowering has no CUDA for graph op {name} ({kind})")

    body = graph_loop_body(build_backward_graph(spec), "loop_q", lower_op)
    kinds = [op.kind for op in body]
    assert not atomic or kinds.index("accumulate_dq") == kinds.index("mma_dq") + 1, kinds   # one CUDA scope
    return body


def ring_constants(buffers: dict, stages: int, ds_offset: int) -> list[Constant]:
    """Where the main kernel (either template) keeps K_j and V_j (once), the rings of Q_i, dO_i and the
    LSE_i, D_i rows (STAGES slots each), and dS^T: the layout's buffers. MAIN_SHARED names them."""
    return [
        Constant("STAGES", "int", stages, "Q_i, dO_i, LSE_i, D_i ring slots"),
        Constant("K_OFFSET", "u32", buffers["K"].offset),
        Constant("V_OFFSET", "u32", buffers["V"].offset),
        Constant("Q_OFFSET", "u32", buffers["Q"].offset),
        Constant("Q_STAGE_BYTES", "u32", buffers["Q"].bytes // stages),
        Constant("DO_OFFSET", "u32", buffers["dO"].offset),
        Constant("DO_STAGE_BYTES", "u32", buffers["dO"].bytes // stages),
        Constant("LSE_OFFSET", "u32", buffers["LSE"].offset),
        Constant("DROW_OFFSET", "u32", buffers["D"].offset),
        Constant("ROW_STAGE_BYTES", "u32", buffers["LSE"].bytes // stages),
        Constant("DS_OFFSET", "u32", ds_offset),
    ]


# The main kernel's shared memory in its typed view (ring_constants), and the separate dQ kernel's.
MAIN_SHARED = (SharedBuffer("k", "K_OFFSET"), SharedBuffer("v", "V_OFFSET"),
               SharedBuffer("q", "Q_OFFSET", "Q_STAGE_BYTES"), SharedBuffer("d_o", "DO_OFFSET", "DO_STAGE_BYTES"),
               SharedBuffer("lse", "LSE_OFFSET", "ROW_STAGE_BYTES"),
               SharedBuffer("d_rows", "DROW_OFFSET", "ROW_STAGE_BYTES"), SharedBuffer("ds", "DS_OFFSET"))
DQ_KERNEL_SHARED = (SharedBuffer("dq_q", "DQK_Q_OFFSET"), SharedBuffer("dq_d_o", "DQK_DO_OFFSET"),
                    SharedBuffer("dq_k", "DQK_K_OFFSET", "DQK_K_STAGE_BYTES"),
                    SharedBuffer("dq_v", "DQK_V_OFFSET", "DQK_V_STAGE_BYTES"))


def backward_regions(spec: KernelSpec, zeroed: str, main: str, kv_home: str) -> dict:
    """The regions both backward templates name: `zeroed` qualifies the preprocess's zeroing of dQ_accum,
    `main` is the main kernel's loop, `kv_home` where K_j and V_j stay."""
    b, w = spec.backward, lambda key: spec_line(spec, key)
    return {
        "preprocess": Region(w("backward"), f"D = rowsum(dO * O) (fp32), one warp per row; zero dQ_accum{zeroed}"),
        "main": Region(w("backward.order"), main),
        "q_range": Region(w("mask"),
                          "the q tiles that see this kv tile (bottom-right aligned masks; none past kv_lens)"),
        "load_kv": Region(w("backward.pipeline"),
                          f"K_j, V_j ({b.tile_kv} rows) -> {kv_home}, kept for the whole q loop"),
        "prologue": Region(w("backward.pipeline"), f"first {b.stages - 1} (Q_i, dO_i, LSE_i, D_i) in flight"),
        "q_loop": Region(w("backward.order"), "for each query head of the GQA group, for each visible q tile (serial)"),
        "store_dkv": Region(w("backward.tile"), "dK = scale * dK, dV -> global (every kv row < kv_len, zeros "
                            "included; NaN for a bad kv_lens entry)"),
        "convert": Region(w("backward.dq"), "dQ = scale * dQ_accum, fp32 -> dtype (NaN for a bad kv_lens entry)"),
    }


def lower_backward(spec: KernelSpec, dq_vector: int = BACKWARD_DQ_VECTORS[0], limits: DeviceLimits = H200,
                   **wgmma_options) -> BackwardPlan:
    """The plan of `spec`'s backward module on `limits`; SpecError at the backward line when no template
    builds it. `dq_vector`: fp32 values per dQ atomic (4 or 2; bench/backward_ab.py compares them)."""
    if dq_vector not in BACKWARD_DQ_VECTORS:
        raise ValueError(f"dq_vector must be one of {BACKWARD_DQ_VECTORS}, got {dq_vector}")
    why = backward_has_template(spec)
    if not why and spec.backward.warp_specialized:
        return lower_backward_ws(spec, backward_kernel_name(spec), limits, **wgmma_options)
    if not why and spec.backward.mma is Mma.WGMMA:
        return lower_backward_wgmma(spec, dq_vector, limits, **wgmma_options)
    if why:
        key = "backward.order" if "kv outer" in why else "backward.dq" if "wgmma" in why else \
            "backward.dq" if "dq" in why else "dtype" if "fp16" in why else "backward"
        raise SpecError(why, spec.span_of(key), spec.source_text, "`tiledsl explain` and tiledsl.reference.backward "
                        "take it; the template builds `order kv, q`, mma.sync, dq atomic or separate")
    p, b = spec.problem, spec.backward
    lay = backward_layout(spec, limits)
    main = lay.main
    atomic = b.dq is DqAccumulate.ATOMIC
    qk_row, qk_sw = tile_row_bytes(p.head_dim_qk)
    v_row, v_sw = tile_row_bytes(p.head_dim_v)
    ds_row, ds_sw = tile_row_bytes(b.tile_q)
    buf = {x.name: x for x in main.buffers}
    consts = [
        Constant("BR", "int", b.tile_q, "query rows per q tile (backward tile q)"),
        Constant("BC", "int", b.tile_kv, "keys per block (backward tile kv)"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("WARPS", "int", b.warps, "warps, split along kv"),
        Constant("THREADS", "int", main.threads),
        Constant("KV_ROWS_PER_WARP", "int", 16 * lay.kv_m_tiles),
        Constant("KV_M_TILES", "int", lay.kv_m_tiles, "16-row mma tiles of the kv tile per warp"),
        *tile_row_constants(qk_row, qk_sw, v_row, v_sw),
        Constant("DS_ROW_BYTES", "int", ds_row, "shared-memory row of dS^T"),
        Constant("DS_SWIZZLE", "bool", ds_sw),
        *ring_constants(buf, b.stages, buf["dS^T"].offset if atomic else 0),
        *smem_constants(main),
        Constant("DQ_M_TILES", "int", lay.dq_m_tiles, "dQ_i = dS K_j: 16-row tiles per warp"),
        Constant("DQ_ROW_GROUPS", "int", lay.dq_row_groups, "warps along dQ_i's rows"),
        Constant("DQ_COLS", "int", lay.dq_cols, "dQ_i columns per warp"),
        Constant("DQ_VECTOR", "int", dq_vector, "fp32 per dQ atomic (red.global.add.v4 / .v2)"),
        Constant("PRE_ROWS", "int", BACKWARD_PRE_ROWS, "preprocess / convert: q rows per block"),
        Constant("PRE_THREADS", "int", BACKWARD_PRE_THREADS),
        *softmax_constants(p),
    ]
    names = {"preprocess": f"{backward_kernel_name(spec)}_preprocess", "main": f"{backward_kernel_name(spec)}_main"}
    dq_launch = None
    if atomic:
        names["convert"] = f"{backward_kernel_name(spec)}_convert"
    else:
        names["dq"] = f"{backward_kernel_name(spec)}_dq"
        dq = {x.name: x for x in lay.dq_kernel}
        consts += [
            Constant("DQK_BC", "int", BACKWARD_DQ_TILE_KV, "dQ kernel: keys per kv tile"),
            Constant("DQK_THREADS", "int", lay.dq_kernel_threads, "dQ kernel: 16 query rows per warp"),
            Constant("DQ_THREADS", "int", lay.dq_kernel_threads),
            Constant("DQK_Q_OFFSET", "u32", dq["Q"].offset),
            Constant("DQK_DO_OFFSET", "u32", dq["dO"].offset),
            Constant("DQK_K_OFFSET", "u32", dq["K"].offset),
            Constant("DQK_K_STAGE_BYTES", "u32", dq["K"].bytes // b.stages),
            Constant("DQK_V_OFFSET", "u32", dq["V"].offset),
            Constant("DQK_V_STAGE_BYTES", "u32", dq["V"].bytes // b.stages),
            Constant("DQK_SMEM_BYTES", "u32", lay.dq_kernel_smem),
        ]
        dq_launch = Launch(threads=lay.dq_kernel_threads, smem_bytes=lay.dq_kernel_smem, tile_q=b.tile_q)
    regions = backward_regions(spec, " (atomic dQ)", "kv outer: one block per (kv tile, batch * kv head), dK and dV on "
                               "chip", "shared memory")
    regions["dq"] = Region(spec_line(spec, "backward.dq"), f"dq accumulate separate: one block per q tile, "
                           f"{BACKWARD_DQ_TILE_KV}-key tiles, dQ on chip")
    shared = MAIN_SHARED + (() if atomic else DQ_KERNEL_SHARED)
    return _make(spec, consts, regions, _loop_body(spec, atomic), main, names, atomic, dq_launch, b.tile_kv,
                 shared=shared)


def _make(spec, consts, regions, body, main, names, atomic, dq_launch, tile_kv, template=TEMPLATE,
          **extra) -> BackwardPlan:
    return make_plan(spec, Family.FA2, template, consts, regions, body,
                     Launch(threads=main.threads, smem_bytes=main.smem_bytes, tile_q=spec.backward.tile_q),
                     main.min_blocks_per_sm, main.register_estimate, kernel_name=backward_kernel_name(spec),
                     plan_class=BackwardPlan, kernel_names=names, dq_mode="atomic" if atomic else "separate",
                     tile_kv=tile_kv, dq_launch=dq_launch, parameters=MAIN_PARAMETERS, **extra)


# ---- wgmma (templates/backward_wgmma.cu.j2) -------------------------------------------------------

# The wgmma main kernel's q-loop orders: both S^T and dP^T are issued before P^T is computed (dP^T
# runs while the exps do). "early": dV's wgmma is issued next and runs while dS^T is computed
# (P^T's fragments live through it); "late": dV's and dK's are issued together after dS^T (fewer
# live registers: P^T's fp32 values die as its fragments are packed).
_WGMMA_ORDERS = {
    "early": ("mma_qk", "mma_dp", "mask", "recompute_p", "mma_dv", "softmax_grad", "mma_dk", "stage_ds", "mma_dq",
              "accumulate_dq"),
    "late": ("mma_qk", "mma_dp", "mask", "recompute_p", "softmax_grad", "mma_dv", "mma_dk", "stage_ds", "mma_dq",
             "accumulate_dq"),
}


def _wrappers(br: int, d: int, dv: int, dq_cols: int) -> tuple[tuple[BackwardWgmma, ...], dict]:
    """The wrappers (one per distinct instruction) and role -> name: s (S^T, dP^T: SS, K-major), dv / dk
    (RS, B MN-major), dq (SS, A = dS^T and B = K both MN-major)."""
    roles = {"s": (br, False, 0, 0), "dv": (dv, True, 0, 1), "dk": (d, True, 0, 1), "dq": (dq_cols, False, 1, 1)}
    wrappers, names = {}, {}
    for role, (n, regs, ta, tb) in roles.items():
        name = f"wgmma_{'rs' if regs else 'ss'}_n{n}" + ("_mn" if ta else "")
        wrappers[name] = BackwardWgmma(name, WgmmaAsm.sized(n, 5 if regs else 3), regs, ta, tb)
        names[role] = name
    return tuple(wrappers.values()), names


def lower_backward_wgmma(spec: KernelSpec, dq_vector: int, limits: DeviceLimits = H200, dv_order: str | None = None,
                         dv_waited: bool | None = None, dq_staged: bool | None = None) -> BackwardPlan:
    """`dv_order` ("early" | "late") and `dv_waited` (early only: dS^T waits for dV's wgmma too, so
    P^T's fragments die first): layout.backward_wgmma_dv_schedule's choice unless given (A/B).
    `dq_staged`: dQ_i goes through the layout's fp32 staging buffer and its atomics are issued, row-
    coalesced, after the next step's S^T, dP^T wgmmas (default: where the layout has the buffer); else
    each thread's accumulators are added straight from registers (dq_vector wide)."""
    p, b = spec.problem, spec.backward
    lay = backward_layout(spec, limits)
    staging = next((x for x in lay.main.buffers if x.name == "dQ_i staging"), None)
    dq_staged = staging is not None if dq_staged is None else dq_staged
    if dq_staged and staging is None:
        raise ValueError(f"dq_staged: the layout has no dQ_i staging buffer (dQ split {lay.dq_split})")
    chosen = backward_wgmma_dv_schedule(b.tile_q, p.head_dim_qk)
    dv_order = dv_order or chosen[0]
    dv_waited = chosen[1] if dv_waited is None else dv_waited
    if dv_order not in _WGMMA_ORDERS:
        raise ValueError(f"dv_order must be one of {sorted(_WGMMA_ORDERS)}, got {dv_order!r}")
    pending = 1 if dv_order == "early" and not dv_waited else 0
    main, split = lay.main, lay.dq_split
    buf = {x.name: x for x in main.buffers}
    d, bc = p.head_dim_qk, b.tile_kv
    panel = bc * 128   # bytes of one 64-column panel of a kv-tile operand (K, dS^T)
    dq_a, dq_b, dq_k16, dq_rows, dq_cols0 = {
        "m": (panel, 0, bc // 16, 64, 0),                      # each its 64 query rows: dS^T panel, all of K
        "n": (0, panel, bc // 16, 0, d // 2),                  # each half of dQ_i's columns: K panel
        "k": (64 * 128, 64 * 128, bc // 32, 0, 0),             # each its 64 keys: dS^T and K rows
    }[split]
    consts = [
        Constant("BR", "int", b.tile_q, "query rows per q tile (backward tile q)"),
        Constant("BC", "int", bc, "keys per block (backward tile kv): 64 per warpgroup"),
        Constant("D", "int", d, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("THREADS", "int", main.threads, "two warpgroups"),
        Constant("KV_M_TILES", "int", 1,
                 "16-row accumulator tiles per warp (backward_ops.j2): a warp's slice of 64 rows"),
        *ring_constants(buf, b.stages, buf["dS^T"].offset),
        *smem_constants(main),
        Constant("DQ_M_TILES", "int", 1, "16-row dQ_i tiles per warp (backward_ops.j2)"),
        Constant("DQ_COLS", "int", lay.dq_cols,
                 f"dQ_i = dS K_j split {split} (layout.backward_wgmma_dq_split): columns "
                 "per warpgroup"),
        Constant("DQ_K16", "int", dq_k16, "16-key steps of a warpgroup's dQ_i"),
        Constant("DQ_A_WARPGROUP_BYTES", "u32", dq_a, "where warpgroup 1's dS^T operand starts"),
        Constant("DQ_B_WARPGROUP_BYTES", "u32", dq_b, "where warpgroup 1's K operand starts"),
        Constant("DQ_WARPGROUP_ROWS", "int", dq_rows, "warpgroup 1's first row of dQ_i"),
        Constant("DQ_WARPGROUP_COLS", "int", dq_cols0, "warpgroup 1's first column of dQ_i"),
        Constant("DQ_BLOCK_BARRIER", "bool", split != "k", "dQ_i reads the other warpgroup's dS^T"),
        Constant("DQ_VECTOR", "int", dq_vector, "fp32 per dQ atomic from registers (red.global.add.v4 / .v2)"),
        Constant("DQ_STAGED", "bool", dq_staged, "dQ_i -> fp32 staging, atomics after the next step's S^T, dP^T issue"),
        Constant("DQ_STAGE_OFFSET", "u32", staging.offset if dq_staged else 0),
        Constant("DQ_STAGE_ROW_BYTES", "int", backward_wgmma_dq_stage_row_bytes(d),
                 "padded: conflict-free float2 stores"),
        Constant("DP_WAIT_PENDING", "int", pending, f"wgmma groups left in flight when dS^T starts (dV {dv_order}"
                 + (", waited" if dv_waited and dv_order == "early" else "") + ")"),
        Constant("PRE_ROWS", "int", BACKWARD_PRE_ROWS, "preprocess / convert: q rows per block"),
        Constant("PRE_THREADS", "int", BACKWARD_PRE_THREADS),
        *softmax_constants(p),
    ]
    names = {"preprocess": f"{backward_kernel_name(spec)}_preprocess", "main": f"{backward_kernel_name(spec)}_main",
             "convert": f"{backward_kernel_name(spec)}_convert"}
    dp_note = "dV still running" if pending else ("dV's wgmma waited for too" if dv_order == "early"
                                                   else "dV, dK are issued after it")
    regions = backward_regions(spec, "", "kv outer on wgmma: one block per (kv tile, batch * kv head), two "
                               "warpgroups of 64 keys, dK and dV in their accumulators", "shared memory panels")
    graph_body = _loop_body(spec, True)   # the backward graph's emission order: the layout's dV schedule
    assert tuple(op.kind for op in graph_body) == _WGMMA_ORDERS[chosen[0]], [op.kind for op in graph_body]
    body = {op.kind: op for op in graph_body}
    order = _WGMMA_ORDERS[dv_order]   # an A/B's other order (lower_backward's options) reorders the same ops
    ops, wgmma = _wrappers(b.tile_q, d, p.head_dim_v, lay.dq_cols)
    return _make(spec, consts, regions, [body[k] for k in order], main, names, True, None, bc,
                 template=WGMMA_TEMPLATE, wgmma_ops=ops, wgmma=wgmma, mma="wgmma", dp_wait_note=dp_note,
                 shared=MAIN_SHARED + (SharedBuffer("dq_staging", "DQ_STAGE_OFFSET"),))
