"""Benchmarks with the conventions of the FlashAttention papers (PEERS.md): bf16 forward,
16k total tokens, hidden 2048, FLOPs = 4 B H N^2 d (halved for causal), CUDA-event medians on
random normal inputs, peers (PyTorch SDPA flash and cuDNN backends) timed in the same run."""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

TOTAL_TOKENS, HIDDEN = 16384, 2048


def prefill_shape(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads) under the papers' convention."""
    return max(TOTAL_TOKENS // seqlen, 1), HIDDEN // head_dim


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops


def time_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench when present)."""
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        return _time_with_events(fn, rep_ms)


def _time_with_events(fn, rep_ms: int) -> float:
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    while sum(times) < rep_ms or len(times) < 5:
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    times.sort()
    return times[len(times) // 2]


def sdpa_peers(q, k, v, causal: bool, rep_ms: int = 100) -> dict:
    """Median ms of PyTorch SDPA's flash and cuDNN backends on the same tensors (None if absent)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except ImportError:
        return {}
    gqa = q.shape[1] != k.shape[1]
    results = {}
    for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                results[label] = time_ms(fn, rep_ms=rep_ms)
        except Exception as err:   # a backend that refuses the shape is recorded as missing
            results[label] = None
            results[label + "_error"] = str(err).splitlines()[0][:200]
    return results


def gpu_name() -> str:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    except Exception:
        return "unknown"


def git_commit() -> str:
    """HEAD's hash; TILEDSL_COMMIT overrides (the GPU machine gets a copy of the tree without .git)."""
    import os
    if os.environ.get("TILEDSL_COMMIT"):
        return os.environ["TILEDSL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def record(path: Path, command: str, rows: list[dict], **extra) -> dict:
    """Write one benchmark run as JSON (date, GPU, commit, command, rows) and return it."""
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": gpu_name(), "commit": git_commit(), "host": platform.node(), "command": command,
              **extra, "rows": rows}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def random_inputs(problem, batch: int, heads: int, q_len: int, kv_len: int, kv_heads: int | None = None):
    """Fresh normal(0, 1) q, k, v on the GPU: PyTorch tensors when PyTorch is installed (bf16
    needs it: CuPy has no bfloat16), else CuPy fp16 arrays."""
    from ..spec import DType
    kv_heads = kv_heads or heads
    shapes = [(batch, heads, q_len, problem.head_dim_qk), (batch, kv_heads, kv_len, problem.head_dim_qk),
              (batch, kv_heads, kv_len, problem.head_dim_v)]
    try:
        import torch
        from ..runtime.tensors import torch_dtype
        return tuple(torch.randn(s, device="cuda", dtype=torch_dtype(problem.dtype)) for s in shapes)
    except ImportError:
        import cupy
        if problem.dtype is not DType.FP16:
            from ..errors import RuntimeInputError
            raise RuntimeInputError(f"{problem.dtype.value} inputs need PyTorch installed (CuPy has no bfloat16)")
        return tuple(cupy.random.standard_normal(s, dtype=cupy.float32).astype(cupy.float16) for s in shapes)


def shuffled_pages(k, v, page: int):
    """K, V (batch, kv heads, n, d) torch tensors in `page`-key pages placed in random order, as a paged cache holds
    them: (k_cache, v_cache (pages, page, kv heads, d), block_table int32 (batch, pages per sequence))."""
    import torch
    batch, kv_heads, n, d = k.shape
    per_seq = -(-n // page)
    order = torch.randperm(batch * per_seq, device=k.device)

    def cache(x):
        padded = torch.zeros(batch, kv_heads, per_seq * page, d, device=x.device, dtype=x.dtype)
        padded[:, :, :n] = x
        blocks = padded.transpose(1, 2).reshape(batch * per_seq, page, kv_heads, d)
        out = torch.empty_like(blocks)
        out[order] = blocks
        return out
    return cache(k), cache(v), order.view(batch, per_seq).to(torch.int32)


def patch_source(kernel, patches) -> None:
    """Apply (old, new) text patches to `kernel.source` (A/B experiments on generated CUDA). Each
    `old` must occur exactly once: a patch whose target is gone raises instead of timing the
    unpatched kernel twice."""
    for old, new in patches:
        found = kernel.source.count(old)
        if found != 1:
            raise ValueError(f"{kernel.name}: patch target found {found} times (want 1), the generated CUDA "
                             f"has changed; update or drop the patch:\n{old}")
        kernel.source = kernel.source.replace(old, new)
