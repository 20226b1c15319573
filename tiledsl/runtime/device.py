"""The GPU a call runs on: CuPy (imported on first use), the device's architecture and limits, the caller's
stream (torch's current stream for torch tensors), graph capture, scratch allocation and pointers."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..device_limits import DeviceLimits, current_limits
from ..errors import LaunchError

if TYPE_CHECKING:
    pass


def cupy_module():
    try:
        import cupy
    except ImportError:
        raise LaunchError("running kernels needs CuPy (pip install 'tiledsl[gpu]')") from None
    return cupy


def device_arch() -> str:
    """sm_XY of the current device, with the 'a' suffix on Hopper so wgmma/setmaxnreg are legal."""
    cupy = cupy_module()
    major, minor = divmod(int(cupy.cuda.Device().compute_capability), 10)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


# -- streams: every launch goes to the stream the caller's framework is on -------------------------
_external_streams: dict[tuple[int, int], object] = {}


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def caller_stream(x):
    """The CuPy stream to launch on for inputs like `x`: PyTorch's current stream on x's device
    (wrapped once per handle as a cupy ExternalStream) for torch tensors, CuPy's current stream
    otherwise. Launching there orders the kernel after the caller's writes of q, k, v and lets
    `torch.cuda.graph` capture it."""
    cupy = cupy_module()
    if not is_torch(x):
        return cupy.cuda.get_current_stream()
    import torch
    handle, device_id = int(torch.cuda.current_stream(x.device).cuda_stream), x.device.index or 0
    key = (handle, device_id)
    stream = _external_streams.get(key)
    if stream is None:
        stream = _external_streams[key] = cupy.cuda.ExternalStream(handle, device_id)
    return stream


def capturing(x) -> bool:
    """Whether the caller's stream is being captured into a CUDA graph (no host syncs then)."""
    if is_torch(x):
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    return bool(cupy_module().cuda.get_current_stream().is_capturing())


def allocate(like, shape: tuple[int, ...], dtype: str, stream, zero: bool = False):
    """A scratch array of `dtype` ("float32" or "int32") on `like`'s device, in `like`'s framework,
    ordered on `stream`: torch's caching allocator under torch (graph-capture safe, stream-aware),
    CuPy's pool, with the fill on `stream`, otherwise."""
    if is_torch(like):
        import torch
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=getattr(torch, dtype), device=like.device)
    cupy = cupy_module()
    with cupy.cuda.Device(getattr(getattr(like, "device", None), "id", 0)), (stream or contextlib.nullcontext()):
        return (cupy.zeros if zero else cupy.empty)(shape, dtype=dtype)


def data_pointer(array) -> int:
    """Device address of a torch tensor or CuPy array."""
    return int(array.data_ptr()) if is_torch(array) else int(array.data.ptr)


_DEVICE_LIMITS: dict[int, DeviceLimits] = {}


def device_limits(device_id: int) -> DeviceLimits:
    """The limits of a live device (device_limits.read_device_limits), asked once per device."""
    if device_id not in _DEVICE_LIMITS:
        _DEVICE_LIMITS[device_id] = current_limits(device_id)
    return _DEVICE_LIMITS[device_id]


def allow_dynamic_shared(fn, nbytes: int) -> None:
    """Raise the function's dynamic shared-memory limit (48 KB unless asked) to what it uses."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        from cupy.cuda import driver
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
