"""The tuner's results store: one JSON file of measurements, so a re-run answers without timing.

Location: $TILEDSL_TUNE_STORE, else ~/.cache/tiledsl/tune.json (`tiledsl tune --store` beats
both). Each entry is keyed by the sha256 of everything a measurement depends on: the kernel's
config, the problem shape, the GPU's name and the toolchain (NVRTC, CUDA runtime and driver
versions) and tiledsl's version; change any of them and the old entry is simply not found.

Writes are atomic (a temporary file in the same directory, then os.replace), and merge with
what another process may have written since this one read the file. A file that is not JSON, or
JSON that is not a tiledsl tune store, is never overwritten blindly and never crashes the tuner:
it is renamed to `<name>.corrupt-<timestamp>` with a one-line warning, and the store starts
empty.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..version import __version__

FORMAT = "tiledsl-tune-store"
FORMAT_VERSION = 1
ENV_VAR = "TILEDSL_TUNE_STORE"


def default_path() -> Path:
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(os.path.expanduser("~")) / ".cache" / "tiledsl" / "tune.json"


def entry_key(config: dict, shape: dict, gpu: str, toolchain: dict, version: str = __version__) -> str:
    """sha256 of (kernel config, problem shape, GPU name, toolchain versions, tiledsl version)."""
    blob = json.dumps({"config": config, "shape": shape, "gpu": gpu, "toolchain": toolchain, "tiledsl": version},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _warn(message: str) -> None:
    print(f"tiledsl tune: warning: {message}", file=sys.stderr)


class TuneStore:
    """{key: entry} backed by one JSON file. Entries are plain dicts (e.g. kernel, ms, tflops,
    valid, error); `get` returns None for a key not stored."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.entries: dict[str, dict] = self._read(move_aside=True)
        self._dirty: dict[str, dict] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self._dirty[key] = entry

    def _read(self, move_aside: bool) -> dict[str, dict]:
        """The file's entries; an unreadable or foreign file is moved aside (or, when reading again
        just before a write, treated as empty: the next write replaces it)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as err:
            _warn(f"cannot read {self.path} ({err.strerror}); starting with an empty store")
            return {}
        try:
            data = json.loads(text)
            problem = None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            data, problem = None, f"not valid JSON ({err.__class__.__name__} at {getattr(err, 'pos', '?')})"
        if problem is None:
            problem = _foreign(data)
        if problem is None:
            return dict(data["entries"])
        if move_aside:
            self._move_aside(problem)
        return {}

    def _move_aside(self, problem: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(self.path, target)
            _warn(f"{self.path} is {problem}; moved it to {target.name} and started an empty store")
        except OSError as err:
            _warn(f"{self.path} is {problem} and could not be moved aside ({err.strerror}); not using it")

    def save(self) -> None:
        """Write the store atomically, merged with entries another process wrote meanwhile."""
        if not self._dirty and self.path.exists():
            return
        merged = self._read(move_aside=False)
        merged.update(self._dirty)
        self.entries = {**merged, **self.entries}
        payload = {"format": FORMAT, "version": FORMAT_VERSION, "tiledsl": __version__, "entries": self.entries}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._dirty.clear()


def _foreign(data) -> str | None:
    """Why `data` is not a tune store of this format, or None when it is one."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return "not a tiledsl tune store"
    if data.get("version") != FORMAT_VERSION:
        return f"a tune store of format version {data.get('version')!r} (this tiledsl reads {FORMAT_VERSION})"
    entries = data.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        return "a tune store with malformed entries"
    return None
