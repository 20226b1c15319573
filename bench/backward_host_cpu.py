"""The backward's host cost, stage by stage: tiledsl.attention's forward and backward through torch's autograd
engine on launch_bench's fwd_bwd shape (b1 h16 n128 d128 causal, bf16), from the prepared launches alone up to
the training step, beside the engine's floor (an autograd.Function with the same arguments that does no work).

Without --gpu (no GPU, no CuPy; a CPU build of torch is enough): the launches are stubbed (tests/host_stubs.py,
real_torch mode: host tensors stand in for GPU 0's, cuLaunchKernel records and returns), so what is timed is the
Python and torch work between the call and the launches. Each stage is the calling thread's CPU time
(time.thread_time: robust to other processes sharing the cores; the engine runs a CPU graph on the calling
thread), the least of 7 rounds of N calls (the stages take turns in each round). glibc is told to keep freed memory (mallopt), so a host allocation
reuses a block the way the caching allocator does instead of mapping fresh pages.

With --gpu: the same stages on the GPU (nothing stubbed), wall time per call of N back-to-back calls with one
sync at the end (the least of 7 rounds), SDPA cuDNN's step in the same run, and the steps again with the
engine's device threads off (torch.autograd.set_multithreading_enabled(False): the backward on the calling
thread, which is what --profile then sees).

    python bench/backward_host_cpu.py [--gpu] [--calls N] [--profile] [--family ws|wgmma] [OUT.json]

`--profile` prints cProfile's top entries of the forward + backward step.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = (1, 16, 128, 128)   # launch_bench's fwd_bwd row: b1 h16 n128 d128 causal
ROUNDS = 7


def keep_freed_host_memory() -> None:
    """glibc: serve every allocation from the heap and never give it back (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD),
    so a freed block is reused like the caching allocator's; elsewhere, nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def stages(make, torch, warp_specialized: bool, gpu: bool) -> dict:
    """name -> a no-argument warm call."""
    import tiledsl
    from tiledsl.dispatch import backward as dispatch_backward
    q, k, v, do = (make(SHAPE) for _ in range(4))
    o, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True)   # what the backward is given in training
    qg, kg, vg = (make(SHAPE).requires_grad_() for _ in range(3))
    options = {} if warp_specialized else {"warp_specialized": False}

    def step():
        out = tiledsl.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def step_backward():   # launch_bench's fwd_bwd row: gradients accumulated into .grad on the GPU
        if not gpu:   # where adding them would be the host's arithmetic, not a launch: stored afresh
            qg.grad = kg.grad = vg.grad = None
        tiledsl.attention(qg, kg, vg, causal=True).backward(do)

    class Nothing(torch.autograd.Function):
        """The engine's floor: EagerAttention's arguments and outputs, no work."""
        @staticmethod
        def forward(ctx, q, k, v, kv_lens, *scalars):
            o, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, o, lse, kv_lens)
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            return (grad_o, grad_o, grad_o) + (None,) * 8

    def floor():
        out, _ = Nothing.apply(qg, kg, vg, None, True, False, 0, 0, None, False, None)
        torch.autograd.grad(out, (qg, kg, vg), do)

    rows = {"forward, no grad": lambda: tiledsl.attention(q, k, v, causal=True),
            "attention_backward": lambda: tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, **options)}
    rows["attention_backward"]()
    call = next(reversed(dispatch_backward._calls.values()))
    rows["backward PreparedCall"] = lambda: call(q, k, v, o, lse, do, None)
    rows.update({"forward, autograd": lambda: tiledsl.attention(qg, kg, vg, causal=True),
                 "forward + autograd.grad": step, "forward + .backward()": step_backward,
                 "engine floor (empty Function)": floor})
    if gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        def cudnn_step():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            torch.autograd.grad(out, (qg, kg, vg), do)

        def on_calling_thread(fn):
            def run():
                with torch.autograd.set_multithreading_enabled(False):
                    fn()
            return run
        rows.update({"SDPA cuDNN forward + autograd.grad": cudnn_step,
                     "forward + autograd.grad, one thread": on_calling_thread(step),
                     "engine floor, one thread": on_calling_thread(floor),
                     "SDPA cuDNN step, one thread": on_calling_thread(cudnn_step)})
    return rows


