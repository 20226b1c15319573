"""The backward's kv_lens bounded on the device, the CPU side (no GPU): every backward plan the bundled specs and
the dispatch build says it bounds kv_lens (its main kernel takes the error word: lower/plan.bounds_indices), every
kernel of the module that reads kv_lens checks it (the main kernel reports, the dQ writer stores NaN), and the
runtime passes the error word to the main kernel, kv_lens to the dQ writer, and checks kv_lens on the host only
when validate=True (otherwise only the O(1) look at the error word). The GPU side: test_gpu_backward_bounds.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tiledsl.codegen.render import render
from tiledsl.dispatch.backward import chosen_backward_spec
from tiledsl.errors import RuntimeInputError
from tiledsl.lower.backward import lower_backward
from tiledsl.lower.plan import INDEX_ERRORS, bounds_indices
from tiledsl.runtime import device_errors, index_checks
from tiledsl.runtime.backward import compile_backward
from tiledsl.runtime.kernel import Kernel
from tiledsl.runtime.launch import Arg, address_arg
from tiledsl.runtime.tensors import TensorView
from tiledsl.spec import DType, Mask

from .test_backward_kernel_cpu import BACKWARD_SPECS


def dispatch_specs():
    """(id, spec) of the backward modules attention_backward picks at d64 / d128 / d256: the default (the
    warp-specialized family), wgmma and mma.sync forced; causal or not, deterministic or not."""
    out = []
    for d in (64, 128, 256):
        for mask in (Mask.NONE, Mask.CAUSAL):
            for deterministic in (False, True):
                for mma in (None, "wgmma", "mma.sync"):
                    try:
                        spec = chosen_backward_spec("sm_90a", DType.BF16, d, mask, d, None, None, deterministic, mma)
                    except RuntimeInputError:   # wgmma refuses deterministic, and d256
                        continue
                    out.append((f"d{d}-{mask.value}-{'det' if deterministic else 'atomic'}-{mma or 'default'}", spec))
    return out


SPECS = [(s.name, s) for s in BACKWARD_SPECS] + dispatch_specs()
ERROR_WORD = address_arg(0x7000)   # the error word's stand-in (runtime/device_errors.py allocates the real one)


def signature(source: str, name: str) -> list[str]:
    """The parameter names of kernel `name` in `source`."""
    text = re.search(rf"{name}\((.*?)\) {{", source, re.DOTALL).group(1)
    return [p.split()[-1] for p in text.split(",")]


def body(source: str, name: str) -> str:
    """The text of kernel `name` in `source`, from its signature to the next kernel (or the end)."""
    start = source.index(f"{name}(")
    end = source.find('extern "C" __global__', start)
    return source[start:end if end > 0 else len(source)]


@pytest.mark.parametrize("spec", [s for _, s in SPECS], ids=[i for i, _ in SPECS])
def test_every_backward_plan_bounds_kv_lens_and_every_reader_checks_it(spec):
    plan = lower_backward(spec)
    assert bounds_indices(plan) and not index_checks.host_validation(None, bounds_indices(plan))
    names = [p.name for line in plan.parameters for p in line]
    assert names[names.index("kv_lens") + 1] == INDEX_ERRORS.name   # the error word right after kv_lens
    source = render(plan)
    main = plan.kernel_names["main"]
    assert signature(source, main) == names   # the signature is the plan's parameter list
    main_body = body(source, main)
    # bounded where kv_lens is read, reported once (thread 0 of one block), dK and dV stored NaN
    assert "contiguous_len_bad(kv_lens, batch, kv_len)" in main_body
    assert "const int seq_kv = bad_sequence ? 0 : kv_lens ? kv_lens[batch] : kv_len;" in main_body
    assert main_body.count("report_contiguous_len(") == 1 and "threadIdx.x == 0 && kv_block == 0" in main_body
    assert main_body.count("bad_sequence_scale(") == 2
    writer = plan.kernel_names.get("convert") or plan.kernel_names["dq"]   # whichever writes dQ
    writer_body = body(source, writer)
    assert "kv_lens" in signature(source, writer) and "contiguous_len_bad(" in writer_body
    assert "bad_sequence_scale(" in writer_body and "report_contiguous_len(" not in writer_body
    assert "kv_lens" not in body(source, plan.kernel_names["preprocess"])   # reads no kv_lens: nothing to bound


class Builder:
    """runtime/launch.CallBuilder's part that build_call uses: the call's tensors as views with made-up
    addresses, the launches and checks recorded."""

    def __init__(self, kernel, views):
        self.name, self.device_id, self.like, self.immediate = kernel.name, 0, None, False
        self.tensors, self.views, self.slots = views, views, len(views)
        self.launches, self.checks = [], []

    def view(self, index):
        return self.views[index]

    def require_aligned(self, *views):
        pass

    def allocate(self, name, shape, dtype):
        self.slots += 1
        return tensor_view(name, tuple(shape), dtype, self.slots - 1)
    new_output = workspace = allocate

    def launch(self, fn, grid, threads, smem, args, label):
        self.launches.append((fn, args))


def tensor_view(name, shape, dtype, slot):
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return TensorView(name, 0, shape, strides, dtype, 0, None, slot)


def build(spec, monkeypatch, validate, kv_lens=True, q_len=200, kv_len=333, heads=4, kv_heads=2):
    """(kernel, builder) of one call's build_call, with the GPU parts (maps, functions, the error word) stood in."""
    from tiledsl.runtime import backward_ws
    kernel = compile_backward(spec)
    p, batch = spec.problem, 3
    shapes = {"q": (batch, heads, q_len, p.head_dim_qk), "k": (batch, kv_heads, kv_len, p.head_dim_qk),
              "v": (batch, kv_heads, kv_len, p.head_dim_v), "o": (batch, heads, q_len, p.head_dim_v),
              "lse": (batch, heads, q_len), "do": (batch, heads, q_len, p.head_dim_v)}
    views = [tensor_view(n, s, DType.FP32 if n == "lse" else p.dtype, i) for i, (n, s) in enumerate(shapes.items())]
    views.append(tensor_view("kv_lens", (batch,), "int32", 6) if kv_lens else None)
    monkeypatch.setattr(kernel, "check", lambda b: (views, (batch, heads, kv_heads, q_len, kv_len)))
    monkeypatch.setattr(kernel, "functions", lambda device_id=None: {r: r for r in kernel.plan.kernel_names})
    monkeypatch.setattr(backward_ws, "map_arg", lambda t, rows, element="uint16": Arg("map", t.name))
    monkeypatch.setattr(Kernel, "error_word_arg", staticmethod(lambda device_id, like: ERROR_WORD))
    builder = Builder(kernel, views)
    kernel.build_call(builder, validate=validate)
    return kernel, builder


