"""Helpers for GPU tests: skip without a GPU, build kernels once, run one validated case."""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest

TOLERANCE_O, TOLERANCE_LSE = 1e-2, 1e-3
# name -> (mask, window left, window right): the masks the prefill GPU tests sweep
MASKS = {"none": ("none", 0, 0), "causal": ("causal", 0, 0), "window": ("window", 100, 20)}


def check(errors):
    """(O error, LSE error) within the tolerances."""
    err_o, err_lse = errors
    assert err_o < TOLERANCE_O, f"O relative error {err_o}"
    assert err_lse < TOLERANCE_LSE, f"LSE error {err_lse}"


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU with CuPy")


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    from tiledsl import compile
    return compile(spec)


def run_case(spec, batch, heads, q_len, kv_len, kv_heads=None, layout="bhsd", kv_lens=None, order_groups=None):
    """Run `spec` on fresh normal inputs into NaN-poisoned outputs and return (O error, LSE error)
    against the float64 reference. layout "bshd" hands in (batch, seqlen, heads, dim) memory;
    order_groups overrides an FA2 kernel's launch order (None: its own choice)."""
    import torch
    from tiledsl.runtime.tensors import torch_dtype
    from tiledsl.reference.gpu import run_errors
    p = spec.problem
    dtype = torch_dtype(p.dtype)
    kv_heads = kv_heads or heads

    def make(h, n, d):
        if layout == "bshd":
            return torch.randn(batch, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(batch, h, n, d, device="cuda", dtype=dtype)
    q, k, v = make(heads, q_len, p.head_dim_qk), make(kv_heads, kv_len, p.head_dim_qk), make(kv_heads, kv_len, p.head_dim_v)
    lens = torch.tensor(kv_lens, device="cuda", dtype=torch.int32) if kv_lens is not None else None
    kernel = kernel_for(spec)
    kernel.order_groups = order_groups
    return run_errors(kernel, q, k, v, kv_lens=lens)


def memcheck(script) -> None:
    """Run `script` (a Python file) under compute-sanitizer memcheck from the repository root (skip
    when the tool is not on PATH); assert it exits 0 with no memory errors."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        # --report-api-errors no: cuda-bindings probes optional driver entry points (cuGetProcAddress) and
        # the failed probes are API errors, not memory errors; the other sanitizer tests pass it too.
        result = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
                                 "--error-exitcode", "9", sys.executable, str(script)],
                                capture_output=True, text=True, env=env, cwd=root, timeout=600)
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout


def poison_outputs(monkeypatch, value: float = float("nan")) -> None:
    """Every floating array a prepared call allocates (its outputs, scratch) starts as NaN (or `value`: a
    finite one where a test expects the kernel to write NaN), filled on the launch stream before the
    kernel: an element a kernel fails to write shows up. A workspace
    (CallBuilder.workspace's bytes) starts as all ones: NaN in its fp32 parts, -1 in its int32 ones.
    Prepared calls are rebuilt so that they allocate through the poisoning allocator (call
    `launch.clear_prepared()` again when the test is done)."""
    from tiledsl.runtime import launch
    real = launch.allocator

    def allocator(like, shape, dtype, zero=False):
        make = real(like, shape, dtype, zero)
        if zero or dtype == "int32":
            return make
        fill = 255 if dtype == "uint8" else value

        def poisoned():
            x = make()
            x.fill_(fill) if hasattr(x, "fill_") else x.fill(fill)
            return x
        return poisoned
    monkeypatch.setattr(launch, "allocator", allocator)
    launch.clear_prepared()


def refused_on_host_and_by_the_kernel(call, match: str, host_match: str | None = None) -> None:
    """`call(validate=...)` with a bad kv_lens / block-table entry: validate=True refuses it on the host before
    any launch (its message matching `host_match`, default `match`); left unchecked (validate=None) the kernel
    bounds it and check_errors() raises the entry, matching `match`."""
    import tiledsl
    from tiledsl.errors import RuntimeInputError
    with pytest.raises(RuntimeInputError, match=host_match or match):
        call(validate=True)
    call(validate=None)
    with pytest.raises(RuntimeInputError, match=match):
        tiledsl.check_errors()


@contextlib.contextmanager
def no_host_sync():
    """Any host synchronisation torch sees (a .item(), a device-to-host copy, a stream sync) raises."""
    import torch
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def float64(x):
    """A torch tensor's values as a float64 NumPy array on the host."""
    return x.detach().double().cpu().numpy()


def rel(out, ref) -> float:
    """Normwise relative error of a torch tensor against a float64 NumPy reference (inf where out is not finite)."""
    out = float64(out)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / (np.linalg.norm(ref) or 1.0))
