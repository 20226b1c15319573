"""What every kernel class checks before it prepares a launch: the shapes it reads off q, k, v, the one
operand check (rank, dtype, strides, alignment, device) every family applies to its 16-bit (or e4m3)
tensors, the index tensors' own checks, and the host-side kv_lens range check that `validate=True`
keeps."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import RuntimeInputError
from ..spec import DTYPES
from .tensors import TensorView

ROW_ALIGNMENT = 16   # bytes: rows are copied 16 bytes at a time (cp.async, ldmatrix, TMA)


@dataclass(frozen=True)
class Shapes:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int


def check_operand(t: TensorView, kernel: str, dtype, ndim: int, device_id: int, layout: str) -> None:
    """An operand the kernel reads row by row: `ndim` axes (`layout` names them), the kernel's dtype,
    a unit stride on the last axis, rows that start on 16-byte boundaries, on q's GPU."""
    if len(t.shape) != ndim:
        raise RuntimeInputError(f"{kernel}: {t.name} must be {ndim}-d {layout}, got shape {t.shape}")
    if t.dtype is not dtype:
        raise RuntimeInputError(f"{kernel}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel was built "
                                f"for {dtype.value}")
    if t.strides[-1] != 1:
        raise RuntimeInputError(f"{kernel}: {t.name} needs a unit stride on head_dim, got strides {t.strides}")
    per_row = ROW_ALIGNMENT // DTYPES[dtype].bytes
    if any(s % per_row for s in t.strides[:-1]) or t.pointer % ROW_ALIGNMENT:
        raise RuntimeInputError(f"{kernel}: {t.name} rows must be 16-byte aligned (strides {t.strides} elements)")
    if t.device_id != device_id:
        raise RuntimeInputError(f"{kernel}: q is on GPU {device_id} but {t.name} on GPU {t.device_id}")


def check_int32_vector(t: TensorView, kernel: str, length: int, device_id: int) -> None:
    """An index vector (kv_lens): contiguous int32 of `length` entries on q's GPU."""
    if t.dtype != "int32" or t.shape != (length,) or (length > 1 and t.strides != (1,)):
        raise RuntimeInputError(f"{kernel}: {t.name} must be a contiguous int32 array of shape ({length},)")
    if t.device_id != device_id:
        raise RuntimeInputError(f"{kernel}: {t.name} must be on q's GPU {device_id}, it is on GPU {t.device_id}")


def check_kv_lens(kv_lens, kv_len: int, name: str) -> None:
    """Per-sequence lengths must lie in [0, kv_len]: checked on the host (a copy, so a sync) when a
    call asks for host validation."""
    from .serving_checks import host
    lens = host(kv_lens, "kv_lens")
    if lens.size == 0:
        return
    low, high = int(lens.min()), int(lens.max())
    if low < 0 or high > kv_len:
        raise RuntimeInputError(f"{name}: kv_lens must lie in [0, {kv_len}], got values in [{low}, {high}]")
