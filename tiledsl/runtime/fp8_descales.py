"""The descales of FP8 attention (dtype = e4m3, the hopper family): float32 tensors with value = e4m3 byte *
descale, FlashAttention-3's q_descale / k_descale / v_descale.

Per tensor: one value each (a 1-element tensor, or None for 1.0). Per head: (batch, kv_heads) each -- Q's too,
shared by the query heads of a kv head, as FlashAttention-3 has it. Per block: Q's (batch, heads, q tiles),
K's and V's (batch, kv_heads, kv tiles), one per tile of the kernel's tile sizes (tiledsl.quantize_fp8 with
block = the kernel's tiles makes them). Packed sequences (layout = varlen) take per tensor or per head, (sequences,
kv_heads): sequence b's row, FlashAttention-3's varlen convention (per block is refused: families). The kernel
indexes them as contiguous arrays; descales are not read on the host (a zero or NaN descale gives what it gives, as
the reference does).
"""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..spec import Descale, DType
from .inputs import Shapes
from .launch import CallBuilder, allocator, is_compact
from .tensors import TensorView

FP8_DESCALES = ("q_descale", "k_descale", "v_descale")


def descale_shapes(kind: Descale, shapes: Shapes, tile_q: int, tile_kv: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of (q_descale, k_descale, v_descale) a launch of these shapes reads."""
    if kind is Descale.PER_TENSOR:
        return ((1,),) * 3
    if kind is Descale.PER_HEAD:
        return ((shapes.batch, shapes.kv_heads),) * 3
    kv_tiles = -(-shapes.kv_len // tile_kv)
    q_tiles = -(-shapes.q_len // tile_q)
    return ((shapes.batch, shapes.heads, q_tiles),) + ((shapes.batch, shapes.kv_heads, kv_tiles),) * 2


def descale_views(b: CallBuilder, first: int, kind: Descale, shapes: Shapes, tile_q: int, tile_kv: int,
                  kernel: str, batch_axis: str = "batch") -> tuple[TensorView, ...]:
    """The checked views of the call's descales at positions first.. (FP8_DESCALES order): float32, contiguous, on
    q's GPU, of descale_shapes' shapes (per tensor: any 1-element tensor). None is 1.0 per tensor and per head
    (ones made once for the prepared call); per block every descale must be given. `batch_axis` names shapes.batch
    in the errors ("sequences" for packed ones)."""
    views = []
    for i, (name, shape) in enumerate(zip(FP8_DESCALES, descale_shapes(kind, shapes, tile_q, tile_kv))):
        if len(b.tensors) <= first + i:
            raise RuntimeInputError(f"{kernel}: an FP8 kernel reads q_descale, k_descale and v_descale: call it (or "
                                    "bind it) with them")
        given = b.tensors[first + i]
        if given is not None and _dtype_name(given) != "float32":   # before the view, which names no rule
            raise RuntimeInputError(f"{kernel}: {name} must be float32, got {_dtype_name(given)}")
        t = b.view(first + i)
        if t is None:
            if kind is Descale.PER_BLOCK:
                raise RuntimeInputError(f"{kernel}: {name} is required with per-block descales: shape {shape} "
                                        f"(one per tile of {tile_q} queries / {tile_kv} keys; tiledsl.quantize_fp8)")
            ones = allocator(b.like, shape, DType.FP32)()
            ones.fill_(1.0) if hasattr(ones, "fill_") else ones.fill(1.0)
            b.keep.append(ones)
            from .tensors import view
            t = view(ones, name)
        views.append(check_descale(t, name, kind, shape, b.device_id, kernel, batch_axis))
    return tuple(views)


def _dtype_name(x) -> str:
    """A tensor's dtype as torch and NumPy/CuPy both spell it without prefix (float32, float64, ...)."""
    return str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.")


def check_descale(t: TensorView, name: str, kind: Descale, shape: tuple[int, ...], device_id: int,
                  kernel: str, batch_axis: str = "batch") -> TensorView:
    if t.dtype is not DType.FP32:
        raise RuntimeInputError(f"{kernel}: {name} must be float32, got {getattr(t.dtype, 'value', t.dtype)}")
    size = 1
    for n in t.shape:
        size *= n
    if kind is Descale.PER_TENSOR:
        if size != 1:
            raise RuntimeInputError(f"{kernel}: {name} is per tensor: one value, got shape {t.shape}")
    elif t.shape != shape:
        what = {Descale.PER_HEAD: f"({batch_axis}, kv_heads)", Descale.PER_BLOCK: f"({batch_axis}, heads, q tiles)"
                if name == "q_descale" else f"({batch_axis}, kv_heads, kv tiles)"}
        raise RuntimeInputError(f"{kernel}: {name} must have shape {what[kind]} = {shape}, got {t.shape}")
    elif not is_compact(t.shape, t.strides):
        raise RuntimeInputError(f"{kernel}: {name} must be contiguous, got strides {t.strides}")
    if t.device_id != device_id:
        raise RuntimeInputError(f"{kernel}: {name} is on GPU {t.device_id}, q on GPU {device_id}")
    return t