def check_gradients(torch) -> None:
    """The GPU run's step computes the right gradients (float64 reference, fresh inputs) before it is timed."""
    import tiledsl
    from tests import attention_reference as ref
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    got = torch.autograd.grad(tiledsl.attention(q, k, v, causal=True), (q, k, v), do)
    want = ref.gradients(q, k, v, do, causal=True)[2:]
    errors = [ref.max_relative_error(g, w) for g, w in zip(got, want)]
    if not max(errors) < 2e-2:
        raise SystemExit(f"dQ, dK, dV errors {errors} against the float64 reference")


def time_stages(stages_by_name: dict, calls: int, sync) -> dict:
    """name -> (least CPU µs, least wall µs) per call over ROUNDS rounds of `calls` calls, `sync` after each
    round; the stages take turns within each round, so all of them see the same load on shared cores."""
    for call in stages_by_name.values():
        for _ in range(20):
            call()
    sync()
    cpu = {name: [] for name in stages_by_name}
    wall = {name: [] for name in stages_by_name}
    for _ in range(ROUNDS):
        for name, call in stages_by_name.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                call()
            sync()
            cpu[name].append((time.thread_time() - start_cpu) / calls * 1e6)
            wall[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: (min(cpu[name]), min(wall[name])) for name in stages_by_name}


def measure(calls: int, profile: bool, warp_specialized: bool, gpu: bool) -> list[dict]:
    import torch

    from tiledsl.dispatch import backward as dispatch_backward
    rows = []
    saved = dispatch_backward.BACKWARD_WS
    dispatch_backward.BACKWARD_WS = warp_specialized   # the family the autograd path takes by default
    with contextlib.ExitStack() as stack:
        if gpu:
            def make(shape, dtype="bfloat16"):
                return torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
            sync = torch.cuda.synchronize
            step_context = (lambda: torch.autograd.set_multithreading_enabled(False))
        else:
            from tests.host_stubs import stub_device
            keep_freed_host_memory()
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            make = stack.enter_context(stub_device(Path(tmp), real_torch=True)).tensor
            sync = (lambda: None)
            step_context = contextlib.nullcontext
        stack.callback(setattr, dispatch_backward, "BACKWARD_WS", saved)
        calls_by_stage = stages(make, torch, warp_specialized, gpu)
        if gpu:
            check_gradients(torch)
        for name, (cpu, wall) in time_stages(calls_by_stage, calls, sync).items():
            shown = f"{wall:8.1f} us/call wall" if gpu else f"{cpu:8.1f} us/call CPU"
            print(f"{name:38s} {shown}", flush=True)
            rows.append({"stage": name, "host_us": round(wall if gpu else cpu, 2), "calls": calls})
        kernel = next(reversed(dispatch_backward._calls.values())).name
        print(f"backward kernel: {kernel}")
        if profile:
            step = calls_by_stage["forward + autograd.grad"]
            profiler = cProfile.Profile()
            with step_context():
                profiler.enable()
                for _ in range(calls):
                    step()
                sync()
                profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    for row in rows:
        row.update(kernel=kernel, family="warp-specialized" if warp_specialized else "wgmma", dtype="bf16",
                   head_dim=SHAPE[3], seqlen=SHAPE[2], causal=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write the rows as JSON here")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--gpu", action="store_true", help="time on the GPU, nothing stubbed")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of the step")
    parser.add_argument("--family", choices=("ws", "wgmma"), default="ws",
                        help="the backward family the autograd path takes (warp-specialized or wgmma)")
    args = parser.parse_args(argv)
    rows = measure(args.calls, args.profile, args.family == "ws", args.gpu)
    if args.out:
        from tiledsl.tune.bench import record
        extra = {} if args.gpu else {"device": "CPU (launches stubbed, CPU torch)"}
        record(Path(args.out), " ".join(["python", *sys.argv]), rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
