"""What every family's lowering shares: the spec line a step came from, the constants of the mask and
softmax scale, of tile rows and K/V buffers, and the loop body read off the scheduler graph in its emission
order."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ..errors import SpecError
from ..layout.base import Layout
from ..schedule.graph import ScheduleGraph
from ..schedule.ops import Op
from ..schedule.passes import emission_order
from ..spec import KernelSpec, Mask
from .plan import INDEX_ERRORS, Constant, LoopOp, Parameter, SharedBuffer

MASK_KIND = {Mask.NONE: "MASK_NONE", Mask.CAUSAL: "MASK_CAUSAL", Mask.WINDOW: "MASK_WINDOW"}


def spec_line(spec: KernelSpec, key: str) -> str:
    span = spec.span_of(key)
    if span is None:
        return f"{Path(spec.source_file).name}"
    return f"{Path(span.file).name}:{span.line}"


def require(cond: bool, spec: KernelSpec, key: str, message: str, hint: str = "") -> None:
    if not cond:
        raise SpecError(message, spec.span_of(key), spec.source_text, hint)


def softmax_constants(p) -> list[Constant]:
    """The mask and softmax-scale constexprs every family's attention.cuh functions read."""
    return [
        Constant("MASK", "MaskKind", MASK_KIND[p.mask]),
        Constant("WINDOW_LEFT", "int", p.window_left),
        Constant("WINDOW_RIGHT", "int", p.window_right),
        Constant("SCALE", "float", p.scale, "softmax scale"),
        Constant("SCALE_LOG2", "float", p.scale * math.log2(math.e), "scale * log2(e): softmax through exp2"),
    ]


def tile_row_constants(qk_row: int, qk_swizzle: bool, v_row: int, v_swizzle: bool) -> list[Constant]:
    """The shared-memory row layout of Q/K and V tiles (tile_row_bytes) that common.cuh's loads and
    attention.cuh's ldmatrix addressing read."""
    return [
        Constant("QK_ROW_BYTES", "int", qk_row, "shared-memory row of Q and K tiles"),
        Constant("QK_SWIZZLE", "bool", qk_swizzle, "XOR swizzle (else padded rows)"),
        Constant("V_ROW_BYTES", "int", v_row, "shared-memory row of V (and O) tiles"),
        Constant("V_SWIZZLE", "bool", v_swizzle),
    ]


def smem_constants(lay: Layout) -> list[Constant]:
    """The kernel's shared-memory total and the limit its static_assert checks it against (both
    from the layout)."""
    return [
        Constant("SMEM_BYTES", "u32", lay.smem_bytes),
        Constant("SMEM_LIMIT", "u32", lay.smem_limit, f"opt-in shared memory per block on {lay.arch}"),
    ]


def kv_buffer_constants(stages: int, q_offset: int, k_offset: int, k_stage: int, v_offset: int,
                        v_stage: int) -> list[Constant]:
    """Where Q and the STAGES K and V buffers sit in shared memory (every family lays them out so)."""
    return [
        Constant("STAGES", "int", stages, "K/V buffers (pipeline stages)"),
        Constant("Q_OFFSET", "u32", q_offset),
        Constant("K_OFFSET", "u32", k_offset),
        Constant("K_STAGE_BYTES", "u32", k_stage),
        Constant("V_OFFSET", "u32", v_offset),
        Constant("V_STAGE_BYTES", "u32", v_stage),
    ]


def page_constants(page_size: int) -> list[Constant]:
    """A paged cache's addressing (templates/paged_kv.cuh): key t lies in page block_table[b, t >> PAGE_SHIFT]
    at slot t & PAGE_MASK (page sizes are powers of two). Each family adds the flags of its walk."""
    return [Constant("PAGE_SIZE", "int", page_size, "keys per page of the KV cache"),
            Constant("PAGE_SHIFT", "int", page_size.bit_length() - 1, "key -> block-table entry: key >> PAGE_SHIFT"),
            Constant("PAGE_MASK", "int", page_size - 1, "key -> slot in its page: key & PAGE_MASK")]


