"""Lowering of the decode family (flash-decoding): KernelSpec -> KernelPlan for templates/decode.cu.j2.

One thread block per (kv split, batch, kv head, row tile). The queries that read the same KV
head -- the kv group's heads times the queries per sequence -- are packed into the rows of one
MMA tile, so every K/V byte is read once per group. The block's warps split each kv tile along
the keys (split-K), each runs attention.cuh's QK^T / online softmax / PV on its own key slice,
and combine.cuh merges the warps' (m, l, O) through shared memory at the end. A split writes
normalised O (fp32) and LSE to a workspace; the last split of each (batch, kv head) to finish
merges them (an atomic ticket), so a call is one launch. With one split the block writes the
final output directly.

Sizes come from layout/ (its _decode); the template only names them.
"""
from __future__ import annotations

from dataclasses import replace

from ..device_limits import H200, DeviceLimits, resident_blocks
from ..layout.base import Layout, cp_async_pending, tile_row_bytes
from ..layout.decode import (DECODE_COMBINE_PAD_FLOATS, decode_page_walk, fp8_convert_of, kv_stage_row_bytes,
    kv_stage_swizzled)
from ..mods.expr import Var, reads
from ..schedule.graph import ScheduleGraph
from ..schedule.ops import Op
from ..spec import DTYPE_BYTES, DType, Family, KernelSpec, KvScale
from .expressions import expression_constants, expression_fields
from .plan import (INDEX_ERRORS, Constant, KernelPlan, KvLoad, Launch, LoopOp, Parameter, Region, SharedBuffer,
                   make_plan)
from .score_mods import mod_constants, mod_parameters, score_mod_fields
from .steps import (BLOCK_TABLE, IN16, INDEX_BOUNDS_HEADER, INT32S, KV_SHARED, LOOP_TEXT, OUT16, OUT32,
                    graph_loop_body, kv_buffer_constants, page_constants, parameters, require, smem_constants,
                    softmax_constants, spec_line, stride_lines, tile_row_constants)


# The device headers of an FP8 KV cache: what every conversion path shares, then each path's own
# (layout.FP8_CONVERTS).
FP8_HEADER = "fp8_kv.cuh"
FP8_CONVERT_HEADERS = {"shared": "fp8_shared.cuh", "fragments": "fp8_fragments.cuh"}
# `dequant shared`: the warps' 16-bit slices of K and V, converted from the e4m3 rings.
DEQUANTIZED_SHARED = (SharedBuffer("k_dequantized", "KD_OFFSET"), SharedBuffer("v_dequantized", "VD_OFFSET"))


