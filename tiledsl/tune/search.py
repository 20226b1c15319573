"""Schedule search: enumerate a space, prune with the model, compile, check, time, rank.

    space ──expand──► legal configs ──passes──► buildable configs
          ──nvcc -Xptxas -v (threads) or the plan's estimate──► registers, spills
          ──tune_model.predict──► predicted time; hopeless ones dropped; best `budget` kept
          ──NVRTC (threads)──► modules ──float64 reference check──► correct ones
          ──CUDA events, median, fresh inputs > L2──► measured; the fastest correct one wins

A wrong kernel never wins: a config that fails its check is excluded (and remembered as failed
in the store). Measurements go to the store (tune/store.py) and a re-run answers from it.
The CPU half (everything up to the predictions, and `spec_to_dsl`) runs without a GPU.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..codegen import nvcc
from ..schedule import cost as tune_model
from ..frontend.space import SpecSpace
from ..device_limits import H200, DeviceLimits
from ..errors import SpecError
from ..families import compile as compile_kernel, lower
from ..schedule.cost import Resources
from ..schedule.passes import run_passes
from ..codegen.render import render
from ..spec import Family, KernelSpec, Mask, Mma, SeqLayout
from ..runtime.tensors import torch_dtype
from ..schedule.traffic import hbm_traffic
from ..schedule.cost import Prediction, Shape
from .store import TuneStore, entry_key

CHECK_SHAPE = (1, 2, 257)               # batch, heads, seqlen of both tuners' correctness check
# What a checked output may be off by: normwise relative error of O and of the backward's dQ, dK, dV
# against float64 (the GPU tests'); LSE: max |LSE - ref|.
CHECK_TOLERANCE = {"o": 1e-2, "lse": 1e-3, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2}


def judge(errors: dict) -> tuple[bool, dict, str]:
    """(correct?, errors, why) of a check's errors against CHECK_TOLERANCE (a NaN error is wrong)."""
    bad = [f"{key} error {e:.2e} > {CHECK_TOLERANCE[key]:g}" for key, e in errors.items()
           if not e <= CHECK_TOLERANCE[key]]
    return not bad, errors, "wrong result: " + ", ".join(bad) if bad else ""
MIN_INPUT_SETS = 3                      # rotate through at least this many input sets when timing


# ---- printing a KernelSpec back as DSL ------------------------------------------------------------

