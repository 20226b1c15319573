"""tiledsl.quantize_fp8 (in dispatch: it reads the reference's rotation signs): Q, K, V (16-bit PyTorch
tensors, (batch, heads, seqlen, d)) -> e4m3 tensors and float32
descales for FP8 attention, one kernel per tensor (templates/quantize_fp8.cu, compiled by CuPy's NVRTC).

Per block (block = rows, or (Q's rows, K's and V's rows): the FP8 kernel's tiles) each block's rows are read once
from HBM into one thread block's registers (up to RESIDENT_VALUES values per thread), reduced, quantized and
written from there. Per head (block None: FlashAttention-3's (batch, kv_heads) descales, Q's shared by its kv
head's query heads), per tensor (block "tensor") and blocks too large for one thread block's registers the absmax
is a reduction across thread blocks, so each tensor is read twice (absmax, then bytes).
rotate="hadamard": Q and K are rotated by the same diag(signs) H / sqrt(d) (signs from `seed`) before
quantization -- Q K^T is unchanged, the outliers spread over the head dim (incoherent processing); V is not.
Packed sequences (varlen_attention's (total, heads, d) with cu_seqlens): each sequence is its own batch entry,
descales per (sequence, kv head) or per tensor -- the two kinds the FP8 varlen kernel reads.
reference/fp8.quantize_model and rotate_rows compute the same bytes and descales in NumPy (float32, same order).
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import RuntimeInputError
from ..reference.fp8 import hadamard_signs

HADAMARD = "hadamard"
HEAD_DIMS = (64, 128, 256)   # the FP8 kernel's (and the rotation's: powers of two, 16 values on each of 4+ lanes)
LANE_VALUES = 16             # values a lane loads per row: two 16-byte loads in, one 16-byte store out
ITERS = 4                    # rows each thread holds (its registers: ITERS * LANE_VALUES floats)
THREADS = (128, 256, 512)    # thread block sizes; 512 keeps __launch_bounds__ at 128 registers (no spills)
TWO_PASS_THREADS = 256


def _template() -> str:
    from ..codegen.render import template_dir
    return (template_dir() / "quantize_fp8.cu").read_text()


def rows_per_thread_block(d: int, threads: int, iters: int = ITERS) -> int:
    """Rows one thread block of `threads` holds: a row is d / LANE_VALUES lanes, each thread `iters` rows."""
    return iters * threads * LANE_VALUES // d


def launch_shape(d: int, block_rows: int | None) -> tuple[int, int, bool]:
    """(threads, iters, resident) for a descale group of block_rows rows (None: a head or the tensor). Resident: the
    smallest thread block that holds the group; else two passes of TWO_PASS_THREADS x ITERS rows."""
    if block_rows is not None:
        for threads in THREADS:
            if rows_per_thread_block(d, threads) >= block_rows:
                per_pass = rows_per_thread_block(d, threads, 1)
                return threads, -(-block_rows // per_pass), True
    return TWO_PASS_THREADS, ITERS, False


def module_source(d: int, threads: int, iters: int, rotate: bool, bf16: bool) -> str:
    """The CUDA source of one quantize_fp8 configuration: the template behind its defines and the error word's
    header."""
    from ..codegen.render import header
    defines = (f"#define D {d}\n#define THREADS {threads}\n#define ITERS {iters}\n#define ROTATE {int(rotate)}\n"
               f"#define INPUT_BF16 {int(bf16)}\n#define INV_SQRT_D {float(np.float32(1.0 / np.sqrt(d))).hex()}f\n"
               "#include <cuda_fp16.h>\n")
    return defines + header("index_bounds.cuh") + "\n" + _template()


@functools.lru_cache(maxsize=None)
def _functions(d: int, threads: int, iters: int, rotate: bool, bf16: bool):
    import cupy
    module = cupy.RawModule(code=module_source(d, threads, iters, rotate, bf16), options=("--std=c++17",))
    return module.get_function("quantize_fp8"), module.get_function("descales_from_absmax")


@functools.lru_cache(maxsize=None)
def _device_signs(d: int, seed: int, device_index: int):
    import torch
    return torch.from_numpy(hadamard_signs(d, seed)).to(torch.device("cuda", device_index))


def quantize_fp8(q, k, v, block=None, rotate: str | None = None, seed: int = 0, *, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """(q8, k8, v8, q_descale, k_descale, v_descale): e4m3 tensors (torch.float8_e4m3fn, contiguous) and float32
    descales (value = byte * descale) for tiledsl.attention. `block`: None (per (batch, kv head)), "tensor", an int
    (rows per block of every tensor) or (Q rows, K/V rows) -- the FP8 kernel's tile sizes for its per-block
    descales (tiledsl.attention says which). `rotate`: None or "hadamard" (Q and K alike, from `seed`).

    Packed sequences for varlen_attention: q (total_q, heads, d), k and v (total_k, kv_heads, d) with `cu_seqlens_q`
    and `cu_seqlens_k` (int32 CUDA tensors of sequences + 1 offsets, as varlen_attention takes them); block None
    gives (sequences, kv_heads) descales, "tensor" one each. `max_seqlen_q` / `max_seqlen_k` bound the lengths (the
    grid); left out, they are read from the offsets on the host (a sync). The kernel checks the offsets: ones outside
    the tensor, going down, or a sequence longer than its max_seqlen are reported (the next tiledsl call or
    tiledsl.check_errors() raises it) and that sequence's bytes are not written."""
    import torch
    tensors = {"q": q, "k": k, "v": v}
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    rank, layout = (3, "(total, heads, d)") if packed else (4, "(batch, heads, seqlen, d)")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise RuntimeInputError(f"quantize_fp8: {name} must be a CUDA torch tensor, got {type(t).__name__}")
        # an empty tensor's strides say nothing (no byte is read)
        if t.dtype not in (torch.bfloat16, torch.float16) or t.dim() != rank or (t.stride(-1) != 1 and t.numel()):
            raise RuntimeInputError(f"quantize_fp8: {name} must be bf16 or fp16 {layout} with a unit "
                                    f"stride on d, got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
                                    + (" (packed sequences: cu_seqlens given)" if packed else ""))
    if rotate not in (None, HADAMARD):
        raise RuntimeInputError(f"quantize_fp8: rotate is None or 'hadamard', got {rotate!r}")
    if packed:
        return _quantize_packed(q, k, v, block, rotate, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if max_seqlen_q is not None or max_seqlen_k is not None:
        raise RuntimeInputError("quantize_fp8: max_seqlen_q / max_seqlen_k bound packed sequences: pass them with "
                                "cu_seqlens_q and cu_seqlens_k")
    batch, heads, _, d = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != d or heads % max(kv_heads, 1):
        raise RuntimeInputError(f"quantize_fp8: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                f"v {tuple(v.shape)}")
    _check_head_dims(tensors, 3)
    per_tensor = block == "tensor"
    if block is None or per_tensor:
        rows = {"q": None, "k": None, "v": None}
    elif isinstance(block, int) and block > 0:
        rows = {"q": block, "k": block, "v": block}
    elif isinstance(block, tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        rows = {"q": block[0], "k": block[1], "v": block[1]}
    else:
        raise RuntimeInputError(f"quantize_fp8: block is None, 'tensor', rows or (q rows, kv rows), got {block!r}")
    for name, r in rows.items():
        threads, _, resident = launch_shape(d, r)
        two_pass_rows = rows_per_thread_block(d, TWO_PASS_THREADS)
        if r is not None and not resident and r % two_pass_rows:
            raise RuntimeInputError(f"quantize_fp8: {name}'s blocks of {r} rows at head dim {d}: a block is at most "
                                    f"{rows_per_thread_block(d, THREADS[-1])} rows, or a multiple of {two_pass_rows}")
    signs = _device_signs(d, seed, q.device.index or 0) if rotate else None
    out = []
    for name, t in tensors.items():
        group = 0 if per_tensor else (heads // kv_heads if name == "q" else 1)
        out.append(_quantize(t, rows[name], group, signs if name != "v" else None))
    return tuple(o for o, _ in out) + tuple(s for _, s in out)


def _check_head_dims(tensors: dict, axis: int) -> None:
    for name, t in tensors.items():
        if t.shape[axis] not in HEAD_DIMS:
            raise RuntimeInputError(f"quantize_fp8: {name} has head dim {t.shape[axis]}; FP8 attention takes "
                                    f"{', '.join(map(str, HEAD_DIMS))}")


def _quantize_packed(q, k, v, block, rotate, seed, cu_q, cu_k, max_q, max_k):
    """quantize_fp8 of packed sequences (its docstring): the offsets checked for their kind and length here,
    their values on the device."""
    import torch

    from ..runtime.device_errors import TENSORS, raise_pending
    if cu_q is None or cu_k is None:
        raise RuntimeInputError("quantize_fp8: packed sequences need both cu_seqlens_q and cu_seqlens_k")
    heads, d = q.shape[1:]
    kv_heads = k.shape[1]
    if v.shape != k.shape or k.shape[2] != d or heads % max(kv_heads, 1):
        raise RuntimeInputError(f"quantize_fp8: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                f"v {tuple(v.shape)} (packed: q (total_q, heads, d), k and v (total_k, kv_heads, d))")
    _check_head_dims({"q": q, "k": k, "v": v}, 2)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if (not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1
                or cu.device != q.device):
            raise RuntimeInputError(f"quantize_fp8: {name} must be an int32 tensor (sequences + 1,) on {q.device}, got "
                                    f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}"
                                    + (f" on {cu.device}" if isinstance(cu, torch.Tensor) else ""))
    if cu_q.numel() != cu_k.numel():
        raise RuntimeInputError(f"quantize_fp8: cu_seqlens_q has {cu_q.numel() - 1} sequences, cu_seqlens_k "
                                f"{cu_k.numel() - 1}")
    if block not in (None, "tensor"):
        raise RuntimeInputError(f"quantize_fp8: packed sequences take block None (per (sequence, kv head)) or "
                                f"'tensor', got {block!r}: the FP8 varlen kernel reads no per-block descales")
    bounds = []
    for name, given, cu in (("max_seqlen_q", max_q, cu_q), ("max_seqlen_k", max_k, cu_k)):
        if given is None:   # the host reads the offsets (a sync); the kernel still checks them
            given = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
        elif isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise RuntimeInputError(f"quantize_fp8: {name} must be an int >= 0, got {given!r}")
        bounds.append(max(given, 0))
    raise_pending(q.device.index or 0)
    sequences = cu_q.numel() - 1
    signs = _device_signs(d, seed, q.device.index or 0) if rotate else None
    per_tensor = block == "tensor"
    code = {name: number for number, name in TENSORS.items()}   # the error word's tensor codes
    out = []
    for name, t, cu, bound, offsets in (("q", q, cu_q, bounds[0], "cu_seqlens_q"),
                                        ("k", k, cu_k, bounds[1], "cu_seqlens_k"),
                                        ("v", v, cu_k, bounds[1], "cu_seqlens_k")):
        group = 0 if per_tensor else (heads // max(kv_heads, 1) if name == "q" else 1)
        out.append(_quantize_sequences(t, cu, sequences, bound, group, signs if name != "v" else None,
                                       code[offsets]))
    return tuple(o for o, _ in out) + tuple(s for _, s in out)


def _quantize_sequences(t, cu, sequences: int, max_rows: int, group: int, signs, offsets_tensor: int):
    """One packed tensor's (e4m3, descale): absmax, descales and bytes over each sequence's rows (two passes)."""
    import torch
    total, heads, d = t.shape
    if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:2]):   # rows of 16-byte loads
        t = t.contiguous()
    out = torch.empty((total, heads, d), dtype=torch.uint8, device=t.device)
    descale = torch.ones((1,) if group == 0 else (sequences, heads // group), dtype=torch.float32, device=t.device)
    if not (sequences and heads):
        return out.view(torch.float8_e4m3fn), descale
    from ..runtime.device_errors import error_pointer
    threads, iters, _ = launch_shape(d, None)
    rows = rows_per_thread_block(d, threads)
    grid = (max(-(-max_rows // rows), 1), heads, sequences)   # one block at least: it checks the offsets
    strides = (np.int64(0), np.int64(t.stride(1)), np.int64(t.stride(0)))   # a sequence: rows from its offset
    out_strides = (np.int64(0), np.int64(d), np.int64(heads * d))
    packed = (pointer(cu.data_ptr()), np.int32(total), np.int32(offsets_tensor),
              pointer(error_pointer(t.device.index or 0, t)))
    _two_passes(t, out, descale, group, signs, np.int32(max_rows), 0, rows, strides, out_strides, packed, grid,
                threads, iters)
    return out.view(torch.float8_e4m3fn), descale


def _quantize(t, block_rows: int | None, group: int, signs):
    """One tensor's (e4m3, descale): one launch per block (resident), or absmax, descales and bytes."""
    import torch
    batch, heads, n, d = t.shape
    if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):   # rows of 16-byte loads
        t = t.clone(memory_format=torch.contiguous_format)
    out = torch.empty((batch, heads, n, d), dtype=torch.uint8, device=t.device)
    threads, iters, resident = launch_shape(d, block_rows)
    rows = block_rows if resident else rows_per_thread_block(d, threads)
    if block_rows:
        descale = torch.empty((batch, heads, -(-n // block_rows)), dtype=torch.float32, device=t.device)
    else:
        descale = torch.empty((1,) if group == 0 else (batch, heads // group), dtype=torch.float32, device=t.device)
    if not (n and batch and heads):
        if not block_rows:
            descale.fill_(1.0)
        return out.view(torch.float8_e4m3fn), descale
    strides = tuple(np.int64(s) for s in t.stride()[:3])
    out_strides = (np.int64(heads * n * d), np.int64(n * d), np.int64(d))
    batched = (pointer(0), np.int32(0), np.int32(0), pointer(0))   # no cu_seqlens
    grid = (-(-n // rows), heads, batch)
    if resident:
        kernel, _ = _functions(d, threads, iters, signs is not None, t.dtype == torch.bfloat16)
        common = _arguments(t, out, descale, None, signs, np.int32(n), group, block_rows or 0, rows, strides,
                            out_strides, batched)
        with _on_stream(t):
            kernel(grid, (threads,), common + (np.int32(0),))
    else:
        _two_passes(t, out, descale, group, signs, np.int32(n), block_rows or 0, rows, strides, out_strides, batched,
                    grid, threads, iters)
    return out.view(torch.float8_e4m3fn), descale


pointer = np.uint64   # device addresses as 64-bit kernel arguments


def _arguments(t, out, descale, absmax, signs, rows, group: int, group_rows: int, block_rows: int, strides,
               out_strides, packed) -> tuple:
    """The quantize_fp8 kernel's arguments before `mode` (templates/quantize_fp8.cu)."""
    return ((pointer(t.data_ptr()), pointer(out.data_ptr()), pointer(descale.data_ptr()),
             pointer(absmax.data_ptr() if absmax is not None else 0), pointer(signs.data_ptr() if signs is not None
                                                                              else 0),
             rows, np.int32(t.shape[1]), np.int32(group), np.int32(group_rows),
             np.int32(block_rows)) + tuple(strides) + tuple(out_strides) + tuple(packed))


def _on_stream(t):
    """CuPy's device and stream contexts for torch's current stream on t's device."""
    import contextlib

    import cupy
    import torch
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(t.device.index))
    stack.enter_context(cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream))
    return stack


def _two_passes(t, out, descale, group: int, signs, rows, group_rows: int, block_rows: int, strides, out_strides,
                packed, grid, threads: int, iters: int) -> None:
    """The absmax pass (atomics into int32 slots), the descales from it, then the bytes pass."""
    import torch
    kernel, finish = _functions(t.shape[-1], threads, iters, signs is not None, t.dtype == torch.bfloat16)
    absmax = torch.zeros(descale.shape, dtype=torch.int32, device=t.device)
    common = _arguments(t, out, descale, absmax, signs, rows, group, group_rows, block_rows, strides, out_strides,
                        packed)
    with _on_stream(t):
        kernel(grid, (threads,), common + (np.int32(1),))
        count = descale.numel()
        finish((-(-count // 128),), (128,), (pointer(absmax.data_ptr()), pointer(descale.data_ptr()), np.int32(count)))
        kernel(grid, (threads,), common + (np.int32(2),))
