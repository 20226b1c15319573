"""tiledsl: a tile DSL for attention kernels, compiled to readable CUDA.

`import tiledsl` loads only the spec types and errors; the front end (Lark), the scheduler graph
(networkx), the templates (Jinja2) and the runtime (CuPy) load on first use of the names that need
them, so the CLI and scripts that only check specs start fast."""
from __future__ import annotations

import importlib

from .errors import LaunchError, RuntimeInputError, SpecError
from .spec import AUTO, Axis, CopyVia, DType, Family, KernelSpec, LoopOrder, Mask, Mma, Problem, Schedule, Span
from .version import __version__

# name -> the module that defines it, imported on first access (PEP 562); tiledsl.compile(spec) is the
# documented API
_LAZY = {"load_specs": "frontend.parse", "parse_file": "frontend.parse", "parse_text": "frontend.parse",
         "SpecSpace": "frontend.space", "attention": "api", "Kernel": "runtime.kernel", "compile": "families",
         "paged_attention": "serving.paged", "varlen_attention": "serving.varlen",
         "attention_backward": "dispatch.backward", "PagedAttention": "serving.plan",
         "VarlenAttention": "serving.plan", "check_errors": "runtime.device_errors",
         "spec_for": "api", "quantize_fp8": "dispatch.quantize_fp8"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiledsl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The public names (and the module's dunders), not the imports this file uses itself."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})


__all__ = ["AUTO", "Axis", "CopyVia", "DType", "Family", "KernelSpec", "LoopOrder", "Mask", "Mma", "Problem",
           "Schedule", "Span", "SpecSpace", "Kernel", "attention", "attention_backward", "paged_attention",
           "varlen_attention", "quantize_fp8",
           "PagedAttention", "VarlenAttention", "check_errors", "spec_for", "compile",
           "load_specs", "parse_file", "parse_text",
           "SpecError", "RuntimeInputError", "LaunchError", "__version__"]
