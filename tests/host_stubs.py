"""A GPU-free stand-in for the launch path's hardware, for CPU tests and bench/host_path_cpu.py: a fake
`torch` (tensors with shape, stride(), dtype, device and data_ptr() over fake addresses; empty, zeros,
full), a fake `cupy` (current device, device context, `cuda.driver.launchKernel` recording every
launch with its parameter values), and stubs for what needs a GPU or NVRTC (device arch and limits,
loading a cubin's functions, compiling, TMA map encoding). Everything between the public API and
cuLaunchKernel is the real code: the prepared calls, their parameter buffers and the launch backend.

    with stub_device() as device:     # or the `stubbed` pytest fixture
        q = device.tensor((1, 8, 128, 64))
        tiledsl.attention(q, q, q)
        device.launches[-1]           # (function name, grid, threads, smem, parameter values)

`stub_device(tmp, real_torch=True)` keeps the installed (CPU) torch instead of the fake one: its host tensors
stand in for device 0's, so the real autograd engine runs the backward (bench/backward_host_cpu.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import types
from pathlib import Path

import numpy as np

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "float8_e4m3fn": 1, "int64": 8, "uint8": 1,
            "float64": 8}


class FakeDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


class FakeDevice:
    def __init__(self, kind="cuda", index=0):
        if isinstance(kind, FakeDevice):
            kind, index = kind.type, kind.index
        elif isinstance(kind, str) and ":" in kind:
            kind, index = kind.split(":")[0], int(kind.split(":")[1])
        self.type, self.index = kind, index
        self.key = (kind, index)

    def __eq__(self, other):
        return type(other) is FakeDevice and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"device(type='{self.type}', index={self.index})"


class FakeGenerator:
    """A CUDA generator's Philox state as torch's CUDA generators keep it: a seed and an offset."""

    def __init__(self, seed=67280421310721):
        self.manual_seed(seed)

    def manual_seed(self, seed):
        self.seed, self.offset = int(seed), 0
        return self

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = int(offset)


_addresses = itertools.count(1 << 32, 1 << 20)   # 1 MiB apart: every fake tensor 16-byte aligned


class FakeTensor:
    """shape, stride(), dtype, device, data_ptr(): what the runtime reads of a torch tensor."""

    requires_grad = False

    def __init__(self, shape, dtype, device=None, strides=None, address=None, host=None):
        self.shape = shape if type(shape) is tuple else tuple(int(n) for n in shape)
        self.dtype = dtype
        self.device = device if type(device) is FakeDevice else FakeDevice(device or "cuda")
        self._strides = strides
        self._address = next(_addresses) if address is None else address
        self.host = host   # a NumPy copy for index tensors (kv_lens, block tables)

    def stride(self):
        if self._strides is None:
            self._strides = _compact(self.shape)
        return self._strides

    def data_ptr(self):
        return self._address

    def dim(self):
        return len(self.shape)

    def is_floating_point(self):
        return self.dtype.name.startswith("float") or self.dtype.name == "bfloat16"

    def swapaxes(self, a, b):
        shape, strides = list(self.shape), list(self._strides)
        shape[a], shape[b], strides[a], strides[b] = shape[b], shape[a], strides[b], strides[a]
        return FakeTensor(shape, self.dtype, self.device, strides, self._address)

    transpose = swapaxes

    def pin_memory(self):
        return self

    def to(self, device, non_blocking=False):
        return FakeTensor(self.shape, self.dtype, FakeDevice(device), None, None, self.host)

    def detach(self):
        return self

    def requires_grad_(self, requires_grad=True):
        self.requires_grad = requires_grad
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.host

    def contiguous(self):
        if self.stride() == _compact(self.shape):
            return self
        return FakeTensor(self.shape, self.dtype, self.device)   # a copy: new memory

    def __getitem__(self, index):
        """A slice [start:stop] of the first axis (the plan's views of its metadata buffer, a batch's rows), or
        [..., :stop] of the last (the first columns, a view)."""
        if isinstance(index, tuple):
            ellipsis, columns = index
            assert ellipsis is Ellipsis and columns.start is None and columns.step is None
            return FakeTensor(self.shape[:-1] + (min(columns.stop, self.shape[-1]),), self.dtype, self.device,
                              self.stride(), self._address)
        start, stop, _ = index.indices(self.shape[0])
        strides = self.stride()
        host = None if self.host is None else self.host[start:stop]
        return FakeTensor((max(stop - start, 0),) + self.shape[1:], self.dtype, self.device, strides,
                          self._address + start * strides[0] * ITEMSIZE[self.dtype.name], host)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        host = None if self.host is None else self.host.reshape(shape)
        return FakeTensor(shape, self.dtype, self.device, None, self._address, host)

    def copy_(self, src, non_blocking=False):
        if self.host is not None and src.host is not None:
            self.host[...] = src.host
        return self


FakeTensor.__module__ = "torch"   # how tiledsl tells torch tensors apart


def _compact(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class FakeContext:
    """What an autograd.Function's forward and backward use of their ctx."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


