"""The Python API's scalar arguments, checked before any spec is built: `causal`, `window`, `scale` and the
switches of tiledsl.attention, paged_attention, varlen_attention and attention_backward. Each value must
be one the DSL accepts for the same setting (spec.MAX_WINDOW, spec.SCALE_RANGE), so no call reaches a
kernel the checker would refuse; a bad value is a RuntimeInputError naming the function and the argument."""
from __future__ import annotations

import math
import operator

from ..errors import RuntimeInputError
from ..spec import MAX_WINDOW, SCALE_RANGE, Mask


# Plain Python only (no NumPy, no `numbers`): torch.compile traces tiledsl.attention, these checks with it.
def switch(api: str, name: str, value) -> bool:
    """A True / False argument (a Python or NumPy bool): 1, "yes" or None are refused, not guessed at."""
    if not (value is True or value is False or _numpy_bool(value)):
        raise RuntimeInputError(f"{api}: {name} must be True or False, got {value!r}")
    return bool(value)


def _numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _integer(value) -> int | None:
    """`value` as an int when it is one (Python or NumPy integers; not a bool, a float or a str), else None."""
    if value is True or value is False or _numpy_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def length_bound(api: str, name: str, value) -> int | None:
    """A bound on sequence lengths (max_seqlen_q / max_seqlen_k): None, or a non-negative int."""
    if value is None:
        return None
    bound = _integer(value)
    if bound is None or bound < 0:
        raise RuntimeInputError(f"{api}: {name} must be a non-negative int, got {value!r}")
    return bound


def window_sizes(api: str, window) -> tuple[int, int] | None:
    """`window=(left, right)`: two integers in 0..MAX_WINDOW (keys visible before / after the diagonal)."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise RuntimeInputError(f"{api}: window must be (left, right), two integers in 0..{MAX_WINDOW:,}, got "
                                f"{window!r}") from None
    sizes = []
    for side, size in (("left", left), ("right", right)):
        value = _integer(size)
        if value is None or not 0 <= value <= MAX_WINDOW:
            raise RuntimeInputError(f"{api}: window {side} must be an integer in 0..{MAX_WINDOW:,}, got {size!r}")
        sizes.append(value)
    return sizes[0], sizes[1]


def softmax_scale(api: str, scale) -> float | None:
    """`scale`: None (1/sqrt(head_dim)) or a finite number in SCALE_RANGE (0-d arrays and tensors too)."""
    if scale is None:
        return None
    low, high = SCALE_RANGE
    try:
        value = None if isinstance(scale, (bool, str, bytes)) else float(scale)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or not math.isfinite(value) or not low <= value <= high:
        raise RuntimeInputError(f"{api}: scale must be None (1/sqrt(head_dim)) or a finite number in "
                                f"{low:g}..{high:g}, got {scale!r}")
    return value


def mask_arguments(api: str, causal, window, scale) -> tuple[Mask, tuple[int, int] | None, float | None]:
    """(the Mask, the window as ints or None, the scale as a float or None) of an API call, after
    checking each argument; causal and a window exclude each other. Every call checks (a warm call
    too: `causal=1` must not find the kernel cached for True), the common case in a few comparisons."""
    if window is None and (scale is None or (type(scale) is float and SCALE_RANGE[0] <= scale <= SCALE_RANGE[1])):
        if causal is True:
            return Mask.CAUSAL, None, scale
        if causal is False:
            return Mask.NONE, None, scale
    causal = switch(api, "causal", causal)
    window = window_sizes(api, window)
    if causal and window is not None:
        raise RuntimeInputError(f"{api}: pass causal=True or window=(left, right), not both "
                                "(a causal window is window=(left, 0))")
    mask = Mask.WINDOW if window is not None else (Mask.CAUSAL if causal else Mask.NONE)
    return mask, window, softmax_scale(api, scale)
