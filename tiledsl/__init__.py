"""tiledsl: a tile DSL for attention kernels, compiled to readable CUDA."""
from .errors import LaunchError, RuntimeInputError, SpecError
from .spec import AUTO, Axis, CopyVia, DType, Family, KernelSpec, LoopOrder, Mask, Problem, Schedule, Span
from .parse import load_specs, parse_file, parse_text

from .version import __version__

__all__ = ["AUTO", "Axis", "CopyVia", "DType", "Family", "KernelSpec", "LoopOrder", "Mask", "Problem",
           "Schedule", "Span", "SpecError", "RuntimeInputError", "LaunchError", "__version__"]