def spec_to_dsl(spec: KernelSpec, name: str | None = None, comment: str = "") -> str:
    """`spec` as an attention block that parses back to an equal KernelSpec (every schedule
    setting written out, so the file does not depend on the defaults)."""
    p, s = spec.problem, spec.schedule
    lines = [f"# {line}".rstrip() for line in comment.splitlines()] if comment else []
    lines += [f"attention {name or spec.name} {{", f"    head_dim = {p.head_dim_qk}"]
    if p.head_dim_v != p.head_dim_qk:
        lines.append(f"    head_dim_v = {p.head_dim_v}")
    lines.append(f"    dtype    = {p.dtype.value}")
    mask = f"window(left = {p.window_left}, right = {p.window_right})" if p.mask is Mask.WINDOW else p.mask.value
    terms = p.mods.mask_terms()   # the modifications' mask terms join the mask with `&`
    if terms:
        mask = " & ".join(([mask] if p.mask is not Mask.NONE else []) + terms)
    lines.append(f"    mask     = {mask}")
    lines += [f"    {line}" for line in p.mods.dsl_lines()]
    if p.softmax_scale is not None:
        lines.append(f"    scale    = {p.softmax_scale!r}")
    if p.queries_per_seq is not None:
        lines.append(f"    queries  = {p.queries_per_seq}")
    if p.kv_page_size is not None:   # serving layouts: written only when set, as the DSL reads them
        lines.append(f"    kv_cache = paged(page = {p.kv_page_size})")
    if p.seq_layout is not SeqLayout.BATCHED:
        lines.append(f"    layout   = {p.seq_layout.value}")
    if p.kv_dtype is not None:   # an FP8 KV cache
        lines += [f"    kv_dtype = {p.kv_dtype.value}", f"    kv_scale = {p.kv_scale.value}"]
    if p.out_dtype is not None:   # FP8 attention's output and descales (their defaults are left out)
        lines.append(f"    out_dtype = {p.out_dtype.value}")
    if p.descale is not None:
        lines.append(f"    descale = {p.descale.value}")
    lines += ["    schedule {", f"        order    {s.order.value}",
              f"        tile     q = {s.tile_q}, kv = {s.tile_kv}"]
    if spec.family is Family.HOPPER:
        lines.append(f"        warpgroups producer {s.producer_warpgroups} regs {s.producer_regs}, "
                     f"consumer {s.consumer_warpgroups} regs {s.consumer_regs}")
    else:
        lines.append(f"        warps    {s.warps} along {s.warp_axis.value}")
    lines.append(f"        pipeline {s.stages} stage{'s' if s.stages != 1 else ''} via {s.copy.value}")
    if s.mma is not Mma.SYNC and spec.family is not Family.HOPPER:   # hopper: wgmma is its only instruction
        lines.append(f"        mma      {s.mma.value}")
    flags = [flag for flag, on in (("pingpong", s.pingpong), ("intra", s.intra_overlap)) if on]
    if flags:
        lines.append(f"        overlap  {', '.join(flags)}")
    if s.launch is not None:   # unset: the runtime's choice
        lines.append(f"        launch   {s.launch.value}" + (f" order {s.item_order.value}" if s.item_order else ""))
    if s.split_kv != 1:
        lines.append(f"        split    kv = {s.split_kv}")
    if s.fp8_convert is not None:
        lines.append(f"        dequant  {s.fp8_convert}")
    lines.append("    }")
    b = spec.backward
    if b is not None:   # every backward setting written out, as the schedule's
        via = f" via {b.copy.value}" if b.warp_specialized else ""
        lines += ["    backward {", f"        order    {b.order.value}",
                  f"        tile     q = {b.tile_q}, kv = {b.tile_kv}",
                  f"        warps    {b.warps}",
                  f"        pipeline {b.stages} stage{'s' if b.stages != 1 else ''}{via}",
                  f"        mma      {b.mma.value}", f"        dq accumulate {b.dq.value}"]
        if b.warp_specialized:
            lines.append(f"        warpgroups producer {b.producer_warpgroups} regs {b.producer_regs}, "
                         f"consumer {b.consumer_warpgroups} regs {b.consumer_regs}")
        lines.append("    }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- the CPU half: space -> predictions -----------------------------------------------------------

def with_mask(space: SpecSpace, causal: bool | None) -> SpecSpace:
    """The space with its mask overridden: True -> causal, False -> none, None -> as written.
    A window space can't be overridden (its sizes would be lost): a SpecError."""
    if causal is None:
        return space
    if space.problem.mask is Mask.WINDOW:
        span = dict(space.spans).get("mask", space.span)
        raise SpecError("--causal/--no-causal would drop this space's window mask", span, space.source_text,
                        "leave the flag out to tune the window mask as written")
    mask = Mask.CAUSAL if causal else Mask.NONE
    return dataclasses.replace(space, problem=dataclasses.replace(space.problem, mask=mask))


@dataclass
class Candidate:
    """One legal config and everything the tuner learns about it."""
    spec: KernelSpec
    resources: Resources | None = None
    prediction: Prediction | None = None
    model_rank: int | None = None          # 1 = predicted fastest; None for hopeless/illegal
    status: str = "pending"                # illegal | hopeless | pruned | stored | timed | failed
    reason: str = ""
    ms: float | None = None
    tflops: float | None = None
    errors: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.kernel_name


def nvcc_available() -> str | None:
    return nvcc.nvcc_path() if not os.environ.get("TILEDSL_NO_NVCC") else None


def ptxas_report(spec: KernelSpec, arch: str) -> tuple[int, int, int] | None:
    """(registers, spill stores, spill loads) of `spec` compiled by nvcc for `arch`, or None when
    nvcc fails (the caller falls back to the estimate). Reports are cached on disk by a sha256 of
    source, arch and nvcc version, so a re-run (or another shape) does not compile again."""
    from ..runtime.compile import cache_dir
    source = render(lower(spec))
    key = hashlib.sha256("\0".join([source, arch, nvcc.version()]).encode()).hexdigest()
    cached = cache_dir() / "ptxas" / f"{spec.kernel_name}-{key[:16]}.json"
    try:
        return tuple(json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    try:
        found = nvcc.resources(source, spec.kernel_name, arch)
    except (OSError, RuntimeError):
        return None
    report = (found.registers, found.spill_stores, found.spill_loads)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(list(report)))
        os.replace(tmp, cached)
    except OSError:   # a read-only cache only costs a recompile next time
        pass
    return report


def resources_of(specs: list[KernelSpec], arch: str = "sm_90a", jobs: int | None = None,
                 use_nvcc: bool = True, progress: bool = False) -> dict[str, Resources]:
    """Resources of each spec: ptxas's registers and spills when nvcc is there (compiled in
    parallel), else the plan's register estimate with no spills."""
    reports: dict[str, tuple[int, int, int] | None] = {}
    if use_nvcc and nvcc_available() and specs:
        with concurrent.futures.ThreadPoolExecutor(jobs or min(32, os.cpu_count() or 4)) as pool:
            futures = {pool.submit(ptxas_report, s, arch): s.kernel_name for s in specs}
            bar = Progress(len(futures), enabled=progress)   # ptxas takes seconds per config: show it
            for f in concurrent.futures.as_completed(futures):
                reports[futures[f]] = f.result()
                bar.done += 1
                bar.update(f"ptxas {futures[f]}", None)
            bar.finish()
    out = {}
    for spec in specs:
        plan = lower(spec)
        q_in_registers = bool(next((c.value for c in plan.constants if c.name == "Q_IN_REGISTERS"), True))
        report = reports.get(spec.kernel_name)
        regs, stores, loads = report if report else (plan.register_estimate, 0, 0)
        out[spec.kernel_name] = Resources(regs, stores, loads, plan.launch.smem_bytes, plan.launch.threads,
                                          q_in_registers, "ptxas" if report else "estimate")
    return out


def plan_candidates(space: SpecSpace, shape: Shape, limits: DeviceLimits = H200, arch: str = "sm_90a",
                    budget: int | None = None, exhaustive: bool = False,
                    use_nvcc: bool = True, progress: bool = False) -> tuple[list[Candidate], list[tuple[dict, str]],
                                                                            int]:
    """(candidates with predictions and statuses, the space's rejections, the budget used).
    Statuses: illegal (passes refuse it), hopeless (model), pruned (over budget), pending (to time)."""
    legal, rejected = space.expand()
    candidates = [Candidate(spec) for spec in legal]
    buildable = []
    for c in candidates:
        try:
            graph = run_passes(c.spec, limits)
            lower(c.spec, limits, graph=graph)
        except SpecError as err:
            c.status, c.reason = "illegal", err.message
            continue
        buildable.append((c, graph))
    resources = resources_of([c.spec for c, _ in buildable], arch, use_nvcc=use_nvcc, progress=progress)
    for c, graph in buildable:
        c.resources = resources[c.name]
        traffic = hbm_traffic(graph, shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_kv,
                              sm_count=limits.sm_count)
        c.prediction = tune_model.predict(c.spec, shape, c.resources, limits, hbm_bytes=traffic.bytes)
    predictions = [c.prediction for c, _ in buildable]
    if budget is None:
        budget = tune_model.default_budget(len(legal))
    if exhaustive:
        budget = len(buildable)
    chosen, dropped = tune_model.select(predictions, budget)
    by_name = {c.name: c for c, _ in buildable}
    for i, p in enumerate(tune_model.rank(predictions)):
        by_name[p.kernel].model_rank = i + 1
    for p, why in dropped:
        c = by_name[p.kernel]
        c.status, c.reason = ("hopeless" if p.hopeless else "pruned"), why
    if exhaustive:   # the exhaustive sweep is the ground truth: it times the hopeless ones too
        for c in by_name.values():
            c.status, c.reason = "pending", ""
    return candidates, rejected, budget


# ---- the GPU half ---------------------------------------------------------------------------------

class Workbench:
    """GPU state shared by tuning runs: compiled kernels and check results per spec, the device,
    its limits and the toolchain versions that key the store."""

    def __init__(self):
        from ..runtime.compile import compile_cubin
        from ..runtime.device import device_arch
        from .bench import gpu_name
        from ..device_limits import current_limits
        import cupy
        from cupy_backends.cuda.libs import nvrtc
        self.compile_cubin = compile_cubin
        self.arch = device_arch()
        self.limits = current_limits()
        self.gpu = gpu_name()
        self.toolchain = {"nvrtc": list(nvrtc.getVersion()), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                          "driver": cupy.cuda.runtime.driverGetVersion(), "arch": self.arch}
        self.kernels: dict[KernelSpec, object] = {}
        self.checks: dict[KernelSpec, tuple[bool, dict, str]] = {}

    def compile(self, specs: list[KernelSpec], jobs: int | None = None) -> dict[KernelSpec, str]:
        """Compile every spec not compiled yet (NVRTC in threads, then load on this thread);
        {spec: error message} for the ones that failed."""
        todo = [s for s in specs if s not in self.kernels]
        kernels = {s: compile_kernel(s) for s in todo}
        failed = {}
        with concurrent.futures.ThreadPoolExecutor(jobs or min(16, os.cpu_count() or 4)) as pool:
            futures = {pool.submit(self.compile_cubin, k.source, k.name, self.arch): s for s,
                       k in kernels.items()}
            for f in concurrent.futures.as_completed(futures):
                if f.exception() is not None:
                    failed[futures[f]] = str(f.exception()).splitlines()[0][:300]
        for spec, kernel in kernels.items():
            if spec in failed:
                continue
            try:
                kernel.function()   # the cubin is on disk now: this only loads it
                self.kernels[spec] = kernel
            except Exception as err:   # a module that does not load is a failed candidate, not a crash
                failed[spec] = str(err).splitlines()[0][:300]
        return failed

    def check(self, spec: KernelSpec) -> tuple[bool, dict, str]:
        """(correct?, errors, message): the kernel against the float64 reference on a small input,
        with the outputs poisoned by NaN first. Cached per spec."""
        if spec not in self.checks:
            self.checks[spec] = self._check(spec)
        return self.checks[spec]

    def _check(self, spec):
        from ..reference.gpu import lse_error, reference_attention, relative_error
        torch = _torch()
        batch, heads, n = CHECK_SHAPE
        p = spec.problem
        dtype = torch_dtype(p.dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(batch, heads, n, p.head_dim_qk, device="cuda", dtype=dtype, generator=gen)
                for _ in range(2))
        v = torch.randn(batch, heads, n, p.head_dim_v, device="cuda", dtype=dtype, generator=gen)
        out = torch.full((batch, heads, n, p.head_dim_v), float("nan"), device="cuda", dtype=dtype)
        lse = torch.full((batch, heads, n), float("nan"), device="cuda", dtype=torch.float32)
        try:
            self.kernels[spec](q, k, v, out=out, lse=lse)
            torch.cuda.synchronize()
            ref_o, ref_lse = reference_attention(p, q, k, v)
            errors = {"o": relative_error(out, ref_o), "lse": lse_error(lse, ref_lse)}
        except Exception as err:
            return False, {}, f"check failed to run: {str(err).splitlines()[0][:200]}"
        return judge(errors)

    def time_ms(self, spec: KernelSpec, shape: Shape) -> float:
        """Median ms of one launch on fresh random normal inputs, rotating through enough input
        sets that their bytes exceed twice the L2 (so no launch finds its inputs cached)."""
        from .bench import time_ms
        torch = _torch()
        kernel, p = self.kernels[spec], spec.problem
        dtype = torch_dtype(p.dtype)
        b, h, nq, nk = shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_kv
        set_bytes = 2 * b * h * (nq * p.head_dim_qk + nk * (p.head_dim_qk + p.head_dim_v) + nq * p.head_dim_v)
        sets = max(MIN_INPUT_SETS, math.ceil(2 * self.limits.l2_bytes / max(set_bytes, 1)))
        runs = []
        for _ in range(sets):
            q = torch.randn(b, h, nq, p.head_dim_qk, device="cuda", dtype=dtype)
            k = torch.randn(b, h, nk, p.head_dim_qk, device="cuda", dtype=dtype)
            v = torch.randn(b, h, nk, p.head_dim_v, device="cuda", dtype=dtype)
            o = torch.empty(b, h, nq, p.head_dim_v, device="cuda", dtype=dtype)
            lse = torch.empty(b, h, nq, device="cuda", dtype=torch.float32)
            runs.append((kernel.bind(q, k, v, out=o, lse=lse)[0], (q, k, v, o, lse)))   # checked once, launched per run

        def run_all():   # one call launches every set: the CPU stays ahead of the GPU
            for run, _ in runs:
                run()
        run_all()
        torch.cuda.synchronize()
        return time_ms(run_all) / sets


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError("tiledsl tune needs PyTorch on the GPU machine (bf16 inputs)") from None
    return torch


class Progress:
    """One line on stderr: `[#####-----] 5/8 timing <kernel>  best 312.1 TFLOP/s (<kernel>)`.
    On a terminal it redraws in place; elsewhere (logs) it prints a line per step."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.stream, self.enabled, self.done = total, stream or sys.stderr, enabled, 0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, what: str, best: tuple[str, float] | None) -> None:
        if not self.enabled:
            return
        width = 20
        filled = width * self.done // max(self.total, 1)
        best_text = f"  best {best[1]:.1f} TFLOP/s ({best[0]})" if best else ""
        line = f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total} {what}{best_text}"
        self.stream.write(("\r" + line[:160].ljust(160)) if self.tty else line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class TuneResult:
    space: str
    shape: Shape
    candidates: list[Candidate]
    rejected: list[tuple[dict, str]]
    budget: int
    gpu: str
    toolchain: dict
    seconds: float
    from_store: int
    timed: int

    @property
    def winner(self) -> Candidate | None:
        done = [c for c in self.candidates if c.status in ("timed", "stored") and c.tflops]
        return max(done, key=lambda c: (c.tflops, c.name)) if done else None

    @property
    def configs(self) -> int:
        return len(self.candidates) + len(self.rejected)


@dataclass(frozen=True)
class Trial:
    """How a tuner builds, checks and times its candidates (the forward's kernels, the backward's modules):
    `build(candidates)` -> {name: why it failed to build}, `check(c)` -> (correct?, errors, why),
    `time_ms(c)`, `flops(c)`; `key(c)` its store key; `fields` what each store entry adds."""
    build: Callable
    check: Callable
    time_ms: Callable
    flops: Callable
    key: Callable
    fields: dict = field(default_factory=dict)


def tune(space: SpecSpace, shape: Shape, budget: int | None = None, exhaustive: bool = False,
         store: TuneStore | None = None, bench: Workbench | None = None, progress: bool = True,
         fresh: bool = False) -> TuneResult:
    """Search `space` on the GPU for `shape`; see the module docstring for the steps."""
    started = time.time()
    bench = bench or Workbench()
    candidates, rejected, budget = plan_candidates(space, shape, bench.limits, bench.arch, budget, exhaustive,
                                                   progress=progress)

    def build(cs):
        failed = bench.compile([c.spec for c in cs])
        return {c.name: f"compile: {failed[c.spec]}" for c in cs if c.spec in failed}
    trial = Trial(build, lambda c: bench.check(c.spec), lambda c: bench.time_ms(c.spec, shape),
                  lambda c: tune_model.shape_flops(c.spec, shape),
                  lambda c: entry_key({"config_hash": c.spec.config_hash}, shape.key(), bench.gpu, bench.toolchain))
    return run_trials(space, shape, candidates, rejected, budget, bench, trial, store, progress, fresh, started)


def run_trials(space: SpecSpace, shape: Shape, candidates: list[Candidate], rejected: list, budget: int,
               bench: Workbench, trial: Trial, store: TuneStore | None, progress: bool, fresh: bool,
               started: float) -> TuneResult:
    """Both tuners' GPU half: the pending candidates' stored results (unless `fresh`), then every other
    one built, checked against float64 and, when correct, timed and stored; a wrong one never wins."""
    todo = [c for c in candidates if c.status == "pending"]
    keys = {c.name: trial.key(c) for c in todo}
    stored = 0
    if store is not None and not fresh:
        for c in todo:
            entry = store.get(keys[c.name])
            if entry is not None:
                stored += 1
                c.status = "stored" if entry.get("valid") else "failed"
                c.ms, c.tflops = entry.get("ms"), entry.get("tflops")
                c.errors, c.reason = entry.get("errors", {}), entry.get("error", "")
    to_time = [c for c in todo if c.status == "pending"]
    failed = trial.build(to_time)
    bar = Progress(len(to_time), enabled=progress)
    best = None
    winner = max((c for c in todo if c.status == "stored" and c.tflops), key=lambda c: c.tflops, default=None)
    if winner:
        best = (winner.name, winner.tflops)
    for c in to_time:
        bar.update(f"checking {c.name}", best)
        if c.name in failed:
            c.status, c.reason = "failed", failed[c.name]
        else:
            ok, c.errors, why = trial.check(c)
            if not ok:
                c.status, c.reason = "failed", why
            else:
                bar.update(f"timing {c.name}", best)
                c.ms = trial.time_ms(c)
                c.tflops = trial.flops(c) / c.ms / 1e9
                c.status = "timed"
                if best is None or c.tflops > best[1]:
                    best = (c.name, c.tflops)
        bar.done += 1
        if store is not None:
            store.put(keys[c.name], {"kernel": c.name, **trial.fields, "space": space.name, "shape": shape.key(),
                                     "gpu": bench.gpu, "valid": c.status == "timed", "ms": c.ms, "tflops": c.tflops,
                                     "errors": c.errors, "error": c.reason,
                                     "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    bar.update("done", best)
    bar.finish()
    if store is not None:
        store.save()
    return TuneResult(space.name, shape, candidates, rejected, budget, bench.gpu, bench.toolchain,
                      time.time() - started, stored, len(to_time))
