"""GPU tests of the warp-specialized backward (templates/backward_ws.cu.j2; attention_backward(...,
warp_specialized=True)): dQ, dK, dV of fresh random inputs against float64 torch autograd of standard attention,
as test_gpu_backward.py does (its `run`, reference and tolerance), into outputs poisoned with NaN. Every mask;
seqlens 1, 17, 1000, 4097; q_len != kv_len both ways; GQA and MQA; kv_lens with 0; head dims 64, 128, 256 (and
96, 192 through attention_backward's other kernels with the switch on); fp16 and bf16; every dQ path (TMA
reduce-add, the writer's red.global.add, from registers, ordered); deterministic bits over repeated runs;
compute-sanitizer memcheck, racecheck and synccheck on small shapes; a wrong barrier count hangs and is caught by
a time limit. The modules are compiled in parallel first (NVRTC, disk cache), so the tests only load them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import replace

import pytest

from tests.gpu_support import requires_gpu
from tests.test_gpu_backward import MASKS, check, run

pytestmark = [pytest.mark.gpu, requires_gpu]

HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")


def run_ws(*args, **kwargs):
    return run(*args, warp_specialized=True, poison=True, **kwargs)


def variant_spec(d: int, dq: str, stages: int = 2, mask: str = "causal", dtype: str = "bf16"):
    """The table's schedule for head dim `d` with another dQ path (and ring depth)."""
    from tiledsl.dispatch.backward import BACKWARD_WS_TUNED
    from tiledsl.spec import DqAccumulate, DType, KernelSpec, Mask, Problem, Schedule
    m = {"none": Mask.NONE, "causal": Mask.CAUSAL, "window": Mask.WINDOW}[mask]
    window = MASKS[mask].get("window", (0, 0))
    problem = Problem(d, d, DType(dtype), m, window_left=window[0], window_right=window[1])
    b = replace(BACKWARD_WS_TUNED[d], dq=DqAccumulate(dq), stages=stages)
    return KernelSpec(f"ws_{d}_{dq}_{stages}", problem, Schedule(), backward=b)


def variant(*args, **kwargs):
    from tiledsl.dispatch.kernels import BACKWARD, kernel_for
    return kernel_for(variant_spec(*args, **kwargs), BACKWARD)