class FakeAutogradFunction:
    """torch.autograd.Function as far as EagerAttention needs it: `apply` runs forward with a fresh context
    and hangs (the Function, its context) on the first output, which StubDevice.backward runs."""

    @classmethod
    def apply(cls, *args):
        ctx = FakeContext()
        outputs = cls.forward(ctx, *args)
        (outputs[0] if isinstance(outputs, tuple) else outputs).grad_fn = (cls, ctx)
        return outputs


def fake_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")
    for name in ITEMSIZE:
        setattr(torch, name, FakeDtype(name))
    torch.Tensor = FakeTensor
    torch.device = FakeDevice
    torch.Size = tuple

    def empty(shape, dtype=None, device=None, pin_memory=False, **_):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = dtype or torch.float32
        host = None
        if pin_memory or dtype is torch.int32:   # host copies: pinned staging buffers, index tensors
            host = np.zeros(shape, np.int32 if dtype is torch.int32 else np.float32)
        return FakeTensor(shape, dtype, FakeDevice("cpu") if pin_memory else device, None, None, host)

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

    def full(shape, value, dtype=None, device=None):
        return FakeTensor(shape, dtype or torch.float32, device)

    def from_numpy(array):
        names = {np.dtype("int32"): "int32", np.dtype("float32"): "float32"}
        return FakeTensor(array.shape, getattr(torch, names[array.dtype]), FakeDevice("cpu"), host=array)

    def as_tensor(x, device=None):
        return x if isinstance(x, FakeTensor) else from_numpy(np.asarray(x, np.int32)).to(device)

    def pad(x, widths):   # torch.nn.functional.pad of the last axis: a new contiguous tensor
        before, after = widths
        return FakeTensor(x.shape[:-1] + (x.shape[-1] + before + after,), x.dtype, x.device)

    torch.empty = torch.zeros = empty
    torch.nn = types.SimpleNamespace(functional=types.SimpleNamespace(pad=pad))
    torch.full = full
    torch.from_numpy = from_numpy
    torch.as_tensor = as_tensor
    torch.is_grad_enabled = lambda: True
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False)
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: 0x5000 + index)
    generators = [FakeGenerator()]
    torch.cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: False, Event=Event,
                                       current_stream=lambda device=None: types.SimpleNamespace(cuda_stream=0x5000),
                                       default_generators=generators, current_device=lambda: 0)
    torch.manual_seed = lambda seed: [g.manual_seed(seed) for g in generators] and generators[0]

    class Op:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

        def register_fake(self, fn):
            return fn

        def register_autograd(self, *args, **kwargs):
            pass

    torch.library = types.SimpleNamespace(custom_op=lambda name, mutates_args=(): Op)
    torch.autograd = types.SimpleNamespace(Function=FakeAutogradFunction)
    torch.ops = types.SimpleNamespace()
    return torch


