"""Whether a kernel can run here at all: CuPy installed, a driver the CUDA runtime accepts and a device.
A machine with the GPU extras but no GPU (a laptop, a CI box) imports CuPy fine and fails at its first
CUDA call with the runtime's error; every command and call that needs a GPU asks here first and says so
in one line. No imports of the rest of the runtime: the tensor views ask too."""
from __future__ import annotations

from ..errors import RuntimeInputError

_gpu_usable = False   # once a device has answered, later calls skip the question


def gpu_missing() -> str:
    """Why no kernel can run here ("" when a GPU is usable): CuPy missing, or the CUDA runtime's own
    answer (no driver, a driver too old, no device). CuPy without a driver imports fine and fails at
    its first CUDA call, so the device count is asked for here, until a device has answered."""
    global _gpu_usable
    if _gpu_usable:
        return ""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'tiledsl[gpu]')"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as err:   # CuPy raises CUDARuntimeError (cudaErrorInsufficientDriver, cudaErrorNoDevice, ...)
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    _gpu_usable = count > 0
    return "" if _gpu_usable else "the CUDA runtime reports 0 devices"


def require_gpu(what: str) -> None:
    """RuntimeInputError, in one line, when `what` (e.g. "tiledsl run", "attention") cannot run here."""
    reason = gpu_missing()
    if reason:
        raise RuntimeInputError(f"{what} runs kernels on an NVIDIA GPU, and no NVIDIA GPU is usable here: {reason}")
