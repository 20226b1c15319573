"""KernelSpec: the checked, hashable description of one attention kernel (problem + schedule).

This is the plain data every later stage reads. The parser and checker (frontend/parse.py, frontend/check.py)
produce it; the graph, lowering, runtime and tuner consume it. Source spans ride along for
error messages but take no part in equality or hashing: the same config written in two files
is the same kernel.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum

from .mods.model import NO_MODS, Modifications

# The DSL's setting keys (`key = value` in a block; statements in `schedule { }`). MOD_KEYS write the
# score and mask modifications (mods/model.py), besides `mask`'s built-in terms.
MOD_KEYS = ("softcap", "alibi", "sinks", "dropout", "score_mod", "mask_mod")
PROBLEM_KEYS = ("head_dim", "head_dim_v", "dtype", "mask", "scale", "queries", "kv_cache", "layout", "kv_dtype",
                "kv_scale", "out_dtype", "descale") + MOD_KEYS
VIA_KEYS = ("softcap",)   # settings that take `via` (how they run: `softcap = 30 via ex2`, mods/softcap.py)
SCHEDULE_KEYS = ("order", "tile", "warps", "pipeline", "mma", "warpgroups", "overlap", "split", "dequant", "launch")
# Statements of `backward { }`; their spans are keyed "backward.<key>" (the block itself: "backward").
BACKWARD_KEYS = ("order", "tile", "warps", "pipeline", "mma", "dq", "warpgroups")


@dataclass(frozen=True)
class Span:
    """Where a piece of a spec came from: 1-based line and column, end exclusive."""
    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class Family(Enum):
    """Kernel families; each has one template under templates/."""
    FA1 = "fa1"            # kv outer, q inner; O, m, l round-trip through HBM
    FA2 = "fa2"            # q outer; O stays on chip, normalised once
    HOPPER = "hopper"      # warp-specialized producer/consumer (FA3-style)
    DECODE = "decode"      # few queries per sequence, split-KV + merge


class DType(Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    E4M3 = "e4m3"      # FP8: Q, K, V of the hopper family (dtype), or a decode KV cache (kv_dtype)


@dataclass(frozen=True)
class DTypeInfo:
    """Every spelling of one element type. DTYPES is the one table; a test checks every DType has
    a complete row."""
    cuda: str                 # C++ type in CUDA source
    bytes: int
    ptx: str                  # type suffix of mma / cvt instructions
    torch: str                # attribute of the torch module
    numpy: str                # NumPy (ml_dtypes for bfloat16) name
    storage: str              # NumPy dtype that holds the bits where a framework lacks the type (CuPy: bf16)
    dlpack: tuple[int, int]   # DLPack (type code, bits)
    cai: str | None           # __cuda_array_interface__ typestr; None: the interface cannot express it


DTYPES = {
    DType.FP16: DTypeInfo("__half", 2, "f16", "float16", "float16", "float16", (2, 16), "<f2"),
    DType.BF16: DTypeInfo("__nv_bfloat16", 2, "bf16", "bfloat16", "bfloat16", "uint16", (4, 16), None),
    DType.FP32: DTypeInfo("float", 4, "f32", "float32", "float32", "float32", (2, 32), "<f4"),
    # DLPack kDLFloat8_e4m3fn (code 10); NumPy and CuPy have no e4m3: the bytes travel as uint8.
    DType.E4M3: DTypeInfo("__nv_fp8_e4m3", 1, "e4m3", "float8_e4m3fn", "uint8", "uint8", (10, 8), None),
}
COMPUTE_DTYPES = (DType.FP16, DType.BF16, DType.FP32, DType.E4M3)   # what `dtype =` takes (families say which run)
OUT_DTYPES = (DType.BF16, DType.FP16)                    # what `out_dtype =` takes: FP8 attention's output
KV_DTYPES = (DType.E4M3,)                                # what `kv_dtype =` takes (besides the spec's dtype)
# Shorthands for the two columns most readers need (views of DTYPES, not separate facts).
DTYPE_BYTES = {dtype: info.bytes for dtype, info in DTYPES.items()}
DTYPE_PTX = {dtype: info.ptx for dtype, info in DTYPES.items()}


class Mask(Enum):
    NONE = "none"
    CAUSAL = "causal"      # key j visible to query i iff j <= i + (kv_len - q_len): bottom-right aligned
    WINDOW = "window"      # i + off - left <= j <= i + off + right, off = kv_len - q_len


class KvScale(Enum):
    """The granularity of an FP8 KV cache's dequantization scales (float32, one K and one V scale)."""
    PER_HEAD = "per_head"       # (kv_heads,) each
    PER_TENSOR = "per_tensor"   # one each


