"""Checks of the serving inputs before a launch: a paged KV cache's block table and kv_lens, a
variable-length batch's cu_seqlens. A kernel trusts these indices (it reads K/V where they point),
so a bad one is refused here, on host copies, never read out of bounds on the GPU.

Each error is a RuntimeInputError that names the tensor and its first bad index. The arrays may
be NumPy, CuPy or PyTorch; they are copied to the host first (the index tensors are small).
"""
from __future__ import annotations

import numpy as np

from ..errors import RuntimeInputError


def host(x, name: str) -> np.ndarray:
    """A NumPy copy of `x` (CuPy: .get(); PyTorch: .cpu()), keeping its dtype."""
    if hasattr(x, "get") and type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception as err:   # an object NumPy can't read: name the tensor, not NumPy's internals
        raise RuntimeInputError(f"{name}: cannot read it as an array ({err})") from None


def _int32_vector(x, name: str, length: int | None = None) -> np.ndarray:
    a = host(x, name)
    if a.dtype != np.int32:
        raise RuntimeInputError(f"{name} must be int32, got {a.dtype}")
    if a.ndim != 1 or (length is not None and a.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise RuntimeInputError(f"{name} must be {want}, got shape {a.shape}")
    return a


def check_paged(block_table, kv_lens, num_pages: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host copies (block_table (batch, max pages), kv_lens (batch,)) after checking that every page
    a sequence's kv_len needs (the first ceil(kv_len / page_size) entries of its row) indexes one
    of the cache's `num_pages` pages, and that no kv_len is negative or over its row's pages.
    Entries past a sequence's needed pages are never read and may hold anything (e.g. -1)."""
    table = host(block_table, "block_table")
    if table.dtype != np.int32:
        raise RuntimeInputError(f"block_table must be int32, got {table.dtype}")
    if table.ndim != 2:
        raise RuntimeInputError(f"block_table must be (batch, max pages per sequence), got shape {table.shape}")
    batch, max_pages = table.shape
    lens = _int32_vector(kv_lens, "kv_lens", batch)
    negative = np.flatnonzero(lens < 0)
    if negative.size:
        i = int(negative[0])
        raise RuntimeInputError(f"kv_lens[{i}] = {lens[i]} is negative")
    capacity = max_pages * page_size
    over = np.flatnonzero(lens > capacity)
    if over.size:
        i = int(over[0])
        raise RuntimeInputError(f"kv_lens[{i}] = {lens[i]} is over the cache: block_table gives each sequence "
                                f"{max_pages} pages x {page_size} = {capacity} keys")
    needed = -(-lens.astype(np.int64) // page_size)
    read = np.arange(max_pages)[None, :] < needed[:, None]
    bad = np.argwhere(read & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, i = (int(x) for x in bad[0])
        raise RuntimeInputError(f"block_table[{b}, {i}] = {table[b, i]} is out of range: the cache has {num_pages} "
                                f"pages (0..{num_pages - 1}), and sequence {b}'s kv_len {lens[b]} needs entries "
                                f"0..{needed[b] - 1}")
    return table, lens


def check_cu_seqlens(cu_seqlens, name: str, total: int, max_seqlen: int | None = None) -> np.ndarray:
    """The lengths (batch,) of `cu_seqlens` (batch + 1,) after checking it is int32, starts at 0,
    never decreases, ends at `total` tokens, and that no length exceeds `max_seqlen` (when given:
    the kernel sizes its grid by it, so a longer sequence would be cut short)."""
    cu = _int32_vector(cu_seqlens, name)
    if cu.shape[0] < 1:
        raise RuntimeInputError(f"{name} is empty; it holds batch + 1 offsets, starting at 0")
    if cu[0] != 0:
        raise RuntimeInputError(f"{name}[0] = {cu[0]}; it must start at 0")
    lengths = np.diff(cu.astype(np.int64))
    down = np.flatnonzero(lengths < 0)
    if down.size:
        i = int(down[0]) + 1
        raise RuntimeInputError(f"{name} is not non-decreasing: {name}[{i}] = {cu[i]} < {name}[{i - 1}] = {cu[i - 1]}")
    if cu[-1] != total:
        raise RuntimeInputError(f"{name}[{cu.shape[0] - 1}] = {cu[-1]}, but the packed tensor holds {total} tokens")
    if max_seqlen is not None:
        longer = np.flatnonzero(lengths > max_seqlen)
        if longer.size:
            i = int(longer[0])
            raise RuntimeInputError(f"max_seqlen for {name} is {max_seqlen}, but sequence {i} has {lengths[i]} tokens "
                                    f"({name}[{i + 1}] - {name}[{i}])")
    return lengths


def check_varlen(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int | None = None,
                 max_seqlen_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(q lengths, k lengths) per sequence, each checked by check_cu_seqlens; both describe the same
    number of sequences."""
    q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q)
    k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k)
    if q.shape != k.shape:
        raise RuntimeInputError(f"cu_seqlens_q has {q.shape[0] + 1} entries and cu_seqlens_k {k.shape[0] + 1}: "
                                "both hold one offset per sequence, plus one")
    return q, k
