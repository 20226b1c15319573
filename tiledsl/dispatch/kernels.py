"""The one per-process memo of compiled and loaded kernels: forward kernels (families.compile) and
backward modules (runtime/backward.compile_backward), each built and loaded once per spec. The module is
loaded (and its shared-memory limit raised) here, at first use, so no later launch -- e.g. one under
CUDA graph capture -- does either."""
from __future__ import annotations

from ..spec import KernelSpec

FORWARD, BACKWARD = "forward", "backward"
LOADED: dict[tuple[KernelSpec, str], object] = {}


def kernel_for(spec: KernelSpec, direction: str = FORWARD):
    """The loaded kernel of `spec` (`direction` BACKWARD: its backward module), built once per process."""
    kernel = LOADED.get((spec, direction))
    if kernel is None:
        if direction == BACKWARD:
            from ..runtime.backward import compile_backward
            kernel = compile_backward(spec)
            kernel.functions()
        else:
            from ..families import compile
            kernel = compile(spec)
            kernel.function()
        LOADED[(spec, direction)] = kernel
    return kernel


def add(kernel) -> None:
    """Remember an already built kernel (a warm record's, or one a test compiled in parallel)."""
    from ..runtime.backward import BackwardKernel
    LOADED.setdefault((kernel.spec, BACKWARD if isinstance(kernel, BackwardKernel) else FORWARD), kernel)
