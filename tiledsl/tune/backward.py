"""`tiledsl tune` over backward spaces: a spec whose `backward { }` block has `in {...}` choices.

    space ──expand──► members ──lower_backward (layout pass)──► buildable (else illegal, with the reason)
          ──nvcc -Xptxas -v of the main kernel (threads, tune/search.py's disk cache)──► registers, spills
          ──rank (heavy spills last, then larger tiles, more warps)──► best `budget` kept
          ──BackwardKernel (NVRTC)──► float64 reference check on a small shape──► timed (bench.time_ms)

The forward tuner's machinery does the rest: tune/search.py's Candidate / Workbench (GPU, toolchain),
its search loop (run_trials, with the backward's Trial) and check verdict (judge, CHECK_TOLERANCE), the
store (tune/store.py TuneStore, keys with "pass": "backward"), cli/tune.py's table. The rank is a
heuristic, not a time model (tune_model is the forward's): on the GPU every kept member is timed.
`stored_backward(store, spec, shape, gpu, toolchain)` reads a measurement back for the backward
table (backward.BACKWARD_TUNED). The CPU half (to the rank) runs without a GPU: `--dry-run`.
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import time

from ..codegen import nvcc
from ..frontend.space import SpecSpace
from ..frontend.check_backward import PREFIX
from ..errors import SpecError
from ..lower.backward import lower_backward
from ..codegen.render import render
from ..spec import KernelSpec, Mask
from .search import CHECK_SHAPE, Candidate, Progress, TuneResult, Trial, judge, nvcc_available, run_trials
from ..schedule.cost import Shape
from .store import TuneStore, entry_key

SPILL_LIMIT = 64              # bytes of spill stores + loads per thread the rank tolerates (see _rank_key)
FLOPS_PER_FORWARD = 2.5       # backward FLOPs = 2.5 x the forward's (bench/backward_*.py, PEERS.md)


def is_backward_space(space: SpecSpace) -> bool:
    """The space's choices are inside `backward { }` (forward choices make it a forward search)."""
    return space.backward and any(name.startswith(PREFIX) for name, _ in space.choices)


def label(c: Candidate) -> str:
    b = c.spec.backward
    return f"backward q{b.tile_q} kv{b.tile_kv} w{b.warps} s{b.stages} {b.dq.value}"


def backward_flops(spec: KernelSpec, shape: Shape) -> float:
    p = spec.problem
    pairs = shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_kv
    return FLOPS_PER_FORWARD * 2.0 * pairs * (p.head_dim_qk + p.head_dim_v) * (0.5 if p.mask is Mask.CAUSAL else 1.0)


def _main_resources(spec: KernelSpec, arch: str):
    """ptxas's resources of the main kernel, or None when nvcc fails."""
    plan = lower_backward(spec)
    try:
        return nvcc.resources(render(plan), plan.kernel_names["main"], arch)
    except (OSError, RuntimeError):
        return None


def _rank_key(c: Candidate, limits):
    """Members spilling more than SPILL_LIMIT last; then larger tiles (per q step: fewer dQ atomics and
    Q, dO reads per FLOP), more warps, more resident warps per SM. (On the H200 the fastest members,
    d64 q128 kv128 w8 and d128 q64 kv128 w8, sit at 255 registers with 8-24 bytes of spills.)"""
    r, b, plan = c.resources, c.spec.backward, lower_backward(c.spec)
    threads = plan.launch.threads
    regs = r.registers if r else plan.register_estimate
    blocks = min(limits.registers_per_sm // max(regs * threads, 1),
                 limits.shared_per_sm // max(plan.launch.smem_bytes, 1))
    spills = (r.spill_stores + r.spill_loads) if r else 0
    return (spills > SPILL_LIMIT, -b.tile_q * b.tile_kv, -b.warps, -blocks * threads, c.name)


def plan_backward_candidates(space: SpecSpace, shape: Shape, limits=None, arch: str = "sm_90a",
                             budget: int | None = None, exhaustive: bool = False, use_nvcc: bool = True,
                             progress: bool = False) -> tuple[list[Candidate], list[tuple[dict, str]], int]:
    """(candidates, the space's rejections, the budget): statuses illegal (layout pass), pruned
    (over budget) or pending (to time); model_rank is the heuristic rank. Members that differ only in
    forward settings share one backward module: the first is kept."""
    from ..device_limits import H200
    limits = limits or H200
    legal, rejected = space.expand()
    candidates, seen, buildable = [], set(), []
    for spec in legal:
        if spec.backward in seen:
            continue
        seen.add(spec.backward)
        c = Candidate(spec)
        candidates.append(c)
        try:
            lower_backward(spec)
        except SpecError as err:
            c.status, c.reason = "illegal", err.message
            continue
        buildable.append(c)
    if use_nvcc and nvcc_available() and buildable:
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 2)) as pool:
            futures = {pool.submit(_main_resources, c.spec, arch): c for c in buildable}
            bar = Progress(len(futures), enabled=progress)
            for f in concurrent.futures.as_completed(futures):
                futures[f].resources = f.result()
                bar.done += 1
                bar.update(f"ptxas {futures[f].name}", None)
            bar.finish()
    ranked = sorted(buildable, key=lambda c: _rank_key(c, limits))
    if budget is None:
        budget = max(1, math.ceil(0.5 * len(ranked)))   # backward spaces are small: time half by default
    if exhaustive:
        budget = len(ranked)
    for i, c in enumerate(ranked):
        c.model_rank = i + 1
        if i >= budget:
            c.status, c.reason = "pruned", f"rank {i + 1} > budget {budget}"
    return candidates, rejected, budget


