"""The GPU a call runs on: CuPy (imported on first use), the device's architecture and limits, the caller's
stream (torch's current stream for torch tensors), the current device, graph capture and loading a
cubin's functions."""
from __future__ import annotations

import sys

from ..device_limits import DeviceLimits, current_limits
from ..errors import LaunchError
from .availability import require_gpu
from .tensors import is_torch


def cupy_module():
    try:
        import cupy
    except ImportError:
        raise LaunchError("running kernels needs CuPy (pip install 'tiledsl[gpu]')") from None
    return cupy


def device_arch() -> str:
    """sm_XY of the current device, with the 'a' suffix on Hopper so wgmma/setmaxnreg are legal."""
    require_gpu("running a kernel")
    cupy = cupy_module()
    major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


# -- streams: every launch goes to the stream the caller's framework is on -------------------------
def stream_reader(x):
    """A no-argument function that returns the raw handle of the stream a call on inputs like `x`
    launches on, read per call: torch's current stream on x's device (the raw handle getter that
    torch's own compiled code uses, else torch.cuda.current_stream), CuPy's current stream otherwise."""
    if is_torch(x):
        torch = sys.modules["torch"]
        index = x.device.index or 0
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return lambda: raw(index)
        return lambda: int(torch.cuda.current_stream(index).cuda_stream)
    cupy = cupy_module()
    return lambda: cupy.cuda.get_current_stream().ptr


_external_streams: dict[tuple[int, int], object] = {}


def caller_stream(x):
    """The CuPy stream object of the stream a call on inputs like `x` launches on (stream_reader's
    handle, wrapped once per handle as an ExternalStream), for code that launches through CuPy's
    Function.__call__ (the ring merge)."""
    cupy = cupy_module()
    if not is_torch(x):
        return cupy.cuda.get_current_stream()
    key = (stream_reader(x)(), x.device.index or 0)
    stream = _external_streams.get(key)
    if stream is None:
        stream = _external_streams[key] = cupy.cuda.ExternalStream(*key)
    return stream


def current_device() -> int:
    """The calling thread's current CUDA device (both torch and CuPy launch there); a one-line error on a
    machine where no kernel can run (a kernel's first call asks here before loading its module)."""
    require_gpu("running a kernel")
    return cupy_module().cuda.runtime.getDevice()


def device_reader():
    """current_device without the module lookups: the runtime's own getter, for a warm call."""
    return cupy_module().cuda.runtime.getDevice


def make_context_current() -> None:
    """Make the current device's primary context current on this thread (the driver API launches
    there; the runtime does it on a thread's first runtime call)."""
    runtime = cupy_module().cuda.runtime
    runtime.setDevice(runtime.getDevice())


def using_device(device_id: int):
    """A context in which `device_id` is the current device (restored after)."""
    return cupy_module().cuda.Device(device_id)


def capturing(x) -> bool:
    """Whether the caller's stream is being captured into a CUDA graph (no host syncs then)."""
    if is_torch(x):
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    return bool(cupy_module().cuda.get_current_stream().is_capturing())


_DEVICE_LIMITS: dict[int, DeviceLimits] = {}


def device_limits(device_id: int) -> DeviceLimits:
    """The limits of a live device (device_limits.read_device_limits), asked once per device."""
    if device_id not in _DEVICE_LIMITS:
        _DEVICE_LIMITS[device_id] = current_limits(device_id)
    return _DEVICE_LIMITS[device_id]


def load_functions(cubin_path, functions: dict, device_id: int) -> dict:
    """The named functions of a cubin loaded on `device_id`, each allowed its dynamic shared memory
    ({name: bytes} -> {name: CuPy Function}); the module stays alive with its functions."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_id):
        module = cupy.cuda.function.Module()
        module.load(cubin_path.read_bytes())
        loaded = {}
        for name, smem in functions.items():
            fn = module.get_function(name)
            allow_dynamic_shared(fn, smem)
            loaded[name] = fn
    _modules.append(module)
    return loaded


_modules: list = []   # loaded modules live as long as the process (their functions are cached on kernels)


def allow_dynamic_shared(fn, nbytes: int) -> None:
    """Raise the function's dynamic shared-memory limit (48 KB unless asked) to what it uses."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        from cupy.cuda import driver
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
