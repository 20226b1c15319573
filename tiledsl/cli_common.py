"""Option handling shared by the subcommands that take spec files."""
from __future__ import annotations

from .check import SpecSpace
from .parse import parse_file
from .spec import KernelSpec


def add_spec_arguments(parser, many: bool = True) -> None:
    parser.add_argument("specs", nargs="+" if many else None, metavar="SPEC", help=".tile file(s)")
    parser.add_argument("--name", help="only the kernel with this name (files may hold several)")


def concrete_specs(paths, name: str | None = None, expand_spaces: bool = False) -> list[KernelSpec]:
    """The concrete kernels of the given files, in file order; search spaces are expanded only
    when asked (a space is a set of kernels for `tiledsl tune`, not one kernel)."""
    paths = [paths] if isinstance(paths, str) else paths
    specs: list[KernelSpec] = []
    for path in paths:
        for item in parse_file(path):
            if isinstance(item, SpecSpace):
                if expand_spaces:
                    specs.extend(item.expand()[0])
                continue
            specs.append(item)
    if name is not None:
        specs = [s for s in specs if s.name == name]
    return specs


def add_shape_arguments(parser, seqlen_default=None) -> None:
    parser.add_argument("--seqlen", type=int, default=seqlen_default, help="query length (and kv length unless --seqlen-kv)")
    parser.add_argument("--seqlen-kv", type=int, help="kv length (default: --seqlen)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, help="kv heads for GQA (default: --heads)")