class Descale(Enum):
    """The granularity of FP8 attention's float32 descales (`descale =`): value = e4m3 byte * descale."""
    PER_TENSOR = "per_tensor"   # one each for Q, K and V
    PER_HEAD = "per_head"       # (batch, kv_heads) each, FlashAttention-3's q_descale / k_descale / v_descale
    PER_BLOCK = "per_block"     # one per Q tile of (batch, head) and one per K / V tile of (batch, kv head)


class SeqLayout(Enum):
    """How a batch's sequences lie in HBM."""
    BATCHED = "batched"    # (batch, seq, heads, d): every sequence padded to one length
    VARLEN = "varlen"      # packed (total tokens, heads, d) with cu_seqlens_q / cu_seqlens_k offsets


class LoopOrder(Enum):
    Q_OUTER = "q, kv"      # FA2
    KV_OUTER = "kv, q"     # FA1


class Axis(Enum):
    Q = "q"                # split-Q: each warp owns its query rows
    KV = "kv"              # split-K: warps share rows, partial results combined on chip


class CopyVia(Enum):
    CP_ASYNC = "cp.async"
    TMA = "tma"


class Mma(Enum):
    """The tensor-core instruction of the fa2 family."""
    SYNC = "mma.sync"      # warp-level m16n8k16: each warp's rows in multiples of 16
    WGMMA = "wgmma"        # Hopper warpgroup-level m64nNk16, operands read from shared memory


class LaunchKind(Enum):
    """How a hopper kernel's blocks take their work items (query tile, batch, head): the DSL's `launch`."""
    GRID = "grid"               # one block per item; the GPU's block scheduler starts each on the SM that frees first
    PERSISTENT = "persistent"   # one block per resident slot, block b walking items b, b + grid, b + 2 grid, ...
    DYNAMIC = "dynamic"         # one block per resident slot, each producer taking its next item from a global counter


class ItemOrder(Enum):
    """The order work items are handed out in (the DSL's `launch ... order`; runtime/block_order.py)."""
    LONGEST_FIRST = "longest_first"   # pairs in groups sized to the resident slots, each group's longest q tiles first
    PAIR_BY_PAIR = "pair_by_pair"     # one (batch, head) pair after another (its K and V stay in L2), longest first


class DqAccumulate(Enum):
    """How the kv-outer backward sums each kv tile's share of dQ across blocks."""
    ATOMIC = "atomic"          # fp32 atomics into a workspace, in whatever order blocks finish
    SEPARATE = "separate"      # a second, q-outer pass recomputes dS and sums dQ on chip
    ORDERED = "ordered"        # the workspace adds in kv tile order: deterministic
    TMA_REDUCE = "tma_reduce"  # warp-specialized: staged in shared memory, added by TMA's reduce-add


AUTO = "auto"   # the value of split_kv when the runtime picks the number of splits

# Bounds of the values a kernel holds as C constants and no resource rule bounds. The checker refuses a
# value outside them at its spec line, and the Python API before it builds a spec (runtime/arguments.py).
# Window sizes are C ints added to int key positions (q0 + rows + diag + right): 2^30 leaves room for
# sequences of up to 2^30 tokens, and a window wider than every sequence is the same as no window.
MAX_WINDOW = 1 << 30
# split kv = N: the grid's x extent and a workspace of N partial rows per query row; more splits than a
# wave of blocks only adds partials to merge, and the traffic model walks every split.
MAX_SPLIT_KV = 1024
# Tile sizes: no kernel fits a tile past this in shared memory or registers (the layout refuses those
# anyway); the bound keeps every product of sizes the layout forms far inside the C types.
MAX_TILE = 1024
# The softmax scale: SCALE and SCALE * log2(e) are float constants; this range keeps both normal floats.
SCALE_RANGE = (1e-30, 1e30)
DECODE_MAX_QUERIES = 16   # tiledsl.attention: q_len up to this runs the decode family (one 16-row MMA tile of queries)


