"""TMA tensor maps for the Hopper family, encoded on the host with the CUDA driver
(`cuTensorMapEncodeTiled`, through NVIDIA's cuda-bindings package). A prepared call encodes a
map once and rewrites only its address word for each new tensor (map_arg, address_field).

A (batch, heads, seqlen, head_dim) tensor with any strides whose last is 1 is described as a
4-d tensor (head_dim, seqlen, heads, batch); one box is 64 columns (128 bytes, one swizzled
wgmma panel) by `box_rows` rows of one head. Rows past the sequence end come back as zeros, so
tails need no padding. The map is handed to the kernel by value (a 128-byte struct parameter).
"""
from __future__ import annotations

from ..errors import LaunchError, RuntimeInputError
from ..hw import PANEL_COLUMNS
from .launch import Arg, MapValue
from .tensors import TensorView

STRIDE_ALIGN = 16           # TMA: every global stride a multiple of 16 bytes (checked before launch)
ELEMENT_BYTES = 2


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise LaunchError("the hopper family encodes TMA tensor maps through NVIDIA's cuda-bindings "
                          "(pip install 'tiledsl[gpu]')") from None
    return driver


# Element types of the maps: 16-bit operands (the bits as uint16), and fp32 accumulators (the warp-specialized
# backward's TMA reduce-add into dQ_accum, boxes of 32 columns: one 128-byte swizzled row), e4m3 operands as
# bytes in 128-byte swizzled rows, or 64-byte ones where a row is 64 bytes (layout/hopper.fp8_swizzle).
# Each: (data type, element bytes, box columns, swizzle mode).
ELEMENTS = {"uint16": ("CU_TENSOR_MAP_DATA_TYPE_UINT16", ELEMENT_BYTES, PANEL_COLUMNS, "CU_TENSOR_MAP_SWIZZLE_128B"),
            "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4, 32, "CU_TENSOR_MAP_SWIZZLE_128B"),
            "e4m3": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, 128, "CU_TENSOR_MAP_SWIZZLE_128B"),
            "e4m3_64": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, 64, "CU_TENSOR_MAP_SWIZZLE_64B")}


def e4m3_element(row_bytes: int) -> str:
    """The ELEMENTS key of an e4m3 operand whose rows (head dim) hold `row_bytes`."""
    return "e4m3_64" if row_bytes == 64 else "e4m3"
# Where a map of an array a prepared call allocates (no address yet: view pointer 0) is encoded; its address
# word is rewritten per call like any other map's.
PLACEHOLDER_ADDRESS = 1 << 40


def encode(t: TensorView, box_rows: int, address: int | None = None, element: str = "uint16") -> tuple[int, ...]:
    """The 16 words of `t`'s map with boxes of `box_rows` rows (at `address` instead of t.pointer
    when given: the encoder reads no memory, so any 16-byte aligned address encodes)."""
    cu = _driver()
    data_type, element_bytes, box_columns, swizzle = ELEMENTS[element]
    batch, heads, rows, columns = t.shape
    dims = [columns, rows, heads, batch]
    strides = [t.strides[2] * element_bytes, t.strides[1] * element_bytes, t.strides[0] * element_bytes]
    # A unit-size dimension's stride is never used: any legal value will do.
    strides = [s if s > 0 else STRIDE_ALIGN for s in strides]
    address = t.pointer if address is None else address

    def encoded_map():
        return cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, data_type), 4, address or PLACEHOLDER_ADDRESS,
            [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(box_columns), cu.cuuint32_t(box_rows), cu.cuuint32_t(1), cu.cuuint32_t(1)],
            [cu.cuuint32_t(1)] * 4,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(cu.CUtensorMapSwizzle, swizzle),
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    err, encoded = encoded_map()
    if err == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread whose first CUDA work is this (autograd's backward thread, preparing a call there) has no current
        # context yet: the tensor's device's primary context is made current, then the map is encoded again.
        from . import device
        with device.using_device(t.device_id):
            device.make_context_current()
            err, encoded = encoded_map()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeInputError(f"{t.name}: cannot describe shape {t.shape} strides {t.strides} as a TMA tensor map "
                                f"({err})")
    return tuple(int(w) for w in encoded.opaque)


# Two probe offsets (multiples of 16 bytes, far apart): a map whose words differ from the original's
# in one word, by the offset shifted right by the same amount both times, stores its address there.
_PROBES = (1 << 21, 1 << 33)


def address_field(t: TensorView, box_rows: int, words: tuple, element: str = "uint16") -> tuple[int, int, int] | None:
    """(word, base, shift) such that the map of `t` at any address a has word = base + (a >> shift)
    and every other word as in `words`; None when the encoding does not look like that (the map is
    then encoded again for each new address)."""
    found = None
    pointer = t.pointer or PLACEHOLDER_ADDRESS
    for delta in _PROBES:
        other = encode(t, box_rows, pointer + delta, element)
        changed = [i for i, (a, b) in enumerate(zip(words, other)) if a != b]
        if len(changed) != 1:
            return None
        i = changed[0]
        step = (other[i] - words[i]) & ((1 << 64) - 1)
        shifts = [s for s in range(8) if step == delta >> s]
        if not shifts or (found is not None and (found[0], found[2]) != (i, shifts[0])):
            return None
        found = (i, (words[i] - (pointer >> shifts[0])) & ((1 << 64) - 1), shifts[0])
    return found


_fields: dict = {}


def map_arg(t: TensorView, box_rows: int, element: str = "uint16"):
    """The kernel parameter of `t`'s map (runtime/launch.Arg "map"), with the address field found
    once per layout so that a prepared call only rewrites one word for a new tensor. `element`: a key of
    ELEMENTS (its box width follows)."""
    words = encode(t, box_rows, element=element)
    layout = (t.shape, t.strides, box_rows, t.device_id, element)
    if layout not in _fields:
        _fields[layout] = address_field(t, box_rows, words, element)
    field = _fields[layout]
    if field is None:
        def reencode(address: int) -> tuple[int, ...]:
            return encode(t, box_rows, address, element)
        return Arg("map", MapValue(words, t.pointer, -1, 0, 0, reencode), t.slot)
    word, base, shift = field
    return Arg("map", MapValue(words, t.pointer, word, base, shift), t.slot)