@pytest.mark.parametrize("spec", [s for _, s in SPECS], ids=[i for i, _ in SPECS])
def test_launches_pass_the_error_word_and_kv_lens_in_signature_order(spec, monkeypatch):
    kernel, b = build(spec, monkeypatch, validate=None)
    roles = {role: args for role, args in b.launches}
    assert set(roles) == {"preprocess", "main", "convert" if "convert" in kernel.plan.kernel_names else "dq"}
    for role, args in roles.items():
        names = signature(kernel.source, kernel.plan.kernel_names[role])
        assert len(args) == len(names), (role, names)
        at = dict(zip(names, args))
        if role != "preprocess":   # kv_lens (its call slot) reaches every kernel that reads it
            assert at["kv_lens"].slot == 6, role
        assert (at.get("index_errors") is ERROR_WORD) == (role == "main"), role


@pytest.mark.parametrize("spec", [s for _, s in SPECS[:3]] + [s for i, s in SPECS if i.startswith("d128")][:4])
def test_host_check_only_with_validate_true(spec, monkeypatch):
    """validate=None / False: no host check, only the look at the error word (no copy, no sync); True: the
    host check (its copy). Without kv_lens: neither."""
    seen = []
    monkeypatch.setattr(index_checks, "check_kv_lens", lambda lens, kv_len, name: seen.append(("host", kv_len)))
    monkeypatch.setattr(device_errors, "raise_pending", lambda device_id: seen.append(("report", device_id)))
    monkeypatch.setattr(index_checks, "capturing", lambda like: False)
    for validate, kv_lens, expected in ((None, True, [("report", 0)]), (False, True, [("report", 0)]),
                                        (True, True, [("host", 333)]), (None, False, []), (True, False, [])):
        seen.clear()
        _, b = build(spec, monkeypatch, validate, kv_lens)
        for check in b.checks:
            check(b.tensors)
        assert seen == expected, (validate, kv_lens)


@pytest.mark.parametrize("spec", [s for _, s in SPECS[:2]], ids=[i for i, _ in SPECS[:2]])
def test_k_without_keys_checks_kv_lens_on_the_host(spec, monkeypatch):
    """k of 0 keys launches no main kernel, which is what reports a bad entry: the call checks on the host."""
    seen = []
    monkeypatch.setattr(index_checks, "check_kv_lens", lambda lens, kv_len, name: seen.append(("host", kv_len)))
    monkeypatch.setattr(device_errors, "raise_pending", lambda device_id: seen.append(("report", device_id)))
    monkeypatch.setattr(index_checks, "capturing", lambda like: False)
    _, b = build(spec, monkeypatch, None, True, kv_len=0)
    for check in b.checks:
        check(b.tensors)
    assert seen == [("host", 0)]