@dataclass(frozen=True)
class Problem:
    """What to compute."""
    head_dim_qk: int
    head_dim_v: int
    dtype: DType = DType.BF16
    mask: Mask = Mask.NONE
    window_left: int = 0            # only with Mask.WINDOW: keys visible before the diagonal
    window_right: int = 0           # only with Mask.WINDOW: keys visible after the diagonal
    softmax_scale: float | None = None   # None: 1/sqrt(head_dim_qk)
    queries_per_seq: int | None = None   # decode: queries per sequence (1..16); None: prefill
    # Serving layouts. They enter config, hash and kernel name only when set (SERVING_DEFAULTS), so
    # every kernel written before them keeps its name, hash and generated file.
    kv_page_size: int | None = None      # paged KV cache: keys per page (a power of two, 1..256); None: contiguous
    seq_layout: SeqLayout = SeqLayout.BATCHED
    kv_dtype: DType | None = None        # K/V storage type (E4M3: FP8 decode cache); None: dtype
    kv_scale: KvScale | None = None      # with kv_dtype = e4m3: the scales' granularity
    # FP8 attention (dtype = e4m3): the output type (None: bf16) and the descales' granularity (None: per head).
    out_dtype: DType | None = None
    descale: Descale | None = None
    # Score and mask modifications (softcap, ALiBi, sinks, document / prefix / block masks, dropout,
    # score_mod, mask_mod): in config, hash and kernel name only when any is set.
    mods: Modifications = NO_MODS

    @property
    def kv_fp8(self) -> bool:
        return self.kv_dtype is DType.E4M3

    @property
    def fp8(self) -> bool:
        """FP8 attention: Q, K and V are e4m3 (with descales), O is out_dtype."""
        return self.dtype is DType.E4M3

    @property
    def output_dtype(self) -> DType:
        """The type O is written in: out_dtype, bf16 for FP8 attention, else the dtype."""
        return self.out_dtype or (DType.BF16 if self.fp8 else self.dtype)

    @property
    def descales(self) -> Descale | None:
        """FP8 attention's descale granularity (per head unless the spec says), None for 16-bit inputs."""
        return (self.descale or Descale.PER_HEAD) if self.fp8 else None

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else default_softmax_scale(self.head_dim_qk)


def default_softmax_scale(head_dim_qk: int) -> float:
    """The softmax scale of a problem that sets none: 1 / sqrt(head dim)."""
    return 1.0 / math.sqrt(head_dim_qk)


KV_PAGE_SIZES = tuple(1 << i for i in range(9))   # keys per page, 1..256: a key's page and slot are a shift and a mask

# Problem fields left out of config() (and so of the hash) while they hold these defaults.
SERVING_DEFAULTS = {"kv_page_size": None, "seq_layout": SeqLayout.BATCHED, "kv_dtype": None, "kv_scale": None,
                    "out_dtype": None, "descale": None}


@dataclass(frozen=True)
class Schedule:
    """How to compute it. Defaults are the documented DSL defaults (README, "DSL reference")."""
    order: LoopOrder = LoopOrder.Q_OUTER
    tile_q: int = 128
    tile_kv: int = 64
    warps: int = 4
    warp_axis: Axis = Axis.Q
    stages: int = 2
    copy: CopyVia = CopyVia.CP_ASYNC
    mma: Mma = Mma.SYNC
    producer_warpgroups: int = 0    # 0: no warp specialization
    producer_regs: int = 0
    consumer_warpgroups: int = 0
    consumer_regs: int = 0
    pingpong: bool = False
    intra_overlap: bool = False
    split_kv: int | str = 1         # 1: no split; N: N splits; AUTO: chosen at launch
    # Decode with an FP8 KV cache: how e4m3 becomes MMA operands (the DSL's `dequant shared |
    # fragments`, layout.FP8_CONVERTS; None: layout.FP8_CONVERT_DEFAULT), and a min-blocks-per-SM
    # promise to ptxas (None: the layout's). Both enter config, hash and kernel name only when set
    # (SCHEDULE_DEFAULTS).
    fp8_convert: str | None = None
    min_blocks: int | None = None
    # The hopper family's tile scheduler (`launch grid | persistent | dynamic [order ...]`); None: the
    # runtime picks by mask and length (runtime/hopper.py). Both enter config, hash and name only when set.
    launch: LaunchKind | None = None
    item_order: ItemOrder | None = None


# Schedule fields left out of config() (and so of the hash) while they hold these defaults.
SCHEDULE_DEFAULTS = {"fp8_convert": None, "min_blocks": None, "launch": None, "item_order": None}


