"""What a ring will cost, before it runs: per-rank work, bytes each rank sends per step and, per step, the
compute time of the slowest rank's block (the tune model, schedule/cost.py, on the kernel tiledsl.attention
would run for that block) against the link time of the shard in flight (bytes / link bandwidth). A step takes
the larger of the two, since the shard for the next step travels while the block computes: where compute is
larger the link is hidden with that much to spare (the overlap budget); where the link is larger the ring is
link-bound and more ranks only add waiting.

    print(explain_ring(131072, 8, heads=32, kv_heads=8, head_dim=128, causal=True).text())

The tune model prices the forward kernels; a block's backward is taken as FLOPS_PER_FORWARD (2.5) times
its forward's FLOPs at the forward's rate, which is optimistic for the backward kernels (they run at a lower
rate than the forward), so a backward step predicted compute-bound is at least that. The merge and the dQ /
dK / dV accumulation are priced as HBM traffic."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from ..device_limits import H200, DeviceLimits
from ..spec import DTYPE_BYTES, DType, Mask
from .shards import chunk_length, chunks_per_rank, check_layout
from .steps import BACKWARD, FORWARD, step_blocks

ACCUMULATOR_BYTES = 4   # the fp32 O, LSE, dQ, dK, dV sums; dK, dV also travel in fp32


@dataclass(frozen=True)
class StepCost:
    step: int
    blocks: str            # the ranks' blocks, "queries x keys mask", distinct ones joined by " | "
    compute_ms: float      # the slowest rank's block, its merge / accumulation included
    link_ms: float         # the shards in flight during this step, one way
    sent_bytes: int        # per rank

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.link_ms)

    @property
    def budget_ms(self) -> float:
        """compute - link: > 0 the link is hidden with this to spare, < 0 the step waits this long for it."""
        return self.compute_ms - self.link_ms

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.link_ms else "link"


@dataclass(frozen=True)
class RingExplanation:
    seqlen: int
    ranks: int
    layout: str
    causal: bool
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    link_bytes_per_s: float
    kernels: tuple[str, ...]          # the block kernels (forward), by mask
    pairs_per_rank: tuple[int, ...]   # forward (query, key) pairs each rank computes over all steps
    forward: tuple[StepCost, ...]
    backward: tuple[StepCost, ...]
    backward_tail_ms: float           # the last dK/dV hop home, after the last block: nothing to hide it
    single_forward_ms: float          # the whole sequence on one GPU, same kernels and model
    single_backward_ms: float

    @property
    def forward_ms(self) -> float:
        return sum(s.ms for s in self.forward)

    @property
    def backward_ms(self) -> float:
        return sum(s.ms for s in self.backward) + self.backward_tail_ms

    def efficiency(self, direction: str) -> float:
        """Scaling efficiency: one GPU's time / (ranks x the ring's time)."""
        single, ring = ((self.single_forward_ms, self.forward_ms) if direction == "forward"
                        else (self.single_backward_ms, self.backward_ms))
        return single / (self.ranks * ring) if ring else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("forward", "backward"):
            out[name] = [{**asdict(s), "ms": s.ms, "budget_ms": s.budget_ms, "bound": s.bound}
                         for s in getattr(self, name)]
        out |= {"forward_ms": self.forward_ms, "backward_ms": self.backward_ms,
                "forward_efficiency": self.efficiency("forward"), "backward_efficiency": self.efficiency("backward")}
        return out

    def text(self) -> str:
        local = self.seqlen // self.ranks
        per = chunks_per_rank(self.layout)
        lines = [f"ring attention: {self.ranks} ranks, {self.layout}, {'causal' if self.causal else 'no mask'}; "
                 f"{self.seqlen} tokens, {local} per rank"
                 + (f" ({per} chunks of {local // per})" if per > 1 else "")
                 + f"; batch {self.batch}, heads {self.heads} (kv {self.kv_heads}), "
                 f"d {self.head_dim}/{self.head_dim_v}, {self.dtype}",
                 "block kernels (what tiledsl.attention runs): " + ", ".join(self.kernels),
                 f"link: {self.link_bytes_per_s / 1e9:.0f} GB/s one way",
                 ""]
        pairs = self.pairs_per_rank
        mean = sum(pairs) / len(pairs)
        lines.append(f"per-rank work (forward query-key pairs): min {min(pairs):.3g}, max {max(pairs):.3g}, "
                     f"max / mean {max(pairs) / mean:.2f}" + ("  <- the slowest rank sets every step's pace"
                                                              if max(pairs) / mean > 1.05 else ""))
        for name, steps, tail in (("forward", self.forward, 0.0), ("backward", self.backward, self.backward_tail_ms)):
            lines += ["", f"{name:<10} {'blocks (queries x keys mask)':<44} {'compute ms':>10} {'link ms':>8} "
                      f"{'sent MB':>8} {'budget ms':>10}  bound"]
            for first, last, s in _runs(steps):
                label = f"step {first}" if first == last else f"steps {first}-{last}"
                lines.append(f"  {label:<10} {s.blocks:<42} {s.compute_ms:>10.3f} {s.link_ms:>8.3f} "
                             f"{s.sent_bytes / 1e6:>8.1f} {s.budget_ms:>+10.3f}  {s.bound}")
            if tail:
                lines.append(f"  {'last dK/dV hop home (not hidden)':<53} {0.0:>10.3f} {tail:>8.3f}")
            single = self.single_forward_ms if name == "forward" else self.single_backward_ms
            ring = self.forward_ms if name == "forward" else self.backward_ms
            bound = sum(s.ms for s in steps if s.bound == "link")
            lines.append(f"  ring {ring:.3f} ms; one GPU {single:.3f} ms, so {self.ranks} at best "
                         f"{single / self.ranks:.3f} ms: scaling efficiency {self.efficiency(name):.2f}"
                         + (f"; link-bound steps take {bound:.3f} ms" if bound else "; compute-bound"))
        return "\n".join(lines) + "\n"


def _runs(steps):
    """(first step, last step, cost) for runs of consecutive steps that cost the same."""
    out = []
    for s in steps:
        if out and (out[-1][2].blocks, round(out[-1][2].compute_ms, 6), round(out[-1][2].link_ms, 6)) == (
                s.blocks, round(s.compute_ms, 6), round(s.link_ms, 6)):
            out[-1] = (out[-1][0], s.step, out[-1][2])
        else:
            out.append((s.step, s.step, s))
    return out


@functools.lru_cache(maxsize=None)
def _block_spec(arch: str, dtype: DType, head_dim: int, head_dim_v: int, causal: bool):
    from ..dispatch.tuned import tuned_spec
    spec, _ = tuned_spec(arch, dtype, head_dim, Mask.CAUSAL if causal else Mask.NONE, head_dim_v)
    return spec


@functools.lru_cache(maxsize=None)
def forward_ms(arch: str, dtype: DType, head_dim: int, head_dim_v: int, causal: bool, batch: int, heads: int,
               queries: int, keys: int, limits: DeviceLimits = H200) -> float:
    """The tune model's time of the forward kernel tiledsl.attention runs on one block."""
    from ..families import layout_of
    from ..schedule.cost import Resources, Shape, predict
    spec = _block_spec(arch, dtype, head_dim, head_dim_v, causal)
    layout = layout_of(spec)
    resources = Resources(layout.register_estimate, smem_bytes=layout.smem_bytes, threads=layout.threads,
                          q_in_registers=layout.q_in_registers)
    return predict(spec, Shape(batch, heads, queries, keys), resources, limits).time_ms


