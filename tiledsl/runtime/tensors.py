"""Zero-copy views of GPU tensors from any framework, through DLPack (or __cuda_array_interface__).

We read pointer, shape, strides and dtype ourselves instead of converting to CuPy, because
CuPy has no bfloat16 dtype and PyTorch's __cuda_array_interface__ refuses bfloat16."""
from __future__ import annotations

import ctypes
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


def view(x, name: str) -> TensorView:
    """A TensorView of `x` (PyTorch tensor, CuPy array, anything with DLPack or the CUDA array
    interface). Host arrays and unsupported dtypes are refused with a message naming `name`."""
    # torch first: its __cuda_array_interface__ property raises KeyError (not AttributeError) for
    # float8 tensors, so hasattr() on one would raise
    if _is_torch(x):
        if str(getattr(x, "dtype", "")) == "torch.float8_e4m3fn":
            return _from_torch_fp8(x, name)
    elif hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, name)
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(x, name)
    raise RuntimeInputError(f"{name}: expected a GPU tensor (PyTorch, CuPy or anything with DLPack), got "
                            f"{type(x).__name__}")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _from_torch_fp8(x, name: str) -> TensorView:
    """PyTorch float8_e4m3fn (an FP8 KV cache) read from the tensor itself: DLPack export of float8
    depends on the PyTorch version."""
    if not x.is_cuda:
        raise RuntimeInputError(f"{name}: is on the host; move it to the GPU")
    return TensorView(name, x.data_ptr(), tuple(x.shape), tuple(x.stride()), DType.E4M3, x.device.index or 0, x)


def _from_dlpack(x, name: str) -> TensorView:
    try:
        capsule = x.__dlpack__()
    except Exception as err:   # frameworks raise many types here (e.g. a tensor that needs grad)
        raise RuntimeInputError(f"{name}: cannot be shared through DLPack: {err}") from None
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if tensor.device.device_type != KDL_CUDA:
        raise RuntimeInputError(f"{name}: is on the host (DLPack device type {tensor.device.device_type}); move it to "
                                f"the GPU")
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
    pointer = (tensor.data or 0) + tensor.byte_offset
    # The capsule is not consumed: its destructor releases the framework's reference, and `x`
    # (kept in owner) holds the memory for as long as we need it.
    return TensorView(name, pointer, shape, strides, dtype, tensor.device.device_id, x)


def _from_cai(x, name: str) -> TensorView:
    cai = x.__cuda_array_interface__
    dtype = CAI_DTYPES.get(cai["typestr"])
    if dtype is None:
        raise RuntimeInputError(f"{name}: unsupported dtype {cai['typestr']}")
    shape = tuple(cai["shape"])
    itemsize = 4 if dtype == "int32" else DTYPES[dtype].bytes
    strides = tuple(s // itemsize for s in cai["strides"]) if cai.get("strides") else _compact_strides(shape)
    device_id = getattr(getattr(x, "device", None), "id", 0)
    return TensorView(name, cai["data"][0], shape, strides, dtype, device_id, x)


def _compact_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def torch_dtype(dtype: DType):
    """The torch dtype of `dtype` (PyTorch imported here, only when asked)."""
    import torch
    return getattr(torch, DTYPES[dtype].torch)
