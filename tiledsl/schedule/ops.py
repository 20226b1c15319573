"""The plain data of the scheduler graph (schedule/graph.py): op kinds, ops, edges, barriers. Apart from
schedule/graph.py so that a family's own graph builder (schedule/hopper.py) can use them without an import cycle."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..spec import Mask


class OpKind(str, Enum):
    LOOP = "loop"
    LOAD_Q = "load_q"
    LOAD_K = "load_k"
    LOAD_V = "load_v"
    MMA_QK = "mma_qk"
    MASK = "mask"
    ONLINE_SOFTMAX = "online_softmax"
    MMA_PV = "mma_pv"
    COMBINE_WARPS = "combine_warps"     # split-K warps: merge per-warp partials through shared memory
    RESCALE_O = "rescale_o"
    LOAD_O_STATE = "load_o_state"       # FA1: O, m, l read back from HBM every kv step
    STORE_O_STATE = "store_o_state"     # FA1: O, m, l written to HBM every kv step
    NORMALIZE_O = "normalize_o"
    STORE_O = "store_o"
    STORE_LSE = "store_lse"
    MERGE_SPLITS = "merge_splits"
    ARRIVE = "arrive"
    WAIT = "wait"
    MMA_WAIT = "mma_wait"               # Hopper: wait for an async wgmma (wgmma.wait_group `pending`)
    PACK_P = "pack_p"                   # Hopper: P (fp32 accumulators) -> the P V wgmma's A fragments
    PAGE_LOOKUP = "page_lookup"         # paged KV: the kv tile's block-table entries -> page indices
    TRANSPOSE_V = "transpose_v"         # FP8: V_j (keys x dv bytes) -> V^T_j, the K-major B operand of P V
    SCORE_MOD = "score_mod"             # softcap, ALiBi, score_mod on S (schedule/modify.py)
    DROPOUT = "dropout"                 # P *= Z / (1 - p), Z from Philox counters
    SCORE_MOD_GRAD = "score_mod_grad"   # backward: dS *= d(modified S) / dS
    SINK_GRAD = "sink_grad"             # backward preprocess: dsink_h -= sum_i exp(sink_h - lse_i) D_i
    # the backward (schedule/backward.py): P recomputed from S and LSE, never stored
    LOAD_O = "load_o"                   # preprocess: the forward's O tile
    LOAD_DO = "load_do"                 # dO tile
    ROWSUM_D = "rowsum_d"               # D = rowsum(dO * O)
    LOAD_LSE_D = "load_lse_d"           # LSE and D of the q tile
    RECOMPUTE_P = "recompute_p"         # P = exp(S - LSE)
    MMA_DV = "mma_dv"                   # dV += P^T dO
    MMA_DP = "mma_dp"                   # dP = dO V^T
    SOFTMAX_GRAD = "softmax_grad"       # dS = P * (dP - D)
    MMA_DK = "mma_dk"                   # dK += scale * dS^T Q
    MMA_DQ = "mma_dq"                   # dQ += scale * dS K
    ACCUMULATE = "accumulate"           # add a block's partial into an fp32 HBM workspace (atomic | ordered)
    STORE_GRAD = "store_grad"           # D, dQ, dK or dV -> HBM (dK, dV summed over a GQA group)
    CONVERT_GRAD = "convert_grad"       # fp32 workspace -> the gradient in the output's dtype
    STAGE = "stage"                     # registers -> shared memory for another role (P^T, dS^T, dQ_i)


class Space(str, Enum):
    HBM = "hbm"
    SHARED = "shared"
    REGISTERS = "registers"
    NONE = "none"            # loops and barriers hold no data


class Role(str, Enum):
    ALL = "all"              # every warp of the block
    PRODUCER = "producer"    # the load warpgroup of a warp-specialized kernel
    CONSUMER = "consumer"    # the MMA/softmax warpgroups
    WRITER = "writer"        # the warp that adds staged partial sums to HBM (the warp-specialized backward's dQ)
    TRANSPOSER = "transposer"   # the producer warpgroup's warps that copy FP8's V tiles into V^T


class EdgeKind(str, Enum):
    DATA = "data"
    SYNC = "sync"


@dataclass(frozen=True)
class Access:
    """One HBM access of an op, per trip: `rows` rows of the current q or kv tile ("q" | "kv")
    times `cols` ("d" | "dv" | "1"), repeated `times` ("1" | "splits")."""
    tensor: str              # Q K V O lse | O_state m l (FA1) | O_part lse_part (split-KV)
    mode: str                # "read" | "write"
    rows: str
    cols: str
    times: str = "1"


@dataclass(frozen=True)
class Op:
    kind: OpKind
    space: Space = Space.NONE          # where the op's result lives
    shape: tuple[str, ...] = ()        # symbolic tile shape, e.g. ("Br", "d")
    loops: tuple[str, ...] = ()        # enclosing loop nodes, outer -> inner
    role: Role = Role.ALL
    key: str = ""                      # the DSL setting whose span this op comes from
    text: str = ""                     # one line of pseudo-code (explain, generated comments)
    variant: str = ""                  # running | normalized | unnormalized | mask kind
    hbm: tuple[Access, ...] = ()
    via: str = ""                      # copy mechanism of a load: cp.async | tma
    barrier: str = ""                  # arrive/wait: the barrier's name, e.g. "k_full"
    scope: str = "block"               # loads and waits of K/V: "warp" when each warp moves only its key slice
    mma: str = ""                      # mma_qk / mma_pv: the tensor-core instruction, "mma.sync" | "wgmma"
    mma_shape: tuple[int, ...] = ()    # its (m, n, k)
    lag: int = 0                       # tiles behind its loop's tile (Hopper's intra-overlap pipeline)
    pending: int = 0                   # mma_wait: wgmma groups left in flight (in the loop's steady state)
    # loops only
    var: str = ""                      # the tile index: "q" | "kv" | "split"
    extent: str = ""                   # trip count, symbolic
    grid: bool = False                 # one thread block per trip (else a serial loop in a block)
    kernel: str = ""                   # top-level loops: which kernel launch ("attention", "merge")
    init: tuple[tuple[str, str], ...] = ()   # state set before the first trip: (name, value)
    init_space: Space = Space.NONE
    # filled by passes
    sizes: tuple[int, ...] = ()        # `shape` in elements (shape inference)
    bytes: int = 0                     # one tile of the result in its space (shape inference)
    stages: int = 0                    # pipeline depth of the buffer ring it uses (pipelining)
    buffer: str = ""                   # which ring slot, e.g. "j % 2" (pipelining)
    tx_bytes: int = 0                  # arrive on a TMA full barrier: the bytes its copies complete (barriers)


@dataclass(frozen=True)
class Barrier:
    """One barrier of a warp-specialized kernel (the barriers pass): an mbarrier (per ring stage when
    `stages` > 1) or a named barrier (`count` in threads)."""
    name: str
    kind: str                          # "mbarrier" | "named"
    count: int                         # arrivals that complete one phase
    tx_bytes: int                      # TMA transaction bytes that must land too (full barriers)
    stages: int
    arrive: tuple[str, ...]            # the ops that arrive on it
    wait: tuple[str, ...]              # the ops that wait on it
    arrive_role: str
    wait_role: str


@dataclass(frozen=True)
class Carry:
    """A dependency from one trip of `loop` to a later trip (kept out of the DAG)."""
    loop: str
    src: str
    dst: str
    value: str
    kind: EdgeKind = EdgeKind.DATA


class GraphError(ValueError):
    """A malformed graph: a name defined twice, an edge to an unknown node. A compiler bug."""


MASK_TEXT = {
    Mask.NONE: "S = -inf where key >= kv_len (ragged last tile)",
    Mask.CAUSAL: "S = -inf where key > query + (kv_len - q_len) or key >= kv_len",
    Mask.WINDOW: "S = -inf outside query + off - left <= key <= query + off + right, off = kv_len - q_len",
}
