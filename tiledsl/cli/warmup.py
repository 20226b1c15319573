"""`tiledsl warmup`: compile the tuned table's kernels (tuned.TUNED) for the GPU in hand into the
disk cache (runtime.cache_dir) with their warm records (runtime/warm.py), so the first `tiledsl.attention`
call of a process loads a cubin without the front end or NVRTC. Progress through tqdm when it is installed (the `gpu`
extra),
else one counter line per kernel."""
from __future__ import annotations

import sys
import time

from ..errors import CliError
from .common import bounded_int


def add_arguments(parser) -> None:
    parser.add_argument("--dtype", nargs="+", choices=("bf16", "fp16"), help="only these dtypes (default: all)")
    parser.add_argument("--head-dim", nargs="+", type=bounded_int(8, 256), metavar="D",
                        help="only these head dims (default: all)")


def gpu_arch() -> str:
    """sm_XY(a) of the current GPU; a one-line error when CuPy or a usable GPU is missing (nothing to
    compile for)."""
    from ..runtime.availability import require_gpu
    from ..runtime.device import device_arch
    try:
        import cupy  # noqa: F401 - only whether it imports
    except ImportError:
        raise CliError("tiledsl warmup compiles for the GPU in hand and needs CuPy, which is not installed: "
                       "pip install 'tiledsl[gpu]'") from None
    require_gpu("tiledsl warmup")
    return device_arch()


def entries(arch: str, dtypes: list[str] | None, head_dims: list[int] | None) -> list[tuple[str, int, str]]:
    """(dtype, head dim, mask) of the table entries for `arch` that the filters keep, in table order."""
    from ..dispatch.tuned import TUNED
    table = [(dtype, d, mask) for (a, dtype, d, mask) in TUNED if a == arch.rstrip("a")]
    if not table:
        raise CliError(f"the tuned table has no kernels for {arch}; `tiledsl.attention` picks schedules for it at "
                       "first call (run `tiledsl tune` to add some)")
    known = sorted({d for _, d, _ in table})
    unknown = sorted(set(head_dims or ()) - set(known))
    if unknown:
        raise CliError(f"--head-dim {', '.join(map(str, unknown))}: not in the tuned table for {arch} "
                       f"(it has {', '.join(map(str, known))})")
    return [(dtype, d, mask) for dtype, d, mask in table
            if (not dtypes or dtype in dtypes) and (not head_dims or d in head_dims)]


def _progress(items: list, label) -> object:
    """tqdm over `items` when tqdm is installed, else the items with a counter line per item."""
    try:
        from tqdm import tqdm
    except ImportError:
        def counted():
            for i, item in enumerate(items, 1):
                print(f"[{i}/{len(items)}] {label(item)}", file=sys.stderr, flush=True)
                yield item
        return counted()
    return tqdm(items, desc="tiledsl warmup", unit="kernel", file=sys.stderr)


def check_head_dims(head_dims: list[int] | None) -> None:
    """--head-dim values the tuned table has for some GPU, checked before the GPU is asked for."""
    from ..dispatch.tuned import TUNED
    known = sorted({d for (_, _, d, _) in TUNED})
    unknown = sorted(set(head_dims or ()) - set(known))
    if unknown:
        raise CliError(f"--head-dim {', '.join(map(str, unknown))}: not in the tuned table (it has "
                       f"{', '.join(map(str, known))}); `tiledsl.attention` picks a schedule for others at first call")


def run(args) -> int:
    from ..runtime.compile import cache_dir
    from ..spec import DType, Mask
    from ..dispatch.tuned import resolve
    check_head_dims(args.head_dim)
    arch = gpu_arch()
    todo = entries(arch, args.dtype, args.head_dim)
    start = time.perf_counter()
    for dtype, d, mask in _progress(todo, lambda item: f"{item[0]} d{item[1]} {item[2]}"):
        resolve(arch, DType(dtype), d, Mask(mask))   # compiles, loads, and writes the warm record (runtime/warm.py)
    print(f"{len(todo)} kernels for {arch} in {cache_dir()} ({time.perf_counter() - start:.1f} s)")
    return 0
