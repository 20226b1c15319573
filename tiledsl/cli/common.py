"""Option handling shared by the subcommands: spec files in, bounded shape options."""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from ..frontend.space import SpecSpace
from ..errors import CliError, SpecError
from ..frontend.parse import parse_file
from ..spec import KernelSpec

MAX_SEQLEN = 1 << 24        # run / bench: far past any GPU's memory at batch 1
# explain / tune: the traffic model walks every (q tile, kv tile) pair, so its time and memory grow
# with seqlen^2 (2^18 takes ~1.5 s and 0.3 GB; 10^12 asked for 58 GiB).
MAX_MODEL_SEQLEN = 1 << 18
MAX_COUNT = 1 << 16         # --batch, --heads


def bounded_int(low: int, high: int):
    """An argparse type: an integer in low..high, else a one-line error naming the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high:,}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high:,}, got {value:,}")
        return value
    parse.__name__ = "integer"
    return parse


SEQLEN = bounded_int(1, MAX_SEQLEN)
MODEL_SEQLEN = bounded_int(1, MAX_MODEL_SEQLEN)
COUNT = bounded_int(1, MAX_COUNT)


def add_spec_arguments(parser, many: bool = True) -> None:
    parser.add_argument("specs", nargs="+" if many else None, metavar="SPEC", help=".tile file(s)")
    parser.add_argument("--name", help="only the kernels of the attention block with this name")


def read_items(path) -> list[KernelSpec | SpecSpace]:
    """The attention blocks of one file; a file with none is an error (an empty or comment-only
    file is almost certainly the wrong file)."""
    items = parse_file(path)
    if not items:
        raise CliError(f"no attention blocks in {path}")
    return items


def concrete_specs(paths, name: str | None = None, expand_spaces: bool = False, notes: list[str] | None = None,
                   items: dict | None = None, verbose: bool = False) -> list[KernelSpec]:
    """The concrete kernels of the given files, in file order (a file named twice is read once);
    search spaces are expanded only when asked (a space is a set of kernels for `tiledsl tune`, not
    one kernel), and a line of counts per space is appended to `notes` (with `verbose`, every
    rejected config and its reason too). Two blocks that define the same kernel are a SpecError at
    the second; --name that matches no block is an error listing the names there are. `items`:
    files already parsed, by path."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    paths = list({os.path.realpath(p): p for p in reversed(paths)}.values())[::-1]   # first mention kept
    specs: list[KernelSpec] = []
    seen: dict[str, KernelSpec] = {}   # concrete blocks by kernel name
    emitted: set[str] = set()
    names: list[str] = []
    for path in paths:
        for item in (items[path] if items and path in items else read_items(path)):
            names.append(item.name)
            if name is not None and item.name != name:
                continue
            if isinstance(item, SpecSpace):
                if expand_spaces:
                    legal, rejected = item.expand()
                    if notes is not None:
                        notes.append(f"space '{item.name}': {item.size} configs, {len(legal)} legal, {len(rejected)} "
                                     f"rejected" + ("" if verbose or not rejected else
                                                    f" (`tiledsl check {path}` says why)"))
                        if verbose:
                            notes += ["    rejected  "
                                      + " ".join(f"{k}={getattr(v, 'value', v)}" for k, v in config.items())
                                      + f": {reason}" for config, reason in rejected]
                    # a config of a space that repeats another block's is the same kernel: once is enough
                    specs.extend(spec for spec in legal if spec.kernel_name not in emitted)
                    emitted.update(spec.kernel_name for spec in legal)
                continue
            first = seen.setdefault(item.kernel_name, item)
            if first is not item:   # two concrete blocks: the second is a mistake (one file overwrote the other)
                where = f"line {first.span.line}" if first.span else "an earlier block"
                if first.source_file != item.source_file:
                    where += f" of {first.source_file}"
                raise SpecError(f"'{item.name}' defines the same kernel as '{first.name}' ({where}): "
                                f"{item.kernel_name}", item.span, item.source_text,
                                "change its schedule or remove one of the two blocks")
            if item.kernel_name not in emitted:
                specs.append(item)
                emitted.add(item.kernel_name)
    if name is not None and name not in names:
        raise CliError(f"--name {name}: no attention block of that name in {', '.join(map(str, paths))}; "
                       f"there are: {', '.join(dict.fromkeys(names))}")
    return specs


def add_shape_arguments(parser, seqlen_default=None) -> None:
    parser.add_argument("--seqlen", type=SEQLEN, default=seqlen_default,
                        help="query length (and kv length unless --seqlen-kv)")
    parser.add_argument("--seqlen-kv", type=SEQLEN, help="kv length (default: --seqlen)")
    parser.add_argument("--batch", type=COUNT, default=2)
    parser.add_argument("--heads", type=COUNT, default=8)
    parser.add_argument("--kv-heads", type=COUNT, help="kv heads for GQA (default: --heads)")


def check_kv_heads(heads: int | None, kv_heads: int | None) -> None:
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise CliError(f"--kv-heads {kv_heads} must divide --heads {heads} (each kv head serves a whole group)")


def writable_folder(option: str, folder) -> Path:
    """Create the output folder `folder` given by `option`; a one-line error when it can't be."""
    if not str(folder).strip():   # Path("") is the current folder: an empty option is a mistake, not a choice
        raise CliError(f"{option} '': give a folder name (e.g. {option} out/generated)")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CliError(f"{option} {folder}: exists and is not a folder") from None
    except NotADirectoryError:
        raise CliError(f"{option} {folder}: a parent of this path is a file, not a folder") from None
    except OSError as err:
        raise CliError(f"{option} {folder}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"{option} {folder}: the folder is not writable")
    return folder


def gpu_ready(command: str, specs: list[KernelSpec], torch_for: str = "") -> None:
    """Refuse up front, in one line, what would fail midway: a kernel whose family has no template (a
    SpecError at its block), CuPy missing, no usable GPU (no driver, a driver too old, no device: CuPy
    imports fine without one), PyTorch missing or blind to the GPU where `torch_for` says it is needed."""
    from ..families import lower
    from ..runtime.availability import require_gpu
    for spec in specs:
        lower(spec)
    if importlib.util.find_spec("cupy") is None:
        raise CliError(f"tiledsl {command} runs kernels on a GPU and needs CuPy, which is not installed: "
                       "pip install 'tiledsl[gpu]'")
    if torch_for and importlib.util.find_spec("torch") is None:
        raise CliError(f"{torch_for} needs PyTorch, which is not installed: pip install 'tiledsl[bench]'")
    require_gpu(f"tiledsl {command}")
    if not torch_for:
        return
    import torch
    if not torch.cuda.is_available():   # a CPU-only build, or a driver torch cannot use
        raise CliError(f"{torch_for} needs PyTorch with CUDA, and this PyTorch sees no GPU "
                       f"(torch {torch.__version__}: torch.cuda.is_available() is False)")