# Q once and the K and V rings (kv_buffer_constants) in the Shared view.
KV_SHARED = (SharedBuffer("q", "Q_OFFSET"), SharedBuffer("k", "K_OFFSET", "K_STAGE_BYTES"),
             SharedBuffer("v", "V_OFFSET", "V_STAGE_BYTES"))
O_SHARED = SharedBuffer("o", "O_OFFSET")   # O staged for coalesced stores


def parameters(type_: str, *names: str) -> tuple[Parameter, ...]:
    return tuple(Parameter(name, type_) for name in names)


# Parameter types: 16-bit inputs and outputs, fp32 outputs, int32 inputs.
IN16, OUT16 = "const u16* __restrict__", "u16* __restrict__"
OUT32, INT32S = "float* __restrict__", "const int* __restrict__"


def stride_lines(*tensors: str) -> tuple[tuple[Parameter, ...], ...]:
    """Each tensor's batch, head and row strides (elements), one line per tensor."""
    return tuple(parameters("i64", f"{t}_batch_stride", f"{t}_head_stride", f"{t}_row_stride") for t in tensors)


# A paged cache's block table, its row stride, the pages a row names and the pages the cache holds
# (the bounds of templates/index_bounds.cuh).
BLOCK_TABLE = (Parameter("block_table", INT32S), Parameter("table_stride", "i64"), Parameter("table_pages", "int"),
               Parameter("num_pages", "int"))
# The device header of a kernel that bounds its index tensors (the error word: plan.INDEX_ERRORS).
INDEX_BOUNDS_HEADER = "index_bounds.cuh"


def attention_parameters(paged: bool = False, last: tuple[Parameter, ...] = (),
                         more: tuple[tuple[Parameter, ...], ...] = (),
                         bounded: bool = False) -> tuple[tuple[Parameter, ...], ...]:
    """The parameters every one-block-per-query-tile kernel starts with (fa2, fa1): Q, K, V, O, LSE,
    kv_lens (the error word after it where the kernel bounds its indices, a paged cache's block table
    after that), the lengths and head counts, the four tensors' strides; `last` ends the strides'
    line, `more` are further lines."""
    strides = stride_lines("q", "k", "v", "o")
    return ((parameters(IN16, "q", "k", "v"),
             parameters(OUT16, "o") + parameters(OUT32, "lse") + parameters(INT32S, "kv_lens")
             + ((INDEX_ERRORS,) if bounded else ()) + (BLOCK_TABLE if paged else ()),
             parameters("int", "q_len", "kv_len", "heads", "kv_group"))
            + strides[:-1] + (strides[-1] + last,) + more)


def graph_loop_body(graph: ScheduleGraph, loop: str, lower_op) -> tuple[LoopOp, ...]:
    """The ops directly inside `loop`, in the graph's emission order, each lowered by
    `lower_op(name, op) -> [LoopOp, ...]` (nothing for ops a neighbour's CUDA covers, and for
    nested loops, which the template opens itself). Every LoopOp records the node it lowers."""
    body: list[LoopOp] = []
    for name in emission_order(graph):
        op = graph.op(name)
        if op.loops and op.loops[-1] == loop:
            body += [replace(step, node=name, **_prefetch_target(step)) for step in lower_op(name, op)]
    return tuple(body)


def _prefetch_target(step: LoopOp) -> dict:
    """A prefetch's tile, `distance` tiles ahead of the loop's `tile` (its ring slot is the template's
    ring_slot of stage + distance)."""
    if not step.kind.startswith("prefetch"):
        return {}
    return {"tile": f"tile + {step.distance}"}


def mma_instruction(graph: ScheduleGraph) -> tuple[Op, Op]:
    """The graph's two MMA ops (mma_qk, mma_pv), which carry the tensor-core instruction."""
    return graph.op("mma_qk"), graph.op("mma_pv")


LOOP_TEXT = {
    "mma_qk": "S = Q K_j^T (mma.sync m16n8k16, fp32 accumulate)",
    "mask": "mask keys outside the sequence / diagonal / window (only tiles that need it)",
    "online_softmax": "m = max(m, rowmax S); P = exp(scale (S - m)); rescale l and O",
    "mma_pv": "O += P V_j (P from registers, V via ldmatrix.trans)",
}