class StubDevice:
    """What a stubbed run saw: every launch (function name, grid, threads, smem, parameter values) and
    the calls to the entry points a warm call must not reach."""

    def __init__(self, torch, real_torch: bool = False):
        self.torch, self.real_torch = torch, real_torch
        self.launches: list = []
        self.functions: dict[int, str] = {}

    def tensor(self, shape, dtype="bfloat16", strides=None, host=None, requires_grad=False):
        if self.real_torch:   # a host tensor standing in for a device one (its data is never read)
            return self.torch.empty(shape, dtype=getattr(self.torch, dtype), requires_grad=requires_grad)
        return FakeTensor(shape, getattr(self.torch, dtype), FakeDevice("cuda", 0), strides, None,
                          host).requires_grad_(requires_grad)

    def index(self, values) -> FakeTensor:
        """An int32 device vector or matrix holding `values` (its host copy answers .cpu().numpy())."""
        array = np.asarray(values, dtype=np.int32)
        if self.real_torch:
            return self.torch.from_numpy(array)
        return FakeTensor(array.shape, self.torch.int32, FakeDevice("cuda", 0), None, None, array)

    def backward(self, output, grad):
        """The gradients of the inputs of the fake autograd.Function that made `output` (first output), given
        its gradient `grad` (the other outputs get none)."""
        function, ctx = output.grad_fn
        return function.backward(ctx, grad, None)

    def launch_kernel(self, handle, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launches.append((handle, (gx, gy, gz), bx, smem, params, stream))
        if len(self.launches) > 64:
            del self.launches[:32]

    def last(self, back: int = 1):
        """The `back`-th last launch as (function name, grid, threads, smem, stream, parameter values):
        its buffer read now, before a later call of the same signature rewrites it."""
        handle, grid, threads, smem, params, stream = self.launches[-back]
        name, count = self.functions[handle]
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = [ctypes.cast(pointers[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(count)]
        return name, grid, threads, smem, stream, values


class FakeFunction:
    def __init__(self, ptr, name):
        self.ptr, self.name, self.num_regs = ptr, name, 128


def _kernel_parameter_count(source: str, name: str) -> int:
    """The number of parameters of `name` in a generated source (the stub reads that many values)."""
    import re
    head = source[source.index(f"{name}("):]
    body = head[len(name) + 1:head.index(")")]
    return len([p for p in re.split(r",\s*(?![^<]*>)", body) if p.strip()])


def patch_everywhere(module, name: str, replacement, undo: list) -> None:
    """Set `module.name` and every tiledsl module's binding of the same object to `replacement`."""
    original = getattr(module, name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("tiledsl") and getattr(mod, name, None) is original:
            undo.append((mod, name, original))
            setattr(mod, name, replacement)


def _host_tensor_as_device_zero(original):
    """tensors._from_torch that reads a host torch tensor as if it lived on GPU 0 (real_torch mode)."""
    def from_torch(x, name, slot):
        if x.device.type != "cpu":
            return original(x, name, slot)
        dtype = original.__globals__["torch_dtypes"]().get(x.dtype)
        if dtype is None:
            raise original.__globals__["RuntimeInputError"](f"{name}: unsupported dtype {x.dtype}")
        return original.__globals__["TensorView"](name, x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype, 0,
                                                  x, slot)
    return from_torch


@contextlib.contextmanager
def stub_device(tmp: Path, counts: dict | None = None, real_torch: bool = False):
    """Install the fake torch and CuPy and the stubs (module docstring) until the block ends; `counts`
    (a dict) receives the number of calls of each guarded entry point. `real_torch`: keep the installed
    torch (its autograd engine is the one timed) and take its host tensors for device 0's."""
    import importlib
    import os

    import tiledsl  # noqa: F401
    from tiledsl import families  # noqa: F401  (every module the path uses, imported before patching)
    from tiledsl.codegen import render as render_module
    from tiledsl.dispatch import autograd, backward, kernels, tuned  # noqa: F401
    from tiledsl.device_limits import H200
    from tiledsl.frontend import parse as parse_module
    from tiledsl.runtime import compile as compile_module
    from tiledsl.runtime import device as device_module
    from tiledsl.runtime import launch, tensor_maps, tensors
    from tiledsl.schedule import graph as graph_module
    from tiledsl.serving import paged, prefill, varlen  # noqa: F401

    saved = {name: sys.modules.get(name) for name in ("torch", "cupy", "cupy.cuda", "cupy.cuda.driver")}
    if real_torch:
        import torch
        if autograd.OPS is None:
            importlib.reload(autograd)   # torch was imported after tiledsl: register the ops now
    else:
        torch = fake_torch()
    device = StubDevice(torch, real_torch)
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "stub"
    cuda = types.ModuleType("cupy.cuda")
    driver = types.ModuleType("cupy.cuda.driver")
    driver.launchKernel = device.launch_kernel
    cuda.driver = driver
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0, deviceSynchronize=lambda: None, getDeviceCount=lambda: 1)
    cuda.Device = lambda device_id=0: contextlib.nullcontext()
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
    cupy.cuda = cuda
    sys.modules.update({"torch": torch, "cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.driver": driver})
    autograd_state = dict(autograd.__dict__)
    if not real_torch:
        importlib.reload(autograd)   # its ops and EagerAttention over the fake torch
    old_cache = os.environ.get("TILEDSL_CACHE_DIR")
    os.environ["TILEDSL_CACHE_DIR"] = str(tmp)
    counts = {} if counts is None else counts
    undo: list = []
    handles = itertools.count(0x1000)
    sources: dict[str, str] = {}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)
        patch_everywhere(module, name, wrapper, undo)

    def cached_cubin(source, name, arch):
        counts["cached_cubin"] = counts.get("cached_cubin", 0) + 1
        path = tmp / "cubin" / f"{name}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stub")
        sources[str(path)] = source
        return path

    def load_functions(path, functions, device_id):
        loaded = {}
        source = sources.get(str(path), "")
        for name in functions:
            fn = FakeFunction(next(handles), name)
            device.functions[fn.ptr] = (name, _kernel_parameter_count(source, name) if source else 0)
            loaded[name] = fn
        return loaded

    def encode(t, box_rows, address=None, element="uint16"):
        counts["encode"] = counts.get("encode", 0) + 1
        return (t.pointer if address is None else address, box_rows, *t.shape, *t.strides) + (0,) * 6

    try:
        for module, name in ((parse_module, "parse_text"), (parse_module, "load_specs"), (parse_module, "parse_file"),
                             (graph_module, "build_graph"), (render_module, "render"),
                             (compile_module, "compile_cubin")):
            counted(module, name)
        patch_everywhere(compile_module, "cached_cubin", cached_cubin, undo)
        patch_everywhere(device_module, "load_functions", load_functions, undo)
        patch_everywhere(device_module, "device_arch", lambda: "sm_90a", undo)
        patch_everywhere(device_module, "device_limits", lambda device_id: H200, undo)
        patch_everywhere(device_module, "capturing", lambda x: False, undo)
        patch_everywhere(tensor_maps, "encode", encode, undo)
        if real_torch:
            patch_everywhere(tensors, "_from_torch", _host_tensor_as_device_zero(tensors._from_torch), undo)
            patch_everywhere(device_module, "stream_reader", lambda x: lambda: 0x5000, undo)
        undo.append((launch, "LAUNCH_BACKEND", launch.LAUNCH_BACKEND))
        launch.LAUNCH_BACKEND = "driver"
        tensors._torch_dtypes.clear()
        clear_caches()
        yield device
    finally:
        for module, name, original in reversed(undo):
            setattr(module, name, original)
        autograd.__dict__.clear()
        autograd.__dict__.update(autograd_state)
        clear_caches()
        tensors._torch_dtypes.clear()
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if old_cache is None:
            os.environ.pop("TILEDSL_CACHE_DIR", None)
        else:
            os.environ["TILEDSL_CACHE_DIR"] = old_cache


def clear_caches() -> None:
    """Forget every loaded kernel and prepared call (a stubbed run must not leave stub functions behind),
    the warm records' fingerprint (it holds the fake CuPy's version) and the fake device's answer that a
    GPU is usable (a later test asks the real machine)."""
    from tiledsl.dispatch import kernels, tuned
    from tiledsl.runtime import availability, launch, warm
    from tiledsl.serving import varlen
    availability._gpu_usable = False
    warm.fingerprint.cache_clear()
    kernels.LOADED.clear()
    tuned._resolved.clear()
    varlen._kernels.clear()
    launch.clear_prepared()