def explain_ring(seqlen: int, ranks: int, heads: int, head_dim: int, kv_heads: int | None = None,
                 head_dim_v: int | None = None, batch: int = 1, dtype: str | DType = "bf16", causal: bool = True,
                 layout: str = "zigzag", link_bytes_per_s: float | None = None, limits: DeviceLimits = H200,
                 arch: str = "sm_90a") -> RingExplanation:
    """The cost of ring_attention on `ranks` GPUs over `seqlen` tokens in total (see the module docstring).
    `link_bytes_per_s` defaults to the GPU's peak one-way link bandwidth (limits.link_bytes_per_s)."""
    from ..tune.backward import FLOPS_PER_FORWARD
    check_layout(layout)
    dtype = DType(dtype) if isinstance(dtype, str) else dtype
    kv_heads, head_dim_v = kv_heads or heads, head_dim_v or head_dim
    if ranks < 1 or heads % kv_heads:
        raise ValueError(f"explain_ring: need ranks >= 1 and heads a multiple of kv_heads, got {ranks}, "
                         f"{heads}/{kv_heads}")
    chunk_length(seqlen, ranks, layout, "explain_ring")
    link = link_bytes_per_s or limits.link_bytes_per_s
    if not link > 0:
        raise ValueError(f"explain_ring: {limits.name} has no link bandwidth on record; pass link_bytes_per_s")
    local, e = seqlen // ranks, DTYPE_BYTES[dtype]
    hbm = limits.hbm_bytes_per_s or H200.hbm_bytes_per_s
    kv_bytes = batch * kv_heads * local * (head_dim + head_dim_v) * e
    dkv_bytes = batch * kv_heads * local * (head_dim + head_dim_v) * ACCUMULATOR_BYTES

    def block_ms(b, direction):
        if b is None:
            return 0.0
        ms = forward_ms(arch, dtype, head_dim, head_dim_v, b.causal, batch, heads, b.queries, b.keys, limits)
        if direction == FORWARD:   # merge: read the block's O and LSE, read and write the fp32 O and LSE
            moved = batch * heads * b.queries * (head_dim_v * (e + 2 * ACCUMULATOR_BYTES) + 3 * ACCUMULATOR_BYTES)
            return ms + moved / hbm * 1e3
        # dQ, dK, dV of the block added into the fp32 sums (read block, read and write the sum)
        moved = batch * (heads * b.queries * head_dim + kv_heads * b.keys * (head_dim + head_dim_v)) * (
            e + 2 * ACCUMULATOR_BYTES)
        return FLOPS_PER_FORWARD * ms + moved / hbm * 1e3

    def steps(direction):
        out = []
        for step in range(ranks):
            blocks = step_blocks(ranks, local, layout, causal, step, direction)
            sent = kv_bytes if step + 1 < ranks else 0
            if direction == BACKWARD and ranks > 1:
                sent += dkv_bytes if step > 0 else 0   # the previous step's sums travel during this one
            names = " | ".join(dict.fromkeys(b.describe() if b else "idle" for b in blocks))
            out.append(StepCost(step, names, max(block_ms(b, direction) for b in blocks), sent / link * 1e3, sent))
        return tuple(out)

    pairs = [0] * ranks
    for step in range(ranks):
        for r, b in enumerate(step_blocks(ranks, local, layout, causal, step)):
            pairs[r] += b.pairs if b else 0
    single = forward_ms(arch, dtype, head_dim, head_dim_v, causal, batch, heads, seqlen, seqlen, limits)
    kernels = [_block_spec(arch, dtype, head_dim, head_dim_v, c).kernel_name for c in ((False, True) if causal
                                                                                       else (False,))]
    return RingExplanation(seqlen, ranks, layout, causal, batch, heads, kv_heads, head_dim, head_dim_v, dtype.value,
                           link, tuple(kernels), tuple(pairs), steps(FORWARD), steps(BACKWARD),
                           dkv_bytes / link * 1e3 if ranks > 1 else 0.0, single, FLOPS_PER_FORWARD * single)
