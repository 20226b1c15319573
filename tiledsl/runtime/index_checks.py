"""Checks of the index tensors a kernel trusts: kv_lens (per-sequence key counts) and a paged cache's
block table. A kernel reads K and V where they point, so a bad entry must never be read.

Two places can check them. On the host (`validate=True`): a copy of the indices (a device sync per
call) checked by runtime/serving_checks.py, refused with a RuntimeInputError naming the tensor and
its first bad entry; skipped under CUDA graph capture (nothing may sync there). On the device: the
kernel bounds every entry it reads and reports a bad one in the error word
(runtime/device_errors.py), with no sync. Which kernels bound them is their plan's
(lower/plan.bounds_indices: the kernel takes the error word): every forward kernel that reads
kv_lens or a block table -- decode (contiguous and paged, FP8 K/V included), fa2 (contiguous kv_lens
and the paged chunked prefill), fa2 on wgmma, fa1 and hopper (score modifications included); the
varlen hopper kernel bounds cu_seqlens (runtime/varlen.py); and every backward module's main kernel
(mma.sync, wgmma, warp-specialized: a bad kv_len gives its sequence no key, and the kernels that store
its dK, dV and dQ store them NaN). A call of such a kernel that does not say `validate=` skips the
host check.
"""
from __future__ import annotations

from .device import capturing
from .inputs import check_kv_lens

def host_validation(validate: bool | None, bounded: bool = False) -> bool:
    """Whether a call checks its index tensors on the host: `validate` when given, else unless its
    kernel bounds them itself (`bounded`)."""
    return (not bounded) if validate is None else bool(validate)


def add_check(b, check) -> None:
    """Run `check(tensors)` on every call of the builder's signature (now, for an immediate one),
    except under graph capture."""
    def guarded(tensors):
        if not capturing(b.like if b.immediate else tensors[0]):
            check(tensors)
    if b.immediate:
        guarded(b.tensors)
    else:
        b.checks.append(guarded)


def add_device_report(b, bounded: bool) -> None:
    """On every call, raise what a kernel of this device reported since the last look (device_errors:
    an O(1) read of host memory, no sync); only where the kernel reports (`bounded`)."""
    if not bounded:
        return
    from .device_errors import raise_pending
    device_id = b.device_id
    if b.immediate:
        raise_pending(device_id)
    else:
        b.checks.append(lambda tensors: raise_pending(device_id))


def add_kv_lens_check(b, index: int, kv_len: int, validate: bool | None, bounded: bool = False) -> None:
    """The host check of contiguous kv_lens (call position `index`) against the keys k holds, or the
    report of a kernel that bounds them (`bounded`)."""
    if b.tensors[index] is None:
        return
    if not host_validation(validate, bounded):
        add_device_report(b, bounded)
        return
    name = b.name
    add_check(b, lambda tensors: check_kv_lens(tensors[index], kv_len, name))


def add_paged_check(b, table_index: int, lens_index: int, num_pages: int, page_size: int,
                    validate: bool | None, bounded: bool = False) -> None:
    """The host check of a block table and its kv_lens (serving_checks.check_paged), or the report of
    a kernel that bounds them (`bounded`)."""
    if not host_validation(validate, bounded):
        add_device_report(b, bounded)
        return
    from .serving_checks import check_paged
    add_check(b, lambda tensors: check_paged(tensors[table_index], tensors[lens_index], num_pages, page_size))
