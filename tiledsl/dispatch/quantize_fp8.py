"""tiledsl.quantize_fp8 (in dispatch: it reads the reference's rotation signs): Q, K, V (16-bit PyTorch
tensors, (batch, heads, seqlen, d)) -> e4m3 tensors and float32
descales for FP8 attention, one kernel per tensor (templates/quantize_fp8.cu, compiled by CuPy's NVRTC).

Per block (block = rows, or (Q's rows, K's and V's rows): the FP8 kernel's tiles) each block's rows are read once
from HBM: the absmax pass and the quantizing pass run in the same thread block, the second from L2. Per head
(block None: FlashAttention-3's (batch, kv_heads) descales, Q's shared by its kv head's query heads) and per
tensor (block "tensor") the absmax is a reduction over the whole head or tensor, so each tensor is read twice.
rotate="hadamard": Q and K are rotated by the same diag(signs) H / sqrt(d) (signs from `seed`) before
quantization -- Q K^T is unchanged, the outliers spread over the head dim (incoherent processing); V is not.
reference/fp8.quantize_model and rotate_rows compute the same bytes and descales in NumPy (float32, same order).
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import RuntimeInputError
from ..reference.fp8 import hadamard_signs

HADAMARD = "hadamard"
HEAD_DIMS = (64, 128, 256)   # the FP8 kernel's (and the rotation's: powers of two from 32 lanes x 2)
PASS_ROWS = 64               # rows a thread block covers where the descale group is a head or the tensor


def _template() -> str:
    from ..codegen.render import template_dir
    return (template_dir() / "quantize_fp8.cu").read_text()


@functools.lru_cache(maxsize=None)
def _module(d: int, rows: int, rotate: bool, bf16: bool):
    import cupy
    defines = (f"#define D {d}\n#define ROWS {rows}\n#define ROTATE {int(rotate)}\n#define INPUT_BF16 {int(bf16)}\n"
               f"#define INV_SQRT_D {float(np.float32(1.0 / np.sqrt(d))).hex()}f\n#include <cuda_fp16.h>\n")
    return cupy.RawModule(code=defines + _template(), options=("--std=c++17",))


def quantize_fp8(q, k, v, block=None, rotate: str | None = None, seed: int = 0):
    """(q8, k8, v8, q_descale, k_descale, v_descale): e4m3 tensors (torch.float8_e4m3fn, contiguous) and float32
    descales (value = byte * descale) for tiledsl.attention. `block`: None (per (batch, kv head)), "tensor", an int
    (rows per block of every tensor) or (Q rows, K/V rows) -- the FP8 kernel's tile sizes for its per-block
    descales (tiledsl.attention says which). `rotate`: None or "hadamard" (Q and K alike, from `seed`)."""
    import torch
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise RuntimeInputError(f"quantize_fp8: {name} must be a CUDA torch tensor, got {type(t).__name__}")
        if t.dtype not in (torch.bfloat16, torch.float16) or t.dim() != 4 or t.stride(-1) != 1:
            raise RuntimeInputError(f"quantize_fp8: {name} must be bf16 or fp16 (batch, heads, seqlen, d) with a unit "
                                    f"stride on d, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    batch, heads, _, d = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != d or heads % max(kv_heads, 1):
        raise RuntimeInputError(f"quantize_fp8: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                f"v {tuple(v.shape)}")
    for name, t in tensors.items():
        if t.shape[3] not in HEAD_DIMS:
            raise RuntimeInputError(f"quantize_fp8: {name} has head dim {t.shape[3]}; FP8 attention takes "
                                    f"{', '.join(map(str, HEAD_DIMS))}")
    if rotate not in (None, HADAMARD):
        raise RuntimeInputError(f"quantize_fp8: rotate is None or 'hadamard', got {rotate!r}")
    per_tensor = block == "tensor"
    if block is None or per_tensor:
        rows = {"q": None, "k": None, "v": None}
    elif isinstance(block, int) and block > 0:
        rows = {"q": block, "k": block, "v": block}
    elif isinstance(block, tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        rows = {"q": block[0], "k": block[1], "v": block[1]}
    else:
        raise RuntimeInputError(f"quantize_fp8: block is None, 'tensor', rows or (q rows, kv rows), got {block!r}")
    signs = torch.from_numpy(hadamard_signs(d, seed)).to(q.device) if rotate else None
    out = []
    for name, t in tensors.items():
        group = 0 if per_tensor else (heads // kv_heads if name == "q" else 1)
        out.append(_quantize(t, rows[name], group, signs if name != "v" else None))
    return tuple(o for o, _ in out) + tuple(s for _, s in out)


def _quantize(t, block_rows: int | None, group: int, signs):
    """One tensor's (e4m3, descale): one launch per block, or absmax, descales and quantize per head / tensor."""
    import cupy
    import torch
    batch, heads, n, d = t.shape
    out = torch.empty((batch, heads, n, d), dtype=torch.uint8, device=t.device)
    rows = block_rows or PASS_ROWS
    tiles = -(-n // rows)
    module = _module(d, rows, signs is not None, t.dtype == torch.bfloat16)
    kernel = module.get_function("quantize_fp8")
    if block_rows:
        descale = torch.empty((batch, heads, tiles), dtype=torch.float32, device=t.device)
    else:
        descale = torch.empty((1,) if group == 0 else (batch, heads // group), dtype=torch.float32, device=t.device)
    absmax = torch.zeros(descale.shape, dtype=torch.int32, device=t.device)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)
    pointer = np.uint64   # device addresses as 64-bit kernel arguments
    signs_ptr = pointer(signs.data_ptr() if signs is not None else 0)
    common = (pointer(t.data_ptr()), pointer(out.data_ptr()), pointer(descale.data_ptr()), pointer(absmax.data_ptr()),
              signs_ptr, np.int32(n),
              np.int32(heads), np.int32(group), np.int32(1 if block_rows else 0), np.int64(t.stride(0)),
              np.int64(t.stride(1)), np.int64(t.stride(2)))
    if n and batch and heads:
        with cupy.cuda.Device(t.device.index), stream:
            kernel((tiles, heads, batch), (256,), common + (np.int32(1),))
            if not block_rows:
                count = descale.numel()
                module.get_function("descales_from_absmax")((-(-count // 128),), (128,),
                                                            (pointer(absmax.data_ptr()), pointer(descale.data_ptr()),
                                                             np.int32(count)))
                kernel((tiles, heads, batch), (256,), common + (np.int32(2),))
    elif not block_rows:
        descale.fill_(1.0)
    return out.view(torch.float8_e4m3fn), descale
