"""The Python API without a GPU: the schedule `tiledsl.attention` picks for every shape it serves
(dispatch/autoschedule.py, tuned.tuned_spec), the stream it launches on (runtime/device.stream_reader) and
`tiledsl warmup` on a machine without a GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tiledsl.dispatch import autoschedule
from tiledsl.runtime import device as runtime
from tiledsl.dispatch import tuned
from tiledsl.cli.main import main
from tiledsl.errors import RuntimeInputError
from tiledsl.families import lower
from tiledsl.families import layout_of
from tiledsl.spec import DType, Family, Mask, Mma, Problem

ROOT = Path(__file__).resolve().parent.parent
MASKS = {"none": (Mask.NONE, None), "causal": (Mask.CAUSAL, None), "window": (Mask.WINDOW, (128, 0))}
SERVED = list(range(8, 257, 8))


def _spec(arch, dtype, d, mask_name, q_len=None, dv=None):
    mask, window = MASKS[mask_name]
    return tuned.tuned_spec(arch, dtype, d, mask, dv or d, window, None, q_len)


# ---- which head dims are served ---------------------------------------------------------------------

def test_served_head_dims_are_the_multiples_of_8():
    # fa2 on mma.sync pads 8, 24, 40, ... to the next 16 on chip (layout.mma_width).
    for dtype in (DType.BF16, DType.FP16):
        assert autoschedule.supported_head_dims(dtype) == SERVED


@pytest.mark.parametrize("d", [4, 12, 100, 264, 512])
@pytest.mark.parametrize("q_len", [None, 1])
def test_unserved_head_dim_is_refused_by_name(d, q_len):
    with pytest.raises(RuntimeInputError) as err:
        _spec("sm_90a", DType.BF16, d, "none", q_len)
    message = str(err.value)
    assert f"head dim {d}" in message and "8, 16, 24" in message and "256" in message


@pytest.mark.parametrize("d", [8, 40, 72, 200, 248])
def test_head_dims_of_8_not_16_run_on_fa2_mma_sync_with_q_len_of_decode(d):
    spec, found = _spec("sm_90a", DType.BF16, d, "causal", q_len=1)
    assert not found and spec.family is Family.FA2 and spec.schedule.mma is Mma.SYNC
    assert lower(spec).kernel_name == spec.kernel_name


# ---- the picked spec is legal for every served shape -----------------------------------------------------

@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16], ids=lambda t: t.value)
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_prefill_pick_is_legal_for_every_head_dim(arch, dtype, mask_name):
    for d in SERVED:
        spec, found = _spec(arch, dtype, d, mask_name, q_len=1000)
        assert spec.family in (Family.FA2, Family.HOPPER), spec.kernel_name
        assert found == (arch == "sm_90a" and d in (64, 128, 256))
        assert (spec.problem.head_dim_qk, spec.problem.dtype, spec.problem.mask) == (d, dtype, MASKS[mask_name][0])
        if arch == "sm_80":
            assert spec.schedule.mma is Mma.SYNC   # no wgmma off Hopper
        layout_of(spec)
        assert lower(spec).kernel_name == spec.kernel_name


def test_prefill_pick_serves_head_dims_the_fixed_default_could_not():
    # The fixed q128/kv64/4-warp default failed at d192, d224 and d256 causal (layout refused it).
    for d in (192, 224, 256):
        spec, _ = _spec("sm_100", DType.BF16, d, "causal")
        layout_of(spec)
        lower(spec)


def test_wgmma_is_a_candidate_only_for_multiples_of_64_on_sm90():
    assert any(s.mma is Mma.WGMMA for s in autoschedule.prefill_candidates(Problem(192, 192), "sm_90a"))
    assert not any(s.mma is Mma.WGMMA for s in autoschedule.prefill_candidates(Problem(96, 96), "sm_90a"))
    assert not any(s.mma is Mma.WGMMA for s in autoschedule.prefill_candidates(Problem(128, 128), "sm_80"))


def test_pick_is_deterministic_and_cached():
    problem = Problem(96, 96, DType.FP16, Mask.CAUSAL)
    first = autoschedule.pick("sm_90a", problem)
    hits = autoschedule.pick.cache_info().hits
    assert autoschedule.pick("sm_90a", problem) is first
    assert autoschedule.pick.cache_info().hits == hits + 1
    autoschedule.pick.cache_clear()
    assert autoschedule.pick("sm_90a", problem) == first


def test_pick_ranks_by_the_tune_model():
    # The pick is the best predicted legal candidate: no legal candidate is predicted faster.
    from tiledsl.schedule.cost import Resources
    from tiledsl.spec import KernelSpec
    from tiledsl.schedule.cost import Shape, predict
    problem = Problem(96, 96, DType.BF16, Mask.NONE)
    chosen = autoschedule.pick("sm_90a", problem)
    shape = Shape(*autoschedule.REPRESENTATIVE_BATCH_HEADS, autoschedule.REPRESENTATIVE_SEQLEN,
                  autoschedule.REPRESENTATIVE_SEQLEN)

    def time_of(spec):
        lay = layout_of(spec)
        return predict(spec, shape, Resources(lay.register_estimate, smem_bytes=lay.smem_bytes, threads=lay.threads,
                                              q_in_registers=lay.q_in_registers)).time_ms
    times = []
    for schedule in autoschedule.prefill_candidates(problem, "sm_90a"):
        try:
            times.append(time_of(KernelSpec("c", problem, schedule)))
        except Exception:
            continue
    assert len(times) > 3 and time_of(chosen) == min(times)


def test_head_dim_v_differs():
    spec, found = _spec("sm_90a", DType.BF16, 128, "none", dv=64)
    assert not found and (spec.problem.head_dim_qk, spec.problem.head_dim_v) == (128, 64)
    lower(spec)


# ---- decode for few queries -------------------------------------------------------------------------------

@pytest.mark.parametrize("q_len", [1, 2, 7, 16])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_few_queries_pick_decode(q_len, mask_name):
    from tiledsl.dispatch.autoschedule import DECODE_HEAD_DIMS
    for d in SERVED:
        spec, found = _spec("sm_90a", DType.BF16, d, mask_name, q_len)
        if d not in DECODE_HEAD_DIMS:   # decode is validated for these only: the rest run on prefill
            assert spec.family is not Family.DECODE, spec.kernel_name
            continue
        assert not found and spec.family is Family.DECODE, spec.kernel_name
        assert spec.problem.queries_per_seq == q_len and spec.schedule.split_kv == "auto"
        layout_of(spec)
        lower(spec)


def test_decode_prefers_the_bundled_schedule():
    from tiledsl.frontend.parse import load_specs
    (bundled,) = load_specs(ROOT / "specs" / "decode_d128.tile")
    spec, _ = _spec("sm_90a", DType.BF16, 128, "none", 1)
    assert spec.schedule == bundled.schedule and spec.problem == bundled.problem


@pytest.mark.parametrize("q_len", [0, 17, 4096])
def test_other_query_counts_pick_prefill(q_len):
    spec, _ = _spec("sm_90a", DType.FP16, 96, "causal", q_len)
    assert spec.family is Family.FA2 and spec.problem.queries_per_seq is None


# ---- the launch stream ----------------------------------------------------------------------------------------

class _FakeCupy:
    """Its current stream is a sentinel with a raw handle."""
    current = types.SimpleNamespace(ptr=0xC0FFEE)

    def __init__(self):
        self.cuda = types.SimpleNamespace(get_current_stream=lambda: self.current)


def _fake_torch(monkeypatch, handle: int, capturing: bool = False, raw: bool = True):
    asked = []

    def current_stream(device):
        asked.append(("current_stream", device))
        return types.SimpleNamespace(cuda_stream=handle)

    def raw_stream(index):
        asked.append(("raw", index))
        return handle
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(current_stream=current_stream, is_current_stream_capturing=lambda: capturing)
    torch._C = types.SimpleNamespace(**({"_cuda_getCurrentRawStream": raw_stream} if raw else {}))
    monkeypatch.setitem(sys.modules, "torch", torch)
    return asked


class _TorchLikeTensor:
    def __init__(self, index):
        self.device = types.SimpleNamespace(index=index)


_TorchLikeTensor.__module__ = "torch"   # how runtime tells torch tensors apart, without importing torch


@pytest.mark.parametrize("raw", [True, False], ids=["raw-handle", "current_stream"])
def test_torch_inputs_launch_on_torchs_current_stream_read_per_call(monkeypatch, raw):
    asked = _fake_torch(monkeypatch, 0xBEEF, raw=raw)
    x = _TorchLikeTensor(1)
    read = runtime.stream_reader(x)
    assert read() == 0xBEEF and asked == [("raw", 1) if raw else ("current_stream", 1)]
    _fake_torch(monkeypatch, 0xF00D, raw=raw)   # torch.cuda.stream(s): a new current stream, seen by the next call
    if raw:
        assert runtime.stream_reader(x)() == 0xF00D


def test_other_inputs_launch_on_cupys_current_stream(monkeypatch):
    cupy = _FakeCupy()
    monkeypatch.setattr(runtime, "cupy_module", lambda: cupy)
    _fake_torch(monkeypatch, 0xBEEF)
    assert runtime.stream_reader(types.SimpleNamespace())() == 0xC0FFEE


def test_kv_lens_range_check_is_skipped_under_capture(monkeypatch):
    _fake_torch(monkeypatch, 1, capturing=True)
    assert runtime.capturing(_TorchLikeTensor(0))
    _fake_torch(monkeypatch, 1, capturing=False)
    assert not runtime.capturing(_TorchLikeTensor(0))


def test_workspaces_of_torch_inputs_come_from_torch(monkeypatch):
    from tiledsl.runtime.launch import allocator
    torch = types.ModuleType("torch")
    calls = []
    torch.zeros = lambda shape, dtype, device: calls.append(("zeros", shape, dtype, device)) or "z"
    torch.empty = lambda shape, dtype, device: calls.append(("empty", shape, dtype, device)) or "e"
    torch.float32, torch.int32 = "f32", "i32"
    monkeypatch.setitem(sys.modules, "torch", torch)
    x = _TorchLikeTensor(0)
    assert allocator(x, (3,), "int32", zero=True)() == "z"
    assert allocator(x, (2, 4), "float32")() == "e"
    assert calls == [("zeros", (3,), "i32", x.device), ("empty", (2, 4), "f32", x.device)]


# ---- tiledsl warmup --------------------------------------------------------------------------------------------

def test_warmup_without_cupy_exits_2_with_one_line():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    done = subprocess.run([sys.executable, "-m", "tiledsl.cli", "warmup"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "GPU" in done.stderr


def test_warmup_without_a_gpu_exits_2_with_one_line(monkeypatch, capsys):
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert main(["warmup", "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no NVIDIA GPU" in err[0]


def test_warmup_entries_follow_the_table_and_filters():
    from tiledsl.cli.warmup import entries
    from tiledsl.errors import CliError
    assert len(entries("sm_90a", None, None)) == len(tuned.TUNED)
    assert entries("sm_90a", ["fp16"], [128]) == [("fp16", 128, "none"), ("fp16", 128, "causal")]
    with pytest.raises(CliError, match="--head-dim 96: not in the tuned table"):
        entries("sm_90a", None, [96, 128])
    with pytest.raises(CliError, match="no kernels for sm_80"):
        entries("sm_80", None, None)