def store_key(spec: KernelSpec, shape: Shape, gpu: str, toolchain: dict) -> str:
    return entry_key({"config_hash": spec.config_hash, "pass": "backward"}, shape.key(), gpu, toolchain)


def stored_backward(store: TuneStore, spec: KernelSpec, shape: Shape, gpu: str, toolchain: dict) -> dict | None:
    """The stored measurement of `spec`'s backward module on `shape` (None when not tuned there)."""
    return store.get(store_key(spec, shape, gpu, toolchain))


# ---- the GPU half ---------------------------------------------------------------------------------

def reference_grads(spec: KernelSpec, q, k, v, do):
    """(o, lse, dq, dk, dv) in float64 torch tensors by autograd of standard attention (the mask and
    scale of spec.problem; none, causal or window, bottom-right aligned)."""
    import torch
    p = spec.problem
    q, k, v, do = (x.double().detach().requires_grad_(True) for x in (q, k, v, do))
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = p.scale * q @ ke.transpose(-1, -2)
    rows = torch.arange(q.shape[2], device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    diag = k.shape[2] - q.shape[2]
    visible = torch.ones_like(s[0, 0], dtype=torch.bool)
    if p.mask is Mask.CAUSAL:
        visible = cols <= rows + diag
    elif p.mask is Mask.WINDOW:
        visible = (cols >= rows + diag - p.window_left) & (cols <= rows + diag + p.window_right)
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # a fully masked row: zeros, never NaN
    e = torch.exp(s - m) * visible
    total = e.sum(-1, keepdim=True)
    o = (e / total.clamp_min(1e-300)) @ ve
    lse = torch.where(total[..., 0] > 0, m[..., 0] + torch.log(total[..., 0]),
                      torch.full_like(m[..., 0], float("-inf")))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), lse.detach(), dq, dk, dv


def check_backward(kernel) -> tuple[bool, dict, str]:
    """(correct?, {dq, dk, dv: relative error}, why) of a BackwardKernel on CHECK_SHAPE (fresh
    random inputs, O and LSE from the float64 reference)."""
    import torch
    from ..runtime.tensors import torch_dtype
    p = kernel.spec.problem
    dtype = torch_dtype(p.dtype)
    batch, heads, n = CHECK_SHAPE
    q, k, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype)
                for d in (p.head_dim_qk, p.head_dim_qk, p.head_dim_v))
    v = torch.randn(batch, heads, n, p.head_dim_v, device="cuda", dtype=dtype)
    try:
        o, lse, *ref = reference_grads(kernel.spec, q, k, v, do)
        out = kernel(q, k, v, o.to(dtype), lse.float(), do)
        torch.cuda.synchronize()
    except Exception as err:
        return False, {}, f"check failed to run: {str(err).splitlines()[0][:200]}"
    errors = {}
    for name, x, r in zip(("dq", "dk", "dv"), out, ref):
        x = x.double()
        errors[name] = float((x - r).norm() / (r.norm() or 1.0)) if bool(torch.isfinite(x).all()) else math.inf
    return judge(errors)


def time_backward_ms(kernel, shape: Shape, o_lse=None) -> float:
    """Median ms of one backward call (bench.time_ms) on random inputs of `shape`; O and LSE from
    the forward's shapes (their values do not change the work)."""
    import torch
    from .bench import time_ms
    from ..runtime.tensors import torch_dtype
    p = kernel.spec.problem
    dtype = torch_dtype(p.dtype)
    b, h, nq, nk = shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_kv
    q = torch.randn(b, h, nq, p.head_dim_qk, device="cuda", dtype=dtype)
    k = torch.randn(b, h, nk, p.head_dim_qk, device="cuda", dtype=dtype)
    v = torch.randn(b, h, nk, p.head_dim_v, device="cuda", dtype=dtype)
    do = torch.randn(b, h, nq, p.head_dim_v, device="cuda", dtype=dtype)
    o, lse = o_lse if o_lse is not None else (torch.randn_like(do), torch.randn(b, h, nq, device="cuda") + 8.0)
    fn = lambda: kernel(q, k, v, o, lse, do)   # noqa: E731
    fn()
    torch.cuda.synchronize()
    return time_ms(fn)


def tune_backward(space: SpecSpace, shape: Shape, budget: int | None = None, exhaustive: bool = False,
                  store: TuneStore | None = None, bench=None, progress: bool = True, fresh: bool = False) -> TuneResult:
    """Search a backward space on the GPU for `shape`: check every kept member against float64,
    time the correct ones, store the results; a wrong module never wins."""
    from ..runtime.backward import compile_backward
    from .search import Workbench
    started = time.time()
    bench = bench or Workbench()
    candidates, rejected, budget = plan_backward_candidates(space, shape, bench.limits, bench.arch, budget, exhaustive,
                                                            progress=progress)
    kernels = {}

    def build(cs):
        failed = {}
        for c in cs:
            try:
                kernels[c.name] = compile_backward(c.spec)
                kernels[c.name].functions()
            except Exception as err:   # a module that does not build is a failed candidate, not a crash
                failed[c.name] = f"compile: {str(err).splitlines()[0][:300]}"
        return failed
    trial = Trial(build, lambda c: check_backward(kernels[c.name]),
                  lambda c: time_backward_ms(kernels[c.name], shape), lambda c: backward_flops(c.spec, shape),
                  lambda c: store_key(c.spec, shape, bench.gpu, bench.toolchain), {"pass": "backward"})
    return run_trials(space, shape, candidates, rejected, budget, bench, trial, store, progress, fresh, started)
