"""A machine with the GPU extras installed but no usable GPU (a laptop, a CI box): CuPy imports fine and
fails at its first CUDA call (cudaErrorInsufficientDriver), PyTorch imports and sees no device. Every
command and API call that needs a GPU says so in one line (exit 2 / RuntimeInputError), never a
traceback; what needs no GPU (check, explain, compile, tune --dry-run) still works.

The stand-ins below behave as CuPy and PyTorch do there: the first CUDA call raises the runtime's error."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tiledsl.errors import RuntimeInputError

ROOT = Path(__file__).resolve().parent.parent
FA2 = str(ROOT / "specs" / "fa2_d64.tile")
SPACE = str(ROOT / "specs" / "fa2_space_d64.tile")
NO_DRIVER = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"

FAKE_CUPY = f'''
class CUDARuntimeError(RuntimeError):
    pass


def _no_driver(*args, **kwargs):
    raise CUDARuntimeError({NO_DRIVER!r})


class _Runtime:
    getDeviceCount = runtimeGetVersion = driverGetVersion = staticmethod(_no_driver)


class _Cuda:
    runtime = _Runtime
    Device = get_current_stream = ExternalStream = staticmethod(_no_driver)

    def __getattr__(self, name):
        _no_driver()


cuda = _Cuda()
float16, float32, int32 = "float16", "float32", "int32"


def __getattr__(name):   # zeros, asarray, random, ...: the first CUDA call fails
    _no_driver()
'''

FAKE_TORCH = '''
__version__ = "2.5.0+no-driver"
float16, bfloat16, float32 = "float16", "bfloat16", "float32"


class _Cuda:
    @staticmethod
    def is_available():
        return False

    def __getattr__(self, name):
        raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and "
                           "installed a driver from http://www.nvidia.com/Download/index.aspx")


cuda = _Cuda()


def randn(*args, device=None, **kwargs):
    cuda.current_stream()
'''


@pytest.fixture(scope="module")
def no_driver_env(tmp_path_factory):
    """An environment whose `cupy` (and, with torch=True, `torch`) import but find no driver."""
    def env(torch: bool) -> dict:
        folder = tmp_path_factory.mktemp("torch" if torch else "cupy_only")
        (folder / "cupy").mkdir()
        (folder / "cupy" / "__init__.py").write_text(FAKE_CUPY)
        if torch:
            (folder / "torch").mkdir()
            (folder / "torch" / "__init__.py").write_text(FAKE_TORCH)
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]),
                "TILEDSL_CACHE_DIR": str(folder / "cache")}
    return env


def tiledsl_cli(env, *args):
    return subprocess.run([sys.executable, "-m", "tiledsl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


FP16 = "FP16"   # stands for an fp16 copy of FA2 (CuPy alone can make its inputs)


@pytest.mark.parametrize("torch, args", [
    (False, ["run", FP16]), (False, ["run", FA2]), (False, ["bench", FP16, "--against", "none"]),
    (False, ["tune", SPACE, "--seqlen", "1024"]), (False, ["warmup"]),
    (True, ["run", FA2]), (True, ["bench", FA2]), (True, ["tune", SPACE, "--seqlen", "1024"]), (True, ["warmup"])],
    ids=lambda v: ("cupy and torch" if v else "cupy only") if isinstance(v, bool) else " ".join(map(str, v)))
def test_gpu_commands_say_there_is_no_gpu_in_one_line(no_driver_env, torch, args, tmp_path):
    fp16 = tmp_path / "fa2_fp16.tile"
    fp16.write_text(Path(FA2).read_text().replace("bf16", "fp16"))
    done = tiledsl_cli(no_driver_env(torch), *[str(fp16) if a == FP16 else a for a in args])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    if not torch and FA2 in args:   # bf16 inputs (and SDPA) need PyTorch: named before the device
        assert "needs PyTorch, which is not installed" in line, line
    else:
        assert f"tiledsl {args[0]} " in line and "no NVIDIA GPU is usable here" in line, line
        assert "cudaErrorInsufficientDriver" in line, line


def test_what_needs_no_gpu_still_works(no_driver_env, tmp_path):
    env = no_driver_env(True)
    for args in (["check", FA2], ["explain", FA2], ["compile", FA2, "-o", str(tmp_path)],
                 ["tune", SPACE, "--seqlen", "1024", "--dry-run"]):
        done = tiledsl_cli(env, *args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)


# ---- the Python API, in process: a CuPy stand-in without a driver and GPU-looking arrays ------------------

class DeviceArray:
    """Something a kernel accepts as a GPU array (the CUDA array interface), never dereferenced here."""

    def __init__(self, shape, typestr="<f2"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": None, "data": (1 << 20, False),
                                         "version": 3}


@pytest.fixture
def no_driver(monkeypatch):
    fake = types.ModuleType("cupy")
    exec(FAKE_CUPY, fake.__dict__)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr("tiledsl.runtime.availability._gpu_usable", False)


def _one_line_no_gpu(call):
    with pytest.raises(RuntimeInputError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and "no NVIDIA GPU is usable here: cudaErrorInsufficientDriver" in message, message


def test_api_calls_say_there_is_no_gpu_in_one_line(no_driver):
    import tiledsl
    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.serving.prefill import paged_prefill
    q = DeviceArray((1, 2, 64, 64))
    _one_line_no_gpu(lambda: tiledsl.attention(q, q, q))
    _one_line_no_gpu(lambda: tiledsl.attention(DeviceArray((1, 2, 1, 128)), DeviceArray((1, 2, 64, 128)),
                                               DeviceArray((1, 2, 64, 128))))
    _one_line_no_gpu(lambda: attention_backward(q, q, q, q, DeviceArray((1, 2, 64), "<f4"), q))
    packed, cu = DeviceArray((64, 2, 64)), DeviceArray((2,), "<i4")
    _one_line_no_gpu(lambda: tiledsl.varlen_attention(packed, packed, packed, cu, cu))
    paged_q, cache = DeviceArray((1, 1, 2, 128)), DeviceArray((4, 16, 2, 128))
    table, lens = DeviceArray((1, 4), "<i4"), DeviceArray((1,), "<i4")
    _one_line_no_gpu(lambda: tiledsl.paged_attention(paged_q, cache, cache, table, lens))
    _one_line_no_gpu(lambda: paged_prefill(DeviceArray((1, 32, 2, 128)), cache, cache, table, lens))
    kernel = tiledsl.compile(Path(FA2).read_text().replace("bf16", "fp16"))
    assert "__global__" in kernel.source   # compiling to CUDA needs no GPU
    _one_line_no_gpu(lambda: kernel(q, q, q))


def test_host_arrays_on_a_machine_without_a_gpu_say_both(no_driver):
    import numpy as np
    import tiledsl
    with pytest.raises(RuntimeInputError, match="\\w+: is on the host .*; move it to the GPU \\(this machine has no "
                                                "usable NVIDIA GPU: cudaErrorInsufficientDriver"):
        tiledsl.attention(np.zeros((1, 2, 8, 64), np.float16), None, None)


def test_a_pytorch_that_sees_no_gpu_is_named(monkeypatch):
    """CuPy has a GPU but PyTorch does not (a CPU-only build): bench's SDPA peers are refused up front."""
    import importlib.machinery
    from tiledsl.cli.common import gpu_ready
    from tiledsl.errors import CliError
    from tiledsl.frontend.parse import load_specs
    fakes = {}
    for name, code in (("cupy", "cuda = None"), ("torch", FAKE_TORCH)):
        fakes[name] = types.ModuleType(name)
        fakes[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        exec(code, fakes[name].__dict__)
        monkeypatch.setitem(sys.modules, name, fakes[name])
    monkeypatch.setattr("tiledsl.runtime.availability._gpu_usable", True)
    with pytest.raises(CliError, match="bench --against sdpa needs PyTorch with CUDA, and this PyTorch sees no GPU"):
        gpu_ready("bench", load_specs(FA2), torch_for="bench --against sdpa")