VARIANTS = [(128, "atomic", 2), (64, "atomic", 2), (256, "tma_reduce", 1), (256, "ordered", 1), (128, "ordered", 2)]
VARIANT_MASKS = ("causal", "window")


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every module these tests load, compiled by NVRTC in threads (cubins land in the disk cache)."""
    from concurrent.futures import ThreadPoolExecutor

    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.compile import compile_cubin
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    arch = device_arch()
    sources = {}
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            for mask, window in ((Mask.NONE, None), (Mask.CAUSAL, None), (Mask.WINDOW, MASKS["window"]["window"])):
                for det in (False, True):
                    spec = chosen_backward_spec(arch, DType(dtype), d, mask, None, window, None, det, None, True)
                    kernel = compile_backward(spec)
                    sources[kernel.name] = kernel.source
    for case in VARIANTS:
        for mask in VARIANT_MASKS:
            kernel = compile_backward(variant_spec(*case, mask=mask))
            sources[kernel.name] = kernel.source
    with ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(compile_cubin, src, name, arch) for name, src in sources.items()]:
            f.result()
    yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("seqlen", [1, 17, 1000])
def test_square(dtype, d, mask, seqlen):
    check(run_ws(dtype, d, q_len=seqlen, kv_len=seqlen, **MASKS[mask])[0])


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_long(d, mask):
    check(run_ws("bf16", d, batch=1, heads=1, q_len=4097, kv_len=4097, **MASKS[mask])[0])


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("q_len,kv_len", [(100, 333), (333, 100), (1, 200), (200, 1)])
def test_q_len_differs(d, mask, q_len, kv_len):
    check(run_ws("bf16", d, q_len=q_len, kv_len=kv_len, **MASKS[mask])[0])


@pytest.mark.parametrize("dtype,d", [("bf16", 64), ("fp16", 128), ("bf16", 256)])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1)])   # GQA, MQA
def test_gqa_and_mqa(dtype, d, mask, heads, kv_heads):
    check(run_ws(dtype, d, batch=2, heads=heads, kv_heads=kv_heads, q_len=150, kv_len=190, **MASKS[mask])[0])


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_kv_lens_including_zero(d, mask):
    errors, (dq, dk, dv) = run_ws("bf16", d, batch=4, heads=2, q_len=130, kv_len=300, kv_lens=[300, 0, 77, 1],
                                  **MASKS[mask])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()   # no key: zero gradients, not NaN
    assert not dk[2, :, 77:].any() and not dv[3, :, 1:].any()         # keys past kv_lens get none


def test_keys_past_kv_lens_never_reach_the_gradients():
    """K and V rows past a sequence's kv_len hold NaN: the kernel zeroes them on chip, so nothing turns NaN."""
    import torch
    from tiledsl.dispatch.backward import attention_backward
    from tests.test_gpu_backward import reference, rel
    torch.manual_seed(3)
    q, do = (torch.randn(2, 2, 100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([150, 77], device="cuda", dtype=torch.int32)
    o, lse, *grads = reference(q, k, v, do, causal=True, kv_lens=lens)
    k[0, :, 150:], v[0, :, 150:], k[1, :, 77:], v[1, :, 77:] = (float("nan"),) * 4
    out = attention_backward(q, k, v, o.bfloat16(), lse.float(), do, causal=True, kv_lens=lens, warp_specialized=True)
    check([rel(x, ref) for x, ref in zip(out, grads)])


@pytest.mark.parametrize("d,dq,stages", VARIANTS)
@pytest.mark.parametrize("mask", VARIANT_MASKS)
def test_every_dq_path(d, dq, stages, mask):
    kernel = variant(d, dq, stages, mask)
    assert kernel.plan.dq_path == {"atomic": "writer_red", "tma_reduce": "writer_tma", "ordered": "writer_tma"}[dq]
    check(run("bf16", d, batch=2, heads=4, kv_heads=2, q_len=300, kv_len=257, kernel=kernel, poison=True,
              **MASKS[mask])[0])


@pytest.mark.parametrize("dtype,d,mask", [("bf16", 128, "causal"), ("fp16", 64, "window"), ("bf16", 256, "none"),
                                          ("bf16", 64, "none"), ("fp16", 256, "causal")])
def test_deterministic_is_correct_and_bit_identical(dtype, d, mask):
    import torch
    shape = dict(batch=2, heads=4, kv_heads=2, q_len=700, kv_len=530, deterministic=True, **MASKS[mask])
    errors, first = run_ws(dtype, d, **shape)
    check(errors)
    for _ in range(3):
        again = run_ws(dtype, d, **shape)[1]
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_from_the_forward_kernel(mask):
    check(run_ws("bf16", 128, batch=2, heads=4, kv_heads=2, q_len=513, kv_len=513, from_forward=True,
                 **MASKS[mask])[0])


def test_agrees_with_the_wgmma_backward():
    """Two seeds, both kernels: the same function of the inputs (errors of the same size)."""
    for seed in (1, 2):
        ws = run_ws("bf16", 128, batch=2, heads=2, q_len=700, kv_len=700, causal=True, seed=seed)[0]
        wgmma = run("bf16", 128, batch=2, heads=2, q_len=700, kv_len=700, causal=True, seed=seed, mma="wgmma")[0]
        check(ws)
        assert all(a < 2 * b + 1e-3 for a, b in zip(ws, wgmma)), (ws, wgmma)


@pytest.mark.parametrize("d", [96, 192, 256])
def test_every_head_dim_through_the_switch(d, monkeypatch):
    """BACKWARD_WS on: head dims the family serves run it, the others keep their kernels; all correct."""
    from tiledsl.dispatch import backward
    monkeypatch.setattr(backward, "BACKWARD_WS", True)
    check(run("bf16", d, q_len=200, kv_len=300, causal=True, poison=True)[0])


def test_head_dims_no_backward_serves_are_refused_clearly(monkeypatch):
    import torch
    from tiledsl.dispatch import backward
    from tiledsl.errors import RuntimeInputError
    monkeypatch.setattr(backward, "BACKWARD_WS", True)
    q = torch.randn(1, 2, 64, 36, device="cuda", dtype=torch.bfloat16)   # 40 runs padded (test_gpu_backward.py)
    with pytest.raises(RuntimeInputError, match="multiples of 8"):
        backward.attention_backward(q, q, q, q, torch.zeros(1, 2, 64, device="cuda"), q)
    q = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match="head dims"):
        backward.attention_backward(q, q, q, q, torch.zeros(1, 2, 64, device="cuda"), q, warp_specialized=True)


def _subprocess(script: str, tool: list[str], timeout: int, env: dict | None = None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **(env or {}), "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # a file of its own: the file's other subprocess tests may run at the same time on other workers
    with tempfile.NamedTemporaryFile("w", dir=root, prefix=".backward_ws_gpu_case_", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(script))
    path = f.name
    try:
        return subprocess.run([*tool, sys.executable, path], capture_output=True, text=True, env=env, cwd=root,
                              timeout=timeout)
    finally:
        os.remove(path)


SMALL = """
    from tests.test_gpu_backward import run, check
    from tests.test_gpu_backward_ws import variant
    for d in (64, 128, 256):
        check(run("bf16", d, batch=2, heads=4, kv_heads=2, q_len=77, kv_len=145, causal=True, kv_lens=[145, 3],
                  warp_specialized=True)[0])
        check(run("bf16", d, q_len=145, kv_len=77, window=(30, 5), warp_specialized=True, deterministic=True)[0])
    check(run("bf16", 128, q_len=200, kv_len=130, causal=True, kernel=variant(128, "atomic"))[0])
"""


@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
def test_sanitizer_clean_on_small_shapes(tool):
    try:
        # cuda-bindings probes driver entry points this driver lacks: host API errors, not the kernel's
        result = _subprocess(SMALL, ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
                                     "--error-exitcode", "9"], timeout=600)
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout or "(0 errors, 0 warnings)" in result.stdout, result.stdout


# The one hazard racecheck reports that is not one: a consumer warp's lanes read the slot's LSE and D rows
# (load_shared_f2), then __syncwarp() orders those reads before lane 0's arrive on the slot's empty barrier, which
# the producer waits on before its next bulk copy into the slot (bulk_load). Racecheck credits the barrier to the
# arriving lane only. Any other hazard, or this one between other functions, fails the test.
TOOL_ONLY_HAZARD = ("WAR", "load_shared_f2", "bulk_load")
HAZARD = re.compile(r"Potential (\w+) hazard detected[^\n]*\n[^\n]*Read Thread \S+ at (\w+)\([^\n]*\n"
                    r"[^\n]*Write Thread \S+ at (\w+)\(")


def test_racecheck_finds_only_the_lane_zero_release_on_small_shapes(tmp_path):
    env = {"TILEDSL_LINEINFO": "1", "TILEDSL_CACHE_DIR": str(tmp_path)}   # hazards name functions and lines
    try:
        result = _subprocess(SMALL, ["compute-sanitizer", "--tool", "racecheck", "--racecheck-report", "hazard",
                                     "--show-backtrace", "no", "--print-limit", "1000000", "--report-api-errors",
                                     "no"], timeout=600, env=env)
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors, (\d+) warnings\)", result.stdout)
    if summary is None:
        assert "(0 errors, 0 warnings)" in result.stdout or "ERROR SUMMARY: 0 errors" in result.stdout, \
            result.stdout[-3000:] + result.stderr[-3000:]
        return
    hazards = HAZARD.findall(result.stdout)
    shown, errors, warnings = (int(x) for x in summary.groups())
    assert len(hazards) == shown == errors + warnings, "racecheck reported hazards this test could not read"
    others = sorted({h for h in hazards if h != TOOL_ONLY_HAZARD})
    assert not others, f"hazards other than the lane-zero release: {others}"


def test_a_wrong_barrier_count_hangs_and_is_caught_by_the_time_limit():
    # One arrival too many needed to free a ring slot: the producer waits forever for the third q tile's slot.
    script = """
        from tiledsl.dispatch.backward import chosen_backward_spec
        from tiledsl.lower.backward import lower_backward
        from tiledsl.runtime.backward_ws import WsBackwardKernel
        from tiledsl.spec import DType, Mask
        from tests.test_gpu_backward import run
        spec = chosen_backward_spec("sm_90a", DType.BF16, 128, Mask.NONE, None, None, None, False, None, True)
        kernel = WsBackwardKernel(spec, lower_backward(spec, q_empty_arrivals=9))
        run("bf16", 128, heads=1, q_len=512, kv_len=128, kernel=kernel)
        print("finished")
    """
    with pytest.raises(subprocess.TimeoutExpired):
        _subprocess(script, [], timeout=60)
