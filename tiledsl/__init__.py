"""tiledsl: a tile DSL for attention kernels, compiled to readable CUDA."""
from .errors import LaunchError, RuntimeInputError, SpecError
from .spec import AUTO, Axis, CopyVia, DType, Family, KernelSpec, LoopOrder, Mask, Mma, Problem, Schedule, Span
from .parse import load_specs, parse_file, parse_text
from .tuned import attention
from .runtime import Kernel
from .families import compile  # noqa: A004 - tiledsl.compile(spec) is the documented API

from .version import __version__

__all__ = ["AUTO", "Axis", "CopyVia", "DType", "Family", "KernelSpec", "LoopOrder", "Mask", "Mma", "Problem",
           "Schedule", "Span", "Kernel", "attention", "compile", "load_specs", "parse_file", "parse_text", "SpecError", "RuntimeInputError", "LaunchError", "__version__"]
