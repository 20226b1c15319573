"""Zero-copy views of GPU tensors from any framework, and the cache key of a call's tensors.

A PyTorch tensor is read straight from its attributes (data_ptr(), shape, stride(), dtype, device):
no DLPack capsule, so a view costs a few attribute reads, and a tensor that requires grad needs no
detach. CuPy arrays are read through __cuda_array_interface__, anything else through DLPack; we
read pointer, shape, strides and dtype ourselves because CuPy has no bfloat16 dtype and PyTorch's
__cuda_array_interface__ refuses bfloat16.

`signature(x)` is what a warm call keys its prepared launch on (runtime/launch.py): shape, strides,
dtype and device, read without building a view."""
from __future__ import annotations

import ctypes
import numbers
import sys
from dataclasses import dataclass

from ..errors import RuntimeInputError
from ..spec import DTYPES, DType

KDL_CUDA = 2
DLPACK_DTYPES = {**{info.dlpack: dtype for dtype, info in DTYPES.items()}, (0, 32): "int32"}
CAI_DTYPES = {**{info.cai: dtype for dtype, info in DTYPES.items() if info.cai}, "<i4": "int32"}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@dataclass(frozen=True)
class TensorView:
    """What a kernel launch needs of a tensor; `owner` keeps the memory alive."""
    name: str
    pointer: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]      # in elements
    dtype: object                 # DType or "int32"
    device_id: int
    owner: object
    slot: int = -1                # the tensor's place in its call (runtime/launch.py); -1: not a call tensor


def view(x, name: str, slot: int = -1) -> TensorView:
    """A TensorView of `x` (PyTorch tensor, CuPy array, anything with DLPack or the CUDA array
    interface). Host arrays and unsupported dtypes are refused with a message naming `name`."""
    # torch first: its __cuda_array_interface__ property raises KeyError (not AttributeError) for
    # float8 tensors, so hasattr() on one would raise
    if is_torch(x):
        return _from_torch(x, name, slot)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, name, slot)
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(x, name, slot)
    raise RuntimeInputError(f"{name}: expected a GPU tensor (PyTorch, CuPy or anything with DLPack), got "
                            f"{type(x).__name__}")


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


_torch_dtypes: dict = {}


def torch_dtypes() -> dict:
    """torch dtype -> DType (or "int32"), built from DTYPES the first time a torch tensor is read."""
    if not _torch_dtypes:
        torch = sys.modules["torch"]
        for dtype, info in DTYPES.items():
            if hasattr(torch, info.torch):
                _torch_dtypes[getattr(torch, info.torch)] = dtype
        _torch_dtypes[torch.int32] = "int32"
    return _torch_dtypes


def _no_gpu_note() -> str:
    """What a host tensor's refusal adds on a machine where no kernel can run (there is no GPU to move it to)."""
    from .availability import gpu_missing
    reason = gpu_missing()
    return f" (this machine has no usable NVIDIA GPU: {reason})" if reason else ""


def _from_torch(x, name: str, slot: int) -> TensorView:
    device = x.device
    if device.type != "cuda":
        raise RuntimeInputError(f"{name}: is on the host ({device}); move it to the GPU{_no_gpu_note()}")
    dtype = torch_dtypes().get(x.dtype)
    if dtype is None:
        raise RuntimeInputError(f"{name}: unsupported dtype {x.dtype}")
    return TensorView(name, x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype, device.index or 0, x, slot)


class LaunchValue:
    """A uint64 launch argument that changes from call to call of one prepared launch (dropout's seed and
    offset): it sits among the call's tensors and is read where their addresses are (data_ptr(), .data.ptr,
    pointer()), so a warm call writes it into the parameter buffer as it writes a pointer."""
    __slots__ = ("value",)

    def __init__(self, value: int, name: str = "value"):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < 1 << 64:
            raise RuntimeInputError(f"{name} must be an int in 0..2^64-1, got {value!r}")
        self.value = int(value)

    def data_ptr(self) -> int:
        return self.value

    @property
    def data(self):   # CuPy's spelling: .data.ptr
        return self

    @property
    def ptr(self) -> int:
        return self.value


