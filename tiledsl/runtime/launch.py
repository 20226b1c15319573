"""Prepared launches: what a warm call does.

The first call of a kernel with one *signature* (every tensor's shape, strides, dtype and device, and
the call's scalars: runtime/tensors.signature) checks its inputs, works out the grid, the split count,
the tensor maps and every scalar argument, and packs each launch's parameters into a reusable buffer:
a PreparedCall. Every later call with that signature reads the tensors' pointers (data_ptr(),
.data.ptr), checks their 16-byte alignment, allocates the outputs from the inputs' framework on the
caller's stream, writes the pointers into the buffers and launches: no views, no checks beyond
those, no graph, no rendering, no compilation.

A parameter (Arg) is a constant, or a pointer / tensor map whose address is the call's tensor
`slot` (the tensor's position in the call; outputs and scratch the call allocates come after). The
launch itself goes through one of three backends (LAUNCH_BACKEND; TILEDSL_LAUNCH overrides):

  "driver"         CuPy's thin binding of cuLaunchKernel (cupy.cuda.driver.launchKernel) with the
                   reused ctypes parameter buffer;
  "cuda-bindings"  NVIDIA's cuda-bindings cuLaunchKernel with the same buffer (imported lazily;
                   falls back to "driver" where it is not installed);
  "cupy"           CuPy's Function.__call__ with a tuple of NumPy scalars, packed by CuPy per call.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from ..errors import LaunchError, RuntimeInputError
from ..spec import DTYPES, DType
from . import device
from .tensors import TensorView, view

LAUNCH_BACKENDS = ("driver", "cuda-bindings", "cupy")
LAUNCH_BACKEND = "driver"    # until the launch benchmark says otherwise (bench/launch_bench.py)
ALIGNMENT = 16               # bytes: every 16-bit operand's rows are read 16 bytes at a time
# bytes: where each part of a call's workspace starts (runtime/launch.CallBuilder.workspace): as aligned as a
# separate allocation's start would be for the bulk copies and TMA maps that read it (they need 16)
WORKSPACE_ALIGNMENT = 256
_PART_SLOTS = 1 << 30        # a workspace part's slot until build() numbers it after the call's allocations
_SCRATCH_BYTES = {"float32": 4, "int32": 4}


class MapValue(NamedTuple):
    """An encoded TMA tensor map (16 words) of the tensor at `address`, and where that address
    lives in it: word `address_word` = `base` + (address >> `shift`) (found by
    runtime/tensor_maps.py); address_word -1: the map is encoded again for each new address
    (`reencode(address) -> words`)."""
    words: tuple
    address: int
    address_word: int
    base: int
    shift: int
    reencode: Callable | None = None


class Arg(NamedTuple):
    """One kernel parameter: `kind` "u64" (a pointer or unsigned), "i32", "i64" or "map" (a 128-byte
    tensor map); `slot` >= 0: the value is (or the map's address is) the call's tensor `slot`."""
    kind: str
    value: object
    slot: int = -1


def pointer_arg(t: TensorView | None) -> Arg:
    """A pointer parameter: the address of `t` (its call slot when it has one), 0 for None."""
    if t is None:
        return Arg("u64", 0)
    return Arg("u64", t.pointer, t.slot)


def address_arg(address: int) -> Arg:
    """A pointer parameter that is the same on every call (not one of the call's tensors)."""
    return Arg("u64", int(address))


def i32(x) -> Arg:
    return Arg("i32", int(x))


def i64(x) -> Arg:
    return Arg("i64", int(x))


def strides_args(t: TensorView, count: int = 3) -> tuple[Arg, ...]:
    """The first `count` strides of `t` (elements) as i64 parameters."""
    return tuple(i64(s) for s in t.strides[:count])


@dataclass
class Launch:
    """One kernel launch: the loaded function (CuPy's Function), grid, threads, dynamic shared
    memory and parameters; `label` names it in errors."""
    function: object
    grid: tuple[int, int, int]
    threads: int
    smem: int
    args: tuple
    label: str

    def describe(self) -> str:
        return f"{self.label} (grid {self.grid}, {self.threads} threads, {self.smem} B shared)"


# -- parameter buffers and backends ------------------------------------------------------------------

_C_TYPES = {"u64": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64}
_MASK64 = (1 << 64) - 1


class ParamBuffer:
    """A launch's parameters as ctypes values and the array of their addresses (cuLaunchKernel's
    kernelParams), built once; `fill(pointers)` rewrites only the slots' addresses."""

    def __init__(self, args: tuple):
        values, self.pointers, self.maps = [], [], []
        for a in args:
            if a.kind == "map":
                words = (ctypes.c_uint64 * len(a.value.words))(*a.value.words)
                values.append(words)
                if a.slot >= 0:
                    self.maps.append((words, a.slot, a.value))
            else:
                value = _C_TYPES[a.kind](a.value)
                values.append(value)
                if a.slot >= 0:
                    self.pointers.append((value, a.slot))
        self.values = values   # kept alive: the array holds their addresses
        self.array = (ctypes.c_void_p * max(len(values), 1))(*(ctypes.addressof(v) for v in values))
        self.address = ctypes.addressof(self.array)
        self.lock = threading.Lock()

    def fill(self, pointers: list) -> None:
        for value, slot in self.pointers:
            value.value = pointers[slot]
        for words, slot, m in self.maps:
            if m.address_word >= 0:
                words[m.address_word] = (m.base + (pointers[slot] >> m.shift)) & _MASK64
            else:
                words[:] = m.reencode(pointers[slot])


class DriverLaunch:
    """A Launch through cuLaunchKernel with a reused parameter buffer (backends "driver" and
    "cuda-bindings")."""

    def __init__(self, launch: Launch, bindings: bool):
        self.launch = launch
        self.buffer = ParamBuffer(launch.args)
        gx, gy, gz = launch.grid
        handle = int(launch.function.ptr)
        if bindings:
            from cuda.bindings import driver
            function = driver.CUfunction(handle)
            streams: dict = {}

            def call(stream: int, params: int, extra: int) -> None:
                s = streams.get(stream)
                if s is None:
                    s = streams[stream] = driver.CUstream(stream)
                err, = driver.cuLaunchKernel(function, gx, gy, gz, launch.threads, 1, 1, launch.smem, s, params, extra)
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuLaunchKernel: {err}")
        else:   # CuPy's binding itself, its leading arguments bound: (stream, params, extra) complete the call
            from cupy.cuda import driver
            call = functools.partial(driver.launchKernel, handle, gx, gy, gz, launch.threads, 1, 1, launch.smem)
        self.call = call

    def __call__(self, stream: int, pointers: list) -> None:
        buffer = self.buffer
        with buffer.lock:
            buffer.fill(pointers)
            try:
                self.call(stream, buffer.address, 0)
            except Exception as err:
                if "CONTEXT" not in str(err).upper():
                    raise LaunchError(f"{self.launch.describe()}: launch failed: {err}") from None
                # A thread whose first CUDA work is this launch has no current context yet: the
                # runtime makes the device's primary context current, then the launch goes again.
                device.make_context_current()
                try:
                    self.call(stream, buffer.address, 0)
                except Exception as again:
                    raise LaunchError(f"{self.launch.describe()}: launch failed: {again}") from None


class CupyLaunch:
    """A Launch through CuPy's Function.__call__ (backend "cupy"): NumPy scalars packed by CuPy."""

    def __init__(self, launch: Launch):
        import numpy as np

        self.launch = launch
        scalar = {"u64": np.uintp, "i32": np.int32, "i64": np.int64}
        self.template = [map_scalar(a.value.words) if a.kind == "map" else scalar[a.kind](a.value) for a in launch.args]
        self.patches = [(i, a) for i, a in enumerate(launch.args) if a.slot >= 0]
        self.streams: dict = {}

    def __call__(self, stream: int, pointers: list) -> None:
        import numpy as np

        args = list(self.template)
        for i, a in self.patches:
            if a.kind == "map":
                m = a.value
                words = list(m.words)
                if m.address_word >= 0:
                    words[m.address_word] = (m.base + (pointers[a.slot] >> m.shift)) & _MASK64
                else:
                    words = m.reencode(pointers[a.slot])
                args[i] = map_scalar(words)
            else:
                args[i] = np.uintp(pointers[a.slot])
        cupy_stream = self.streams.get(stream)
        if cupy_stream is None:
            cupy = device.cupy_module()
            cupy_stream = self.streams[stream] = cupy.cuda.ExternalStream(stream)
        launch = self.launch
        try:
            launch.function(launch.grid, (launch.threads, 1, 1), tuple(args), shared_mem=launch.smem,
                            stream=cupy_stream)
        except Exception as err:
            raise LaunchError(f"{launch.describe()}: launch failed: {err}") from None


def map_scalar(words):
    """A 128-byte struct parameter (a tensor map's 16 words) as the NumPy structured scalar CuPy passes
    by value."""
    import numpy as np
    value = np.zeros((), dtype=np.dtype([("words", np.uint64, (len(words),))]))
    value["words"] = [int(w) for w in words]
    return value[()]


def backend_name() -> str:
    """The launch backend in use: TILEDSL_LAUNCH, else LAUNCH_BACKEND; cuda-bindings falls back to the
    driver backend where it is not installed."""
    name = os.environ.get("TILEDSL_LAUNCH") or LAUNCH_BACKEND
    if name not in LAUNCH_BACKENDS:
        raise LaunchError(f"TILEDSL_LAUNCH must be one of {', '.join(LAUNCH_BACKENDS)}, got {name!r}")
    if name == "cuda-bindings":
        try:
            import cuda.bindings.driver  # noqa: F401
        except ImportError:
            return "driver"
    return name


def packed(launch: Launch, backend: str | None = None):
    """A callable `(stream handle, pointers) -> None` that launches `launch` through `backend`."""
    backend = backend or backend_name()
    if backend == "cupy":
        return CupyLaunch(launch)
    return DriverLaunch(launch, bindings=backend == "cuda-bindings")


def run_now(launches: list, stream: int) -> None:
    """Launch `launches` once with the addresses their parameters were built with (no call slots):
    the kernels' direct launches, for benchmarks and the tuner."""
    for launch in launches:
        packed(launch)(stream, [])


def replayer(launches: list, like):
    """A no-argument function that launches `launches` (built with fixed addresses) on the current
    stream of `like`'s framework: a benchmark's kernel time without the call around it."""
    runs = [packed(launch) for launch in launches]
    stream = device.stream_reader(like)

    def replay() -> None:
        handle = stream()
        for run in runs:
            run(handle, [])
    return replay


# -- prepared calls -----------------------------------------------------------------------------------

def _torch_pointers(tensors) -> list:
    return [0 if t is None else t.data_ptr() for t in tensors]


def _cupy_pointers(tensors) -> list:
    return [0 if t is None else t.data.ptr for t in tensors]


def _any_pointers(tensors) -> list:
    from .tensors import pointer
    return [pointer(t) for t in tensors]


class PreparedCall:
    """A call of one signature, ready to run: `outputs = prepared(*tensors)` with the tensors in
    the order the call was prepared with (None where absent). See the module docstring."""

    __slots__ = ("name", "names", "device_id", "read_pointers", "read_stream", "read_device", "aligned", "allocations",
                 "parts", "pick", "launches", "checks", "keep")

    def __init__(self, name, names, device_id, read_pointers, read_stream, aligned, allocations, results,
                 launches, checks, keep, parts=()):
        self.name, self.names, self.device_id = name, names, device_id
        self.read_pointers, self.read_stream = read_pointers, read_stream
        self.read_device = device.device_reader()
        self.aligned, self.allocations = aligned, allocations
        self.parts = parts   # byte offsets of the workspace's parts in the last allocation (slots after it)
        pick = operator.itemgetter(*results) if results else (lambda objects: ())
        self.pick = pick if len(results) != 1 else (lambda objects: (pick(objects),))
        self.launches, self.checks, self.keep = launches, checks, keep

    def __call__(self, *tensors):
        pointers = self.read_pointers(tensors)
        for slot in self.aligned:
            if pointers[slot] % ALIGNMENT:
                raise RuntimeInputError(f"{self.name}: {self.names[slot]} must start at a 16-byte aligned address "
                                        f"(got {pointers[slot]:#x})")
        for check in self.checks:
            check(tensors)
        if self.allocations:
            made = tuple([allocate() for allocate in self.allocations])
            pointers += self.read_pointers(made)
            tensors += made
            if self.parts:
                workspace = pointers[-1]
                pointers += [workspace + offset for offset in self.parts]
        if self.launches:
            stream = self.read_stream()
            if self.read_device() == self.device_id:
                for launch in self.launches:
                    launch(stream, pointers)
            else:
                with device.using_device(self.device_id):
                    for launch in self.launches:
                        launch(stream, pointers)
        return self.pick(tensors)


@dataclass
class CallBuilder:
    """Collects a PreparedCall on the slow path: the call's tensors (viewed once, with their slots),
    the outputs and scratch arrays it allocates per call, the per-call checks and the launches.

    `tensors` and `names` are the call's arguments in the order the PreparedCall will be called
    with; `like` is the tensor whose framework, device and stream the call uses. `immediate` builds
    one launch now instead (the kernels' direct `launch` and `bind`): allocations are real arrays and
    `run(stream)` launches with the pointers the views hold."""
    name: str
    tensors: tuple
    names: tuple
    like: object
    immediate: bool = False
    allocations: list = field(default_factory=list)   # (name, the no-argument function that makes the array)
    results: list = field(default_factory=list)       # slots (prepared) or arrays (immediate)
    aligned: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    keep: list = field(default_factory=list)
    parts: list = field(default_factory=list)         # (name, byte offset) of each part of the workspace
    workspace_bytes: int = 0
    device_id: int = field(init=False)

    def __post_init__(self):
        self.device_id = view(self.like, "q").device_id

    def view(self, index: int) -> TensorView | None:
        x = self.tensors[index]
        return None if x is None else view(x, self.names[index], -1 if self.immediate else index)

    def require_aligned(self, *views) -> None:
        """Check each view's address now and on every later call of this signature."""
        for t in views:
            if t is None:
                continue
            if t.pointer % ALIGNMENT:
                raise RuntimeInputError(f"{self.name}: {t.name} rows must be 16-byte aligned (address "
                                        f"{t.pointer:#x})")
            if t.slot >= 0 and t.slot not in self.aligned:
                self.aligned.append(t.slot)

    def allocate(self, name: str, shape: tuple, dtype) -> TensorView:
        """A view of an array the call allocates (contiguous, in the framework of `like`): per call
        when prepared, now when immediate."""
        shape = tuple(shape)
        if self.immediate:
            array = allocator(self.like, shape, dtype)()
            self.keep.append(array)
            return view(array, name)
        slot = len(self.tensors) + len(self.allocations)
        self.allocations.append((name, allocator(self.like, shape, dtype)))
        return TensorView(name, 0, shape, compact_strides(shape), dtype, self.device_id, None, slot)

    def workspace(self, name: str, shape: tuple, dtype: str) -> TensorView:
        """A view of a part of the call's workspace: one allocation per call (in the framework of `like`, like
        allocate's) holding every part, each WORKSPACE_ALIGNMENT-aligned, its bytes as the allocator left them:
        for scratch ("float32" or "int32") the call's kernels write before they read. Immediate: an array of
        its own."""
        shape = tuple(shape)
        if self.immediate:
            return self.allocate(name, shape, dtype)
        offset = -(-self.workspace_bytes // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
        count = 1
        for n in shape:
            count *= n
        self.workspace_bytes = offset + count * _SCRATCH_BYTES[dtype]
        self.parts.append((name, offset))
        slot = _PART_SLOTS + len(self.parts) - 1
        return TensorView(name, 0, shape, compact_strides(shape), dtype, self.device_id, None, slot)

    def provide(self, name: str, provider, shape: tuple = (2,), dtype="int32") -> TensorView:
        """A view of the array `provider()` returns, asked for per call when prepared (now when
        immediate): scratch the call does not allocate itself, e.g. a counter kept per stream."""
        if self.immediate:
            array = provider()
            self.keep.append(array)
            return view(array, name)
        slot = len(self.tensors) + len(self.allocations)
        self.allocations.append((name, provider))
        return TensorView(name, 0, tuple(shape), compact_strides(shape), dtype, self.device_id, None, slot)

    def new_output(self, name: str, shape: tuple, dtype: DType) -> TensorView:
        """An output the call always allocates (contiguous), returned after the others."""
        if dtype is DType.BF16 and not _is_torch(self.like):
            raise RuntimeInputError(f"{self.name}: CuPy has no bfloat16 dtype; pass PyTorch tensors")
        t = self.allocate(name, shape, dtype)
        self.results.append(t.owner if self.immediate else t.slot)
        return t

    def output(self, index: int, shape: tuple, dtype: DType, contiguous: bool = False) -> TensorView:
        """The output at call position `index`: checked when the caller passed it, else allocated.
        `contiguous` (LSE) or a unit stride on the last axis with 16-byte aligned rows (O)."""
        given = self.tensors[index]
        name = self.names[index]
        if given is None:
            if dtype is DType.BF16 and not _is_torch(self.like):
                raise RuntimeInputError(f"{self.name}: CuPy has no bfloat16 dtype; pass {name}= (e.g. a PyTorch "
                                        "tensor)")
            t = self.allocate(name, shape, dtype)
            self.results.append(t.owner if self.immediate else t.slot)
            return t
        t = view(given, name, -1 if self.immediate else index)
        check_output(t, self.name, tuple(shape), dtype, contiguous)
        if not contiguous:
            self.require_aligned(t)
        if t.device_id != self.device_id:
            raise RuntimeInputError(f"{self.name}: {name} is on GPU {t.device_id}, q on GPU {self.device_id}")
        self.results.append(given if self.immediate else index)
        return t

    def launch(self, function, grid, threads: int, smem: int, args: tuple, label: str) -> None:
        self.launches.append(Launch(function, tuple(grid), threads, smem, tuple(args), label))

    def run(self, stream=None) -> tuple:
        """Immediate mode: launch now on `stream` (a CuPy stream object or raw handle; None: the
        stream `like`'s framework is on) and return the outputs."""
        handle = device.stream_reader(self.like)() if stream is None else int(getattr(stream, "ptr", stream))
        run_now(self.launches, handle)
        return tuple(self.results)

    def build(self, backend: str | None = None) -> PreparedCall:
        like = self.like
        if all(t is None or _is_torch(t) for t in self.tensors) and _is_torch(like):
            read = _torch_pointers
        elif all(t is None or type(t).__module__.startswith("cupy") for t in self.tensors) and \
                type(like).__module__.startswith("cupy"):
            read = _cupy_pointers
        else:
            read = _any_pointers
        allocations = [make for _, make in self.allocations]
        names = tuple(self.names) + tuple(name for name, _ in self.allocations)
        launches = self.launches
        if self.parts:   # the workspace is the last allocation, its parts' slots follow it
            allocations.append(allocator(like, (max(self.workspace_bytes, 1),), "uint8"))
            names += ("workspace",) + tuple(name for name, _ in self.parts)
            first = len(self.tensors) + len(allocations) - _PART_SLOTS
            launches = [_renumbered(launch, first) for launch in launches]
        return PreparedCall(self.name, names, self.device_id, read, device.stream_reader(like), tuple(self.aligned),
                            allocations, tuple(self.results), [packed(launch, backend) for launch in launches],
                            tuple(self.checks), tuple(self.keep), tuple(offset for _, offset in self.parts))


def _renumbered(launch: Launch, shift: int) -> Launch:
    """`launch` with its workspace parts' provisional slots (_PART_SLOTS on) moved by `shift`."""
    args = tuple(a._replace(slot=a.slot + shift) if a.slot >= _PART_SLOTS else a for a in launch.args)
    return Launch(launch.function, launch.grid, launch.threads, launch.smem, args, launch.label)


def check_output(t: TensorView, kernel: str, shape: tuple, dtype: DType, contiguous: bool) -> None:
    """A caller's output array: its shape and dtype, and contiguous (LSE) or with a unit stride on
    the last axis and 16-byte aligned rows (O)."""
    got = f"got {t.shape} {getattr(t.dtype, 'value', t.dtype)} strides {t.strides}"
    if contiguous:
        if t.shape != shape or t.dtype is not dtype or t.strides != compact_strides(shape):
            raise RuntimeInputError(f"{kernel}: {t.name} must be a contiguous {dtype.value} array of shape {shape}, "
                                    f"{got}")
        return
    if t.shape != shape or t.dtype is not dtype:
        raise RuntimeInputError(f"{kernel}: {t.name} must be {shape} {dtype.value}, {got}")
    per_row = ALIGNMENT // DTYPES[dtype].bytes
    if t.strides[-1] != 1 or any(s % per_row for s in t.strides[:-1]):
        raise RuntimeInputError(f"{kernel}: {t.name} needs a unit stride on its last axis and 16-byte aligned rows, "
                                f"got strides {t.strides}")


def compact_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def is_compact(shape, strides) -> bool:
    """Whether a tensor's elements lie packed in row-major order: a dimension of size 1 may carry any stride
    (frameworks give such dimensions 0 or anything else after an expand or an unsqueeze)."""
    return all(n == 1 or s == want for n, s, want in zip(shape, strides, compact_strides(shape)))


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def allocator(like, shape: tuple, dtype, zero: bool = False):
    """A no-argument function that allocates an empty (or zeroed) `dtype` array of `shape` in `like`'s
    framework on its device: torch's caching allocator (stream-ordered, capture-safe; the fill runs
    on torch's current stream) or CuPy's pool."""
    name = DTYPES[dtype].torch if isinstance(dtype, DType) else dtype
    if _is_torch(like):
        import torch
        make = torch.zeros if zero else torch.empty
        return functools.partial(make, shape, dtype=getattr(torch, name), device=like.device)
    cupy = device.cupy_module()
    device_id = view(like, "q").device_id
    numpy_name = DTYPES[dtype].numpy if isinstance(dtype, DType) else dtype
    make = cupy.zeros if zero else cupy.empty

    def allocate():
        with cupy.cuda.Device(device_id):
            return make(shape, dtype=numpy_name)
    return allocate


class SignatureCache(dict):
    """signature -> PreparedCall, holding at most `limit` entries (the oldest go first): serving
    shapes change (batch, lengths), and each entry keeps its launch buffers."""

    def __init__(self, limit: int = 512):
        super().__init__()
        self.limit = limit
        _caches.add(self)

    __hash__ = object.__hash__   # held in a WeakSet by identity

    def put(self, key, value):
        if len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value


_caches: weakref.WeakSet = weakref.WeakSet()


def clear_prepared() -> None:
    """Forget every prepared call (each is rebuilt on its next call): after changing what a prepared
    call captured at build time, e.g. a test's allocator."""
    for cache in list(_caches):
        cache.clear()