def fp8_constants(spec: KernelSpec, lay, keys_per_warp: int, convert: str) -> list[Constant]:
    """An FP8 KV cache: the rings hold e4m3 rows as loaded (kv_stage_row_bytes). With `shared` each
    warp dequantizes its slice into one 16-bit tile (the mma.sync layout of K_OFFSET's usual tile);
    with `fragments` ldmatrix reads the rings (swizzled or padded rows) and the lanes convert."""
    p = spec.problem
    k8, v8 = (kv_stage_row_bytes(d, p.kv_dtype, convert) for d in (p.head_dim_qk, p.head_dim_v))
    consts = [Constant("K8_ROW_BYTES", "int", k8, "e4m3 K row in the ring: the HBM row as it is"
                       + ("" if convert == "shared" else " (padded to an odd number of chunks where not swizzled)")),
              Constant("V8_ROW_BYTES", "int", v8),
              Constant("K8_CHUNKS", "int", p.head_dim_qk * DTYPE_BYTES[p.kv_dtype] // 16,
                       "16-byte chunks of an e4m3 K row"),
              Constant("V8_CHUNKS", "int", p.head_dim_v * DTYPE_BYTES[p.kv_dtype] // 16),
              Constant("WARP_K8_BYTES", "u32", keys_per_warp * k8, "offset of a warp's key slice in an e4m3 K tile"),
              Constant("WARP_V8_BYTES", "u32", keys_per_warp * v8)]
    if convert == "shared":
        consts += [Constant("KD_OFFSET", "u32", lay.buffer("K dequantized").offset, "the warps' dequantized K slices"),
                   Constant("VD_OFFSET", "u32", lay.buffer("V dequantized").offset)]
    else:
        consts += [Constant("K8_SWIZZLE", "bool", kv_stage_swizzled(k8), "ldmatrix reads 8 rows: XOR-swizzled chunks, "
                            "else an odd number of chunks a row"),
                   Constant("V8_SWIZZLE", "bool", kv_stage_swizzled(v8))]
    return consts + [Constant("KV_SCALE_PER_HEAD", "bool", p.kv_scale is KvScale.PER_HEAD,
                              "k_scale / v_scale hold one float per kv head (else one)"),
                     Constant("DEQUANT_VIA_F32", "bool", p.dtype is DType.BF16,
                              "e4m3 -> f16 is one cvt; bf16 goes through f32 (exact either way)")]


def paged_constants(page_size: int, walk: str) -> list[Constant]:
    """A paged cache's addressing and how each warp walks it (layout.decode_page_walk)."""
    return page_constants(page_size) + [
        Constant("PAGE_PER_SLICE", "bool", walk == "slice",
                 "a warp's key slice lies in one page: one block-table read per slice"),
        Constant("PAGES_TILE_SLICE", "bool", walk == "pages",
                 "whole pages tile a warp's key slice: one block-table read per page")]


def decode_loop_body(spec: KernelSpec, graph: ScheduleGraph, stages: int,
                     prefetch_first: bool = True) -> tuple[LoopOp, ...]:
    """The kv loop of one split, in the scheduler graph's emission order. Each warp runs it on its
    own key slice of every tile (the graph's warp-scope loads and waits): it loads the slice it
    multiplies, so waits and buffer reuse are per warp (a warp barrier, no block barrier), and keeps
    its own running softmax state, merged with the other warps' once after the loop (the graph's
    combine_warps). K and V are separate cp.async groups (QK^T starts before V lands).

    Lowering places the loads by the pipeline depth. One stage: one buffer each for K and V,
    refilled as soon as the warp has read it (the refill of K follows QK^T, of V follows PV), so
    K_{j+1} loads during the softmax and P V of tile j, V_{j+1} during Q K_{j+1}^T. With 2+ stages
    the warp refills the buffer it finished last step with tile j+S-1 before it waits for tile j
    (`prefetch_first`), so S tiles are in flight while it waits, not S-1; waiting first (the order
    a block-wide barrier forces) holds the refill back until tile j has landed. The graph's op order
    is the same at any depth: a variant's `stages` (a layout override) changes only where the loads go."""

    def lower_op(name: str, op: Op) -> list[LoopOp]:
        where = spec_line(spec, op.key or "order")
        kind = op.kind.value
        if kind in ("load_k", "load_v"):
            if kind == "load_v" or stages == 1 or not prefetch_first:
                return []   # V goes with K; one stage refills after the MMA; wait-first prefetches after the wait
            return [LoopOp("barrier", where, "the warp is done with its slice of the buffer of tile j-1"),
                    LoopOp("prefetch_kv", where, f"refill it with the warp's slice of K, V of tile j+{stages - 1}, "
                           "before waiting for tile j", distance=stages - 1)]
        if kind == "wait" and op.barrier.startswith("k"):
            if stages == 1:
                return [LoopOp("wait_k", where, "wait for the warp's slice of K_j (V_j may still be in flight)",
                               pending=cp_async_pending(Family.DECODE, 1, "k"))]
            steps = [LoopOp("wait_k", where,
                            "wait for the warp's slice of K_j (V_j and later tiles may still be in flight)",
                            pending=cp_async_pending(Family.DECODE, stages, "k", prefetch_first))]
            if not prefetch_first:
                steps.append(LoopOp("prefetch_kv", where, f"prefetch the warp's slice of K, V of tile j+{stages - 1} "
                                    "into the buffer it freed last step", distance=stages - 1))
            return steps
        if kind == "wait":
            if stages == 1:
                return [LoopOp("wait_v", where, "wait for the warp's slice of V_j (K_{j+1} may still be in flight)",
                                pending=cp_async_pending(Family.DECODE, 1, "v"))]
            return [LoopOp("wait_v", where, "wait for the warp's slice of V_j",
                            pending=cp_async_pending(Family.DECODE, stages, "v"))]
        if kind == "mma_qk":
            step = LoopOp("mma_qk", where, "S = Q K_j^T on this warp's key slice (mma.sync m16n8k16, fp32 accumulate)")
            return [step] + _refill("k", spec_line(spec, "pipeline")) if stages == 1 else [step]
        if kind == "score_mod":
            return [LoopOp("score_mod", where, op.text + " (each packed row: its head's slope, its query's position)"
                           if spec.problem.mods.alibi is not None else op.text)]
        if kind == "mask":
            return [LoopOp("mask", where,
                           "mask keys past the sequence / after the query's diagonal / outside the window")]
        if kind == "online_softmax":
            return [LoopOp("online_softmax", where, LOOP_TEXT["online_softmax"] + " (per warp)")]
        if kind == "mma_pv":
            step = LoopOp("mma_pv", where, LOOP_TEXT["mma_pv"])
            return [step] + _refill("v", spec_line(spec, "pipeline")) if stages == 1 else [step]
        if kind == "rescale_o":
            return []   # folded into online_softmax: O is rescaled by exp(m_old - m_new) there
        if kind == "page_lookup":
            return []   # folded into the loads: each warp reads the entries of its own key slice
        raise AssertionError(f"decode lowering has no CUDA for graph op {name} ({kind})")

    return graph_loop_body(graph, "loop_kv", lower_op)


def _refill(t: str, where: str) -> list[LoopOp]:
    """One stage: the warp has read its slice of the K or V buffer; refill it with tile j+1."""
    tile = t.upper()
    return [LoopOp("barrier", where, f"the warp is done with its slice of {tile}_j"),
            LoopOp(f"prefetch_{t}", where, f"refill the {tile} buffer with the warp's slice of {tile}_{{j+1}}",
                   distance=1)]


def lower_decode(spec: KernelSpec, lay: Layout, graph: ScheduleGraph, template: str,
                 prefetch_first: bool = True) -> KernelPlan:
    """The decode plan. The layout's stages and tile kv are the spec's, or a variant's (the layout
    overrides `stages` / `tile_kv`: benchmarks compare variants, named apart); `prefetch_first` False
    waits for tile j before refilling (see decode_loop_body)."""
    p, s = spec.problem, spec.schedule
    stages, tile_kv = lay.stages, lay.tile_kv
    require(p.queries_per_seq is not None and p.queries_per_seq >= 1, spec, "queries",
             "the decode template needs `queries = N` (N >= 1)")
    threads, keys_per_warp, smem, q_in_registers = lay.threads, lay.keys_per_warp, lay.smem_bytes, lay.q_in_registers
    m_tiles, min_blocks_per_sm = s.tile_q // 16, lay.min_blocks_per_sm
    qk_row, qk_swizzle = tile_row_bytes(p.head_dim_qk)
    v_row, v_swizzle = tile_row_bytes(p.head_dim_v)
    q, k, v, combine = (lay.buffer(name) for name in ("Q", "K", "V", "warp partials"))
    k_stage, v_stage = k.stage_bytes, v.stage_bytes
    blocks_per_sm = max(1, lay.blocks_by_shared)
    # One stage: the K and V buffers are refilled half a step apart, so about one tile is in flight.
    bytes_in_flight = (stages - 1) * (k_stage + v_stage) if stages > 1 else k_stage + v_stage

    consts = [
        Constant("BC", "int", tile_kv, "keys per kv tile (tile kv); one cp.async tile"),
        Constant("D", "int", p.head_dim_qk, "head dim of q and k"),
        Constant("DV", "int", p.head_dim_v, "head dim of v and o"),
        Constant("WARPS", "int", s.warps, "warps, split along kv: each owns a slice of every kv tile"),
        Constant("THREADS", "int", threads),
        Constant("ROWS", "int", s.tile_q, "packed query rows per block: (head in kv group, query) pairs"),
        Constant("M_TILES", "int", m_tiles, "16-row mma tiles of packed rows"),
        Constant("KEYS_PER_WARP", "int", keys_per_warp, "keys of each kv tile one warp multiplies"),
        Constant("WARP_S_TILES", "int", keys_per_warp // 8, "8-column mma tiles of S per warp"),
        Constant("WARP_K_BYTES", "u32", keys_per_warp * qk_row, "offset of a warp's key slice in a K tile"),
        Constant("WARP_V_BYTES", "u32", keys_per_warp * v_row, "offset of a warp's key slice in a V tile"),
        Constant("O_TILES", "int", p.head_dim_v // 8, "8-column mma tiles of O"),
        *tile_row_constants(qk_row, qk_swizzle, v_row, v_swizzle),
        *kv_buffer_constants(stages, q.offset, k.offset, k_stage, v.offset, v_stage),
        Constant("COMBINE_OFFSET", "u32", combine.offset, "warp states for the combine reuse the Q/K/V bytes"),
        Constant("COMBINE_ROW_FLOATS", "int", p.head_dim_v + DECODE_COMBINE_PAD_FLOATS,
                 "staged O row, padded against bank conflicts"),
        Constant("COMBINE_BYTES", "u32", combine.bytes),
        *smem_constants(lay),
        Constant("Q_PENDING_GROUPS", "int", 2 * max(stages - 1, 1), "cp.async groups issued after Q's"),
        Constant("Q_IN_REGISTERS", "bool", q_in_registers, "Q fragments held for the whole kv loop"),
        Constant("Q_REG_TILES", "int", m_tiles if q_in_registers else 1),
        *softmax_constants(p),
        *mod_constants(p, keys_per_warp // 8),   # a thread's S: its warp's key slice
        *expression_constants(p),
        *decode_expression_constants(p.mods),
    ]
    walk = decode_page_walk(p.kv_page_size, keys_per_warp)
    if walk:
        consts += paged_constants(p.kv_page_size, walk)
    if p.kv_fp8:
        consts += fp8_constants(spec, lay, keys_per_warp, fp8_convert_of(spec))
    tile_where, pipe_where = spec_line(spec, "tile"), spec_line(spec, "pipeline")
    regions = {
        "kv_range": Region(spec_line(spec, "split"), "this split's kv tiles: an even share of the sequence's tiles "
                           "(a split with none writes LSE = -inf)"),
        "load_q": Region(tile_where, f"load the packed {s.tile_q} x {p.head_dim_qk} Q tile: row r is head "
                         "r / queries of the kv group, query r % queries (zero-filled past the group)"),
        "prologue": Region(pipe_where, f"pipeline prologue: first {max(stages - 1, 1)} K/V tile(s) in flight"),
        "kv_loop": Region(spec_line(spec, "warps"), f"each warp: keys [warp * {keys_per_warp}, +{keys_per_warp}) "
                          "of every tile, its own online softmax state"),
        "combine": Region(spec_line(spec, "warps"), "combine the warps' (m, l, O) through shared memory"),
        "epilogue": Region(spec_line(spec, "split"), "one split: final O and LSE; several: fp32 partial O and LSE "
                           "to the workspace"),
        "merge": Region(spec_line(spec, "split"), "merge the splits: lse = max + log sum exp(lse_i - max), "
                        "O = sum exp(lse_i - lse) O_i"),
    }
    if p.mods.alibi is not None:
        regions["alibi_rows"] = Region(spec_line(spec, "alibi"), "ALiBi: each packed row's slope (its head's, in raw "
                                       "units) and its query's key position i + kv_len - q_len")
    if p.mods.sinks:
        regions["sinks"] = Region(spec_line(spec, "sinks"), "sinks: split 0's warp 0 starts each packed row's "
                                  "running max at its head's sink and its sum at the sink's weight 1, so the warps' "
                                  "combine and the splits' merge count the sink once (LSE includes it)")
    if p.mods.score_mod is not None or p.mods.mask_mod is not None:
        regions["expression_rows"] = Region(spec_line(spec, "mask_mod" if p.mods.mask_mod is not None else "score_mod"),
                                            "the expressions' indices of the packed rows: b the batch entry, h row r's "
                                            "head, q_idx its query's position r % queries + kv_len - queries"
                                            + ("; the split's kv tiles narrowed to those mask_mod's interval test over "
                                               "the block's rows does not find empty, the walk stepping over the empty "
                                               "ones between" if p.mods.mask_mod is not None else ""))
    if walk:
        regions["kv_range"] = replace(regions["kv_range"], what=regions["kv_range"].what + "; K/V rows through the "
                                      f"block table ({p.kv_page_size} keys a page, " + (
                                          {"slice": "one entry per warp slice)", "pages": "one entry per page)",
                                           "rows": "one entry per key row)"}[walk]))
    notes = (f"{s.warps} warps x {keys_per_warp} keys of a {tile_kv}-key tile, each warp loading its own slice; "
             + (f"{stages} stages: {bytes_in_flight} B of K/V in flight per block while one tile is computed"
                if stages > 1 else f"one K and one V buffer, each refilled as soon as it is read: about "
                f"{bytes_in_flight} B of K/V in flight per block"),
             f"{smem} B shared memory -> {min(blocks_per_sm, min_blocks_per_sm)} resident block(s) per SM"
             + (f" (shared memory alone would allow {blocks_per_sm}; the launch bounds promise ptxas "
                f"{min_blocks_per_sm})" if blocks_per_sm > min_blocks_per_sm else ""))
    name = spec.kernel_name if (stages, tile_kv) == (s.stages,
                                                     s.tile_kv) else f"{spec.kernel_name}__kv{tile_kv}_s{stages}"
    if not prefetch_first:
        name += "__wait_first"
    # the graph's loads: each warp its own key slice of a tile (paged: through the block table)
    kv_walk = ("paged_" if walk else "") + ("slice" if graph.op("load_k").scope == "warp" else "tile")
    loop_body = decode_loop_body(spec, graph, stages, prefetch_first)
    if p.mods.mask_mod is not None:
        # the walk steps over mask_mod's empty tiles: a prefetch loads the template's `ahead`, the visible tile its
        # distance on (the block-wide walk's ring of page entries counts tiles, not visits)
        require(kv_walk.endswith("slice"), spec, "mask_mod", "mask_mod in decode needs each warp loading its own "
                "key slice (warps = kv)")
        loop_body = tuple(replace(op, tile="ahead") if op.kind.startswith("prefetch") else op for op in loop_body)
    convert = fp8_convert_of(spec)
    headers = ((INDEX_BOUNDS_HEADER,) + (("paged_kv.cuh",) if walk else ())
               + ((FP8_HEADER, FP8_CONVERT_HEADERS[convert]) if convert else ()))
    return make_plan(spec, Family.DECODE, template, consts, regions, loop_body,
                     Launch(threads=threads, smem_bytes=smem, tile_q=s.tile_q), min_blocks_per_sm,
                     lay.register_estimate,
                     kernel_name=name, notes=notes, kv_load=KvLoad.of(kv_walk, fp8=convert),
                     mma_traits="W", mask_rows="packed", kv_pages=walk, kv_fp8=p.kv_fp8, fp8_convert=convert,
                     headers=headers, shared=KV_SHARED + (DEQUANTIZED_SHARED if convert == "shared" else ()),
                     parameters=decode_parameters(bool(walk), p.kv_fp8) + mod_parameters(p.mods),
                     **score_mod_fields(p.mods, consts), **expression_fields(p.mods))


def decode_expression_constants(mods) -> list[Constant]:
    """MASK_MOD_READS_HEAD: whether mask_mod's tile test takes each of a block's heads (its packed rows span
    several) or one serves them all."""
    if mods.score_mod is None and mods.mask_mod is None:
        return []
    reads_head = mods.mask_mod is not None and any(v.name == "h" for v in reads(mods.mask_mod, Var))
    return [Constant("MASK_MOD_READS_HEAD", "bool", reads_head,
                     "mask_mod reads h: a tile's class is taken for each head of the block's rows")]


def decode_parameters(paged: bool, fp8: bool) -> tuple[tuple[Parameter, ...], ...]:
    """decode.cu.j2's parameters: Q, K, V, O and LSE, the splits' workspace (partial O and LSE, the
    tickets), kv_lens and the error word (a paged cache's block table, an FP8 cache's scales after it),
    the sizes and the split count, the strides."""
    return ((parameters(IN16, "q", "k", "v"),
             parameters(OUT16, "o") + parameters(OUT32, "lse", "o_part", "lse_part"),
             parameters("int* __restrict__", "split_counters") + parameters(INT32S, "kv_lens") + (INDEX_ERRORS,)
             + (BLOCK_TABLE if paged else ()) + (parameters("const float* __restrict__", "k_scale", "v_scale") if fp8
                                                 else ())
             + parameters("int", "q_len", "kv_len", "heads", "kv_group", "row_tiles", "num_splits"))
            + stride_lines("q", "k", "v", "o"))


def decode_blocks_per_sm(plan: KernelPlan, limits: DeviceLimits = H200) -> int:
    """Resident blocks per SM before compiling (explain, the traffic model): device_limits'
    resident_blocks on `limits` from the plan's estimates, but no more than the launch bounds
    promise ptxas (min_blocks_per_sm): past that ptxas may use up to 255 registers a thread, and 3
    blocks of 128 threads at more than 170 registers do not fit. The runtime counts with the
    compiled kernel's registers instead (Kernel.slots)."""
    per_sm, _ = resident_blocks(limits, plan.register_estimate, plan.launch.threads, plan.launch.smem_bytes)
    return max(1, min(per_sm, plan.min_blocks_per_sm))