def signature(x):
    """The part of `x` a prepared launch depends on (framework, shape, strides, dtype, device), read
    with O(1) attribute lookups for torch and CuPy; None for None. Equal signatures get the same
    launch, whatever the pointers."""
    if x is None:
        return None
    if type(x) is LaunchValue:   # its value is read on every call
        return LaunchValue
    module = type(x).__module__
    if module.startswith("torch"):
        return x.shape, x.stride(), x.dtype, x.device
    if module.startswith("cupy"):
        return x.shape, x.strides, x.dtype, x.data.device_id
    if isinstance(x, (int, float)):
        return type(x), x
    t = view(x, "tensor")
    return type(x), t.shape, t.strides, t.dtype, t.device_id


def pointer(x) -> int:
    """The device address of `x` (0 for None): data_ptr() for torch, .data.ptr for CuPy, else its view."""
    if x is None:
        return 0
    if type(x) is LaunchValue:
        return x.value
    module = type(x).__module__
    if module.startswith("torch"):
        return x.data_ptr()
    if module.startswith("cupy"):
        return x.data.ptr
    return view(x, "tensor").pointer


def _from_dlpack(x, name: str, slot: int = -1) -> TensorView:
    try:
        capsule = x.__dlpack__()
    except Exception as err:   # frameworks raise many types here (e.g. a tensor that needs grad)
        raise RuntimeInputError(f"{name}: cannot be shared through DLPack: {err}") from None
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if tensor.device.device_type != KDL_CUDA:
        raise RuntimeInputError(f"{name}: is on the host (DLPack device type {tensor.device.device_type}); move it to "
                                f"the GPU{_no_gpu_note()}")
    key = (tensor.dtype.code, tensor.dtype.bits)
    if key not in DLPACK_DTYPES or tensor.dtype.lanes != 1:
        raise RuntimeInputError(f"{name}: unsupported dtype (DLPack code {key[0]}, {key[1]} bits)")
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(ndim))
    else:
        strides = _compact_strides(shape)
    dtype = DLPACK_DTYPES[key]
    address = (tensor.data or 0) + tensor.byte_offset
    # The capsule is not consumed: its destructor releases the framework's reference, and `x`
    # (kept in owner) holds the memory for as long as we need it.
    return TensorView(name, address, shape, strides, dtype, tensor.device.device_id, x, slot)


def _from_cai(x, name: str, slot: int = -1) -> TensorView:
    cai = x.__cuda_array_interface__
    dtype = CAI_DTYPES.get(cai["typestr"])
    if dtype is None:
        raise RuntimeInputError(f"{name}: unsupported dtype {cai['typestr']}")
    shape = tuple(cai["shape"])
    itemsize = 4 if dtype == "int32" else DTYPES[dtype].bytes
    strides = tuple(s // itemsize for s in cai["strides"]) if cai.get("strides") else _compact_strides(shape)
    device_id = getattr(getattr(x, "device", None), "id", 0)
    return TensorView(name, cai["data"][0], shape, strides, dtype, device_id, x, slot)


def _compact_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def zero_padded(x, extra: int):
    """`x` (a torch tensor or CuPy array) with `extra` zero columns after its last axis' own: a new contiguous
    array in x's framework, made on that framework's current stream (torch: detached, so no autograd graph)."""
    if is_torch(x):
        return sys.modules["torch"].nn.functional.pad(x.detach(), (0, extra))
    import cupy
    return cupy.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def leading_columns(x, count: int):
    """The first `count` columns of `x`'s last axis as a new contiguous array in x's framework."""
    if is_torch(x):
        return x[..., :count].contiguous()
    import cupy
    return cupy.ascontiguousarray(x[..., :count])


def torch_dtype(dtype: DType):
    """The torch dtype of `dtype` (PyTorch imported here, only when asked)."""
    import torch
    return getattr(torch, DTYPES[dtype].torch)
