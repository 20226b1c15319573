"""TMA tensor maps for the Hopper family, encoded on the host with the CUDA driver
(`cuTensorMapEncodeTiled`, through NVIDIA's cuda-bindings package).

A (batch, heads, seqlen, head_dim) tensor with any strides whose last is 1 is described as a
4-d tensor (head_dim, seqlen, heads, batch); one box is 64 columns (128 bytes, one swizzled
wgmma panel) by `box_rows` rows of one head. Rows past the sequence end come back as zeros, so
tails need no padding. The map is handed to the kernel by value (a 128-byte struct parameter).
"""
from __future__ import annotations

from collections import OrderedDict

from ..errors import LaunchError, RuntimeInputError
from ..hw import PANEL_COLUMNS
from .tensors import TensorView

STRIDE_ALIGN = 16           # TMA: every global stride a multiple of 16 bytes (checked before launch)
ELEMENT_BYTES = 2
_CACHE_SIZE = 64
_cache: OrderedDict = OrderedDict()


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise LaunchError("the hopper family encodes TMA tensor maps through NVIDIA's cuda-bindings "
                          "(pip install 'tiledsl[gpu]')") from None
    return driver


def _map_dtype():
    import numpy as np
    return np.dtype([("words", np.uint64, (16,))])


def tensor_map(t: TensorView, box_rows: int):
    """The encoded map of `t` (a NumPy structured scalar of 128 bytes), cached per tensor layout."""
    key = (t.pointer, t.shape, t.strides, box_rows, t.device_id)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    import numpy as np
    cu = _driver()
    batch, heads, rows, columns = t.shape
    dims = [columns, rows, heads, batch]
    strides = [t.strides[2] * ELEMENT_BYTES, t.strides[1] * ELEMENT_BYTES, t.strides[0] * ELEMENT_BYTES]
    # A unit-size dimension's stride is never used: any legal value will do.
    strides = [s if s > 0 else STRIDE_ALIGN for s in strides]
    err, encoded = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, t.pointer,
        [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
        [cu.cuuint32_t(PANEL_COLUMNS), cu.cuuint32_t(box_rows), cu.cuuint32_t(1), cu.cuuint32_t(1)],
        [cu.cuuint32_t(1)] * 4,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeInputError(f"{t.name}: cannot describe shape {t.shape} strides {t.strides} as a TMA tensor map "
                                f"({err})")
    value = np.zeros((), dtype=_map_dtype())
    value["words"] = [int(w) for w in encoded.opaque]
    if len(_cache) >= _CACHE_SIZE:
        _cache.popitem(last=False)
    _cache[key] = value[()]
    return _cache[key]
