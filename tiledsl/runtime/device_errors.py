"""The error word: how a kernel that bounds its index tensors on the device reports the first bad entry
without the host having read anything.

A kernel that meets a block-table entry outside the cache, a kv_len over what the table (or k)
holds, or packed-sequence offsets (cu_seqlens) outside their tensors or going down, reads nothing
through it, writes NaN rows for that sequence, and records the entry here with
an atomic compare-and-swap on word 0 (the first report wins). The words live in pinned host memory,
which the device writes through its unified address: the host reads them without a copy and without
a sync. `tiledsl.check_errors()` synchronises the device first, so it sees every launch so far; a
checked call reads the words as they are (reports of launches still running may come later).
Either raises the RuntimeInputError once and clears the words.

Layout (int32): [code, tensor, batch index, entry index, value, bound, 0, 0]; code 0 means no error,
a negative code a report still being written (the kernel claims word 0, writes the fields, then the
code: templates/index_bounds.cuh spells the same codes and tensors).
"""
from __future__ import annotations

import struct

from ..errors import RuntimeInputError

WORDS = 8
NO_ERROR = 0
# code -> what the kernel found (formatted with the entry, its value and the bound it broke)
CODES = {
    1: "{tensor}[{batch}, {index}] = {value} is out of range: the cache has {bound} pages (0..{last})",
    2: "{tensor}[{batch}] = {value} is over the cache: block_table gives each sequence {bound} keys",
    3: "{tensor}[{batch}] = {value} is negative",
    4: "{tensor}[{batch}] = {value} is over the {bound} keys k holds",
    5: "{tensor}[{index}] = {value} is out of range: the packed tensor holds {bound} tokens",
    6: "{tensor}[{index}] = {value} is below the entry before it ({bound}): offsets must not decrease",
    7: "sequence {batch} has {value} {lengths} ({tensor}), more than {max_name} = {bound}",
    8: "{tensor} entry {index} (flat) = {real} is not a finite number >= 0 (value = byte * descale; batch {batch})",
    9: "{tensor} entry {index} (flat) = 0: a per-block V descale must be > 0 (quantize_fp8 gives an all-zero tile 1; "
       "batch {batch})",
}
TENSORS = {1: "block_table", 2: "kv_lens", 3: "cu_seqlens_q", 4: "cu_seqlens_k", 5: "q_descale", 6: "k_descale",
           7: "v_descale"}
REAL_VALUED = {8, 9}   # codes whose value word holds a float32's bits (FP8 descales)
# code 7's words for each packed-offsets tensor: what its sequences count, and the bound the caller gave
PACKED_LENGTHS = {3: ("queries", "max_seqlen_q"), 4: ("keys", "max_seqlen_k")}

_words: dict[int, tuple] = {}   # device -> (pinned int32 array, its NumPy view)


def error_words(device_id: int, like=None):
    """(the pinned int32 words of `device_id`, a NumPy view of them), allocated once per device in
    the framework of `like` (torch when given a torch tensor, else CuPy)."""
    have = _words.get(device_id)
    if have is None:
        if like is not None and type(like).__module__.startswith("torch"):
            import torch
            array = torch.zeros(WORDS, dtype=torch.int32, pin_memory=True)
            host = array.numpy()
        else:
            import cupyx
            array = host = cupyx.zeros_pinned(WORDS, dtype="int32")
        have = _words[device_id] = (array, host)
    return have


def error_pointer(device_id: int, like=None) -> int:
    """The address the kernels of `device_id` write their report to (the pinned words' unified address)."""
    array, _ = error_words(device_id, like)
    return array.data_ptr() if hasattr(array, "data_ptr") else array.ctypes.data


def describe(words) -> str:
    """The message of a report."""
    code, tensor, batch, index, value, bound = (int(w) for w in words[:6])
    template = CODES.get(code, "an unknown report (code {code})")
    real = struct.unpack("<f", struct.pack("<i", value))[0] if code in REAL_VALUED else None
    lengths, max_name = PACKED_LENGTHS.get(tensor, ("rows", "the bound"))
    return template.format(tensor=TENSORS.get(tensor, f"tensor {tensor}"), batch=batch, index=index, value=value,
                           bound=bound, last=bound - 1, code=code, real=real, lengths=lengths, max_name=max_name)


def take(device_id: int) -> RuntimeInputError | None:
    """The pending report of `device_id` as an error (the words cleared), or None; reads host memory
    only."""
    have = _words.get(device_id)
    if have is None:
        return None
    host = have[1]
    if int(host[0]) <= NO_ERROR:   # none, or one still being written (a later look sees it)
        return None
    rows = "the rows that read it" if int(host[0]) in REAL_VALUED else "its sequence's output rows"
    error = RuntimeInputError(describe(host) + f" (reported by the kernel; {rows} are NaN)")
    host[:] = 0
    return error


def raise_pending(device_id: int) -> None:
    """A checked call's O(1) look at the words: raise the pending report, if any."""
    error = take(device_id)
    if error is not None:
        raise error


def check_errors(device: int | None = None) -> None:
    """Wait for every launch on `device` (None: every device with a report buffer) and raise the first
    bad index a kernel reported, as a RuntimeInputError naming the tensor and the entry. Syncs."""
    from .device import cupy_module
    devices = [device] if device is not None else sorted(_words)
    cupy = cupy_module() if devices else None
    for d in devices:
        with cupy.cuda.Device(d):
            cupy.cuda.runtime.deviceSynchronize()
        raise_pending(d)