@dataclass(frozen=True)
class BackwardSchedule:
    """How to compute dQ, dK, dV by recomputation from O and LSE (`backward { }`). Defaults are
    FA2's backward: kv outer with dK, dV on chip, dQ summed by fp32 atomics."""
    order: LoopOrder = LoopOrder.KV_OUTER
    tile_q: int = 64
    tile_kv: int = 128
    warps: int = 8
    stages: int = 2
    mma: Mma = Mma.SYNC
    dq: DqAccumulate = DqAccumulate.ATOMIC   # kv outer only: q outer keeps dQ on chip
    # Warp specialization (`warpgroups` in the backward block): a TMA producer warpgroup and consumer
    # warpgroups, the Hopper backward family (layout/backward_ws.py); 0 consumers: not specialized.
    producer_warpgroups: int = 0
    producer_regs: int = 0
    consumer_warpgroups: int = 0
    consumer_regs: int = 0
    copy: CopyVia = CopyVia.CP_ASYNC

    @property
    def warp_specialized(self) -> bool:
        return self.consumer_warpgroups > 0


# Backward fields left out of config() (and so of the hash) while they hold these defaults.
BACKWARD_DEFAULTS = {"producer_warpgroups": 0, "producer_regs": 0, "consumer_warpgroups": 0, "consumer_regs": 0,
                     "copy": CopyVia.CP_ASYNC}


@dataclass(frozen=True)
class KernelSpec:
    name: str                       # the name after `attention` in the DSL
    problem: Problem
    schedule: Schedule
    source_file: str = field(default="<string>", compare=False)
    source_text: str = field(default="", compare=False, repr=False)
    # (key, Span) pairs, e.g. ("tile", Span(...)): where each setting was written.
    spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)
    span: Span | None = field(default=None, compare=False, repr=False)   # the whole block
    backward: BackwardSchedule | None = None   # None: no `backward { }` block (forward only)

    @property
    def family(self) -> Family:
        return family_of(self.problem, self.schedule)

    @property
    def kernel_name(self) -> str:
        return kernel_name(self)

    def span_of(self, key: str) -> Span | None:
        """The span of the setting `key` (e.g. "tile", "warps"), else the whole block's (a
        setting left at its default); a key the DSL doesn't have is a KeyError."""
        backward = ("backward",) + tuple(f"backward.{k}" for k in BACKWARD_KEYS)
        if key not in PROBLEM_KEYS + SCHEDULE_KEYS + backward:
            raise KeyError(f"{key!r} is not a spec setting; settings: {', '.join(PROBLEM_KEYS + SCHEDULE_KEYS)}")
        for k, s in self.spans:
            if k == key:
                return s
        if key.startswith("backward."):   # a backward default: point at the backward block
            return self.span_of("backward")
        return self.span

    def config(self) -> dict:
        """The full config as JSON-ready plain data (enums by value)."""
        problem = {k: v for k, v in asdict(replace(self.problem, mods=NO_MODS)).items()
                   if not (k in SERVING_DEFAULTS and v == SERVING_DEFAULTS[k]) and k != "mods"}
        if self.problem.mods.active:
            problem["mods"] = self.problem.mods.config()
        schedule = {k: v for k, v in asdict(self.schedule).items()
                    if not (k in SCHEDULE_DEFAULTS and v == SCHEDULE_DEFAULTS[k])}
        config = {"name": self.name, "kernel": self.kernel_name, "family": self.family.value,
                  "problem": _plain(problem), "schedule": _plain(schedule)}
        if self.backward is not None:   # absent otherwise: forward-only hashes stay as they were
            config["backward"] = _plain({k: v for k, v in asdict(self.backward).items()
                                         if not (k in BACKWARD_DEFAULTS and v == BACKWARD_DEFAULTS[k])})
        return config

    @property
    def config_hash(self) -> str:
        """sha256 of the config: the same config always gives the same hash."""
        config = self.config()
        blob = json.dumps({key: config[key] for key in ("problem", "schedule", "backward") if key in config},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _plain(value):
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def family_of(problem: Problem, schedule: Schedule) -> Family:
    """The template family a config selects. Warpgroups mean Hopper; queries per sequence mean
    decode; kv outer means FA1; otherwise FA2."""
    if schedule.producer_warpgroups or schedule.consumer_warpgroups:
        return Family.HOPPER
    if problem.queries_per_seq is not None:
        return Family.DECODE
    if schedule.order is LoopOrder.KV_OUTER:
        return Family.FA1
    return Family.FA2


def _number(x: float) -> str:
    """A float as part of a C identifier: 0.125 -> 0p125, 1e-05 -> 1em05, 1e+30 -> 1e30."""
    return repr(float(x)).replace(".", "p").replace("-", "m").replace("+", "")


def kernel_name(spec: KernelSpec) -> str:
    """A pure function of the config, e.g. fa2_d128_bf16_causal_q128_kv64_w4q_s2.

    It keys the generated file and the compile cache, so every config field appears in it
    (defaults included where they vary between families)."""
    p, s = spec.problem, spec.schedule
    fam = family_of(p, s)
    parts = [fam.value, f"d{p.head_dim_qk}" + (f"v{p.head_dim_v}" if p.head_dim_v != p.head_dim_qk else ""),
             p.dtype.value]
    if p.mask is Mask.CAUSAL:
        parts.append("causal")
    elif p.mask is Mask.WINDOW:
        parts.append(f"win{p.window_left}x{p.window_right}")
    if p.softmax_scale is not None:
        parts.append(f"scale{_number(p.softmax_scale)}")
    parts += p.mods.name_parts()
    if p.queries_per_seq is not None:
        parts.append(f"nq{p.queries_per_seq}")
    if p.kv_page_size is not None:
        parts.append(f"paged{p.kv_page_size}")
    if p.seq_layout is SeqLayout.VARLEN:
        parts.append("varlen")
    if p.kv_dtype is not None:
        parts.append(f"kv{p.kv_dtype.value}" + ("h" if p.kv_scale is KvScale.PER_HEAD else "t"))
    if p.fp8:
        parts.append({Descale.PER_TENSOR: "dst", Descale.PER_HEAD: "dsh", Descale.PER_BLOCK: "dsb"}[p.descales])
    if p.out_dtype is not None:
        parts.append(f"o{p.out_dtype.value}")
    parts += [f"q{s.tile_q}", f"kv{s.tile_kv}"]
    if fam is Family.HOPPER:
        parts += [f"p{s.producer_warpgroups}r{s.producer_regs}", f"c{s.consumer_warpgroups}r{s.consumer_regs}"]
        if s.pingpong:
            parts.append("pingpong")
        if s.intra_overlap:
            parts.append("intra")
        if s.launch is not None:
            parts.append(s.launch.value)
        if s.item_order is not None:
            parts.append({ItemOrder.LONGEST_FIRST: "lpt", ItemOrder.PAIR_BY_PAIR: "pairs"}[s.item_order])
    else:
        parts.append(f"w{s.warps}{s.warp_axis.value}")
    parts.append(f"s{s.stages}" + ("tma" if s.copy is CopyVia.TMA else ""))
    if s.mma is Mma.WGMMA and fam is not Family.HOPPER:   # hopper runs on nothing else
        parts.append("wgmma")
    if s.split_kv != 1:
        parts.append(f"split{s.split_kv}")
    if s.fp8_convert is not None:
        parts.append(f"cv{s.fp8_convert}")
    if s.min_blocks is not None:
        parts.append(f"mb{s.min_blocks}")
    if spec.backward is not None:
        parts += backward_name_parts(spec.backward)
    return "_".join(parts)


def backward_name_parts(b: BackwardSchedule) -> list[str]:
    """The backward schedule's part of a kernel name, e.g. bwd_kvq_q64_kv128_w8_s2_atomic (warp-specialized:
    bwd_kvq_q64_kv128_p1r24_c2r240_s2tma_tma_reduce)."""
    parts = ["bwd", "kvq" if b.order is LoopOrder.KV_OUTER else "qkv", f"q{b.tile_q}", f"kv{b.tile_kv}"]
    if b.warp_specialized:   # wgmma and TMA are the family's only instruction and copy
        return parts + [f"p{b.producer_warpgroups}r{b.producer_regs}", f"c{b.consumer_warpgroups}r{b.consumer_regs}",
                        f"s{b.stages}" + ("tma" if b.copy is CopyVia.TMA else ""), b.dq.value]
    parts += [f"w{b.warps}", f"s{b.stages}"]
    if b.mma is Mma.WGMMA:
        parts.append("wgmma")
    if b.order is LoopOrder.KV_OUTER:
        parts.append(b.dq.value)
    return parts


def spec_fields() -> list[str]:
    """Names of every Problem and Schedule field (for docs and tests)."""
    return [f.name for f in fields(Problem)] + [f.name for f in fields(Schedule)]
