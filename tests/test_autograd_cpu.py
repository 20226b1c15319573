"""tiledsl/dispatch/autograd.py without a GPU: it imports without torch and `import tiledsl` pulls no torch;
the scalar encoding of window and scale; and, where torch is installed, the custom ops' plumbing
with the GPU kernels replaced by a float64 CPU stand-in (tests/attention_reference.py): the
gradients through `tiledsl.attention` land on the right inputs, eager calls import no dynamo, the fakes match the real ops
(torch.library.opcheck), torch.compile(fullgraph=True) traces a module with no graph break, and
the gradient error bound of the GPU tests fails for typical kernel bugs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import attention_reference as ref
from tiledsl.dispatch import autograd

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


# ---- no torch ------------------------------------------------------------------------------------------------

def test_import_tiledsl_and_calling_into_it_with_cupy_pull_no_torch():
    done = _python("import sys, tiledsl, tiledsl.dispatch.tuned; tiledsl.attention; print('torch' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr


def test_autograd_module_imports_without_torch():
    # sys.modules["torch"] = None makes `import torch` raise ImportError, as on a machine without it.
    done = _python("import sys; sys.modules['torch'] = None; import tiledsl.dispatch.autograd as a; "
                   "print(a.OPS, a.encode_window((3, 0)))")
    assert done.returncode == 0 and done.stdout.strip() == "None (True, 3, 0)", done.stderr


# ---- scalar encoding ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, (0, 0), (128, 0), (100, 20), [7, 9]])
def test_window_round_trips_through_the_ops_scalars(window):
    encoded = autograd.encode_window(window)
    assert all(type(x) in (bool, int) for x in encoded)
    assert autograd.decode_window(*encoded) == (None if window is None else tuple(window))
    assert encoded == autograd.WINDOW_NONE if window is None else encoded[0]


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (-1, 0), (0, -5), "ab", 5])
def test_bad_window_is_refused_by_name(window):
    with pytest.raises(ValueError, match=r"window must be \(left, right\), two ints >= 0"):
        autograd.encode_window(window)


def test_scale_encoding():
    assert autograd.encode_scale(None) is None
    assert autograd.encode_scale(1) == 1.0 and type(autograd.encode_scale(1)) is float


# ---- the ops, with a CPU stand-in for the kernels (torch needed) ---------------------------------------------

@pytest.fixture
def torch_stubbed(monkeypatch):
    """torch, with tuned.forward and tiledsl.dispatch.backward.attention_backward (what the ops call) and
    tuned.forward_call and backward.backward_after_forward (what EagerAttention calls) computing in float64 on
    the CPU, so everything between attention() and the kernels is the real code. Calls are recorded to check
    the arguments that arrive."""
    torch = pytest.importorskip("torch")
    from tiledsl.dispatch import tuned
    calls = []

    def forward(q, k, v, causal=False, window=None, scale=None, kv_lens=None, validate=None):
        calls.append(("forward", causal, window, scale, kv_lens, torch.is_grad_enabled()))
        o, lse = ref.attention(q.double(), k.double(), v.double(), causal=causal, window=window, scale=scale,
                               kv_lens=kv_lens)
        return o.to(q.dtype), lse.float()

    def attention_backward(q, k, v, o, lse, do, *, causal=False, window=None, scale=None, kv_lens=None,
                           deterministic=False, validate=None):
        calls.append(("backward", causal, window, scale, kv_lens, deterministic))
        assert lse.dtype == torch.float32 and o.shape == do.shape
        dq, dk, dv = _analytic_gradients(q, k, v, do, causal=causal, window=window, scale=scale, kv_lens=kv_lens)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def forward_call(q, k, v, causal=False, window=None, scale=None, kv_lens=None, validate=None):
        def call(q, k, v, kv_lens, out, lse):   # the PreparedCall's arguments
            assert out is None and lse is None
            return forward(q, k, v, causal, window, scale, kv_lens, validate)
        return call

    def backward_after_forward(forward_call, scalars, q, k, v, o, lse, do, kv_lens):
        causal, window, scale, deterministic, validate = scalars
        assert callable(forward_call)
        return attention_backward(q, k, v, o, lse, do, causal=causal, window=window, scale=scale, kv_lens=kv_lens,
                                  deterministic=deterministic, validate=validate)

    monkeypatch.setattr(tuned, "forward", forward)
    monkeypatch.setattr(tuned, "forward_call", forward_call)
    monkeypatch.setattr(autograd.backward, "attention_backward", attention_backward)
    monkeypatch.setattr(autograd.backward, "backward_after_forward", backward_after_forward)
    torch.manual_seed(0)
    return torch, calls


def _analytic_gradients(q, k, v, do, causal=False, window=None, scale=None, kv_lens=None):
    """FlashAttention's backward by recomputation, in float64 (the op runs below autograd, so the
    stand-in cannot call torch.autograd): D = rowsum(dO o O), dS = P o (dP - D), dP = dO V^T."""
    import torch
    q, k, v, do = (x.double() for x in (q, k, v, do))
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, lse = ref.attention(q, k, v, causal=causal, window=window, scale=scale, kv_lens=kv_lens)
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seen = ref.visible_keys(q.shape[2], k.shape[2], q.shape[0], causal, window, kv_lens)
    p = torch.exp((q @ kr.transpose(-1, -2)) * scale - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0)) * seen
    ds = p * (do @ vr.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    fold = lambda x: x.unflatten(1, (k.shape[1], group)).sum(2)   # noqa: E731  (GQA: sum a group's heads)
    return scale * ds @ kr, fold(scale * ds.transpose(-1, -2) @ q), fold(p.transpose(-1, -2) @ do)


def _inputs(torch, batch=2, heads=4, kv_heads=2, q_len=9, kv_len=13, d=16, dv=8, dtype=None):
    dtype = dtype or torch.bfloat16
    make = lambda h, n, e: torch.randn(batch, h, n, e, dtype=dtype).requires_grad_()   # noqa: E731
    return make(heads, q_len, d), make(kv_heads, kv_len, d), make(kv_heads, kv_len, dv)


MASKS = [dict(), dict(causal=True), dict(window=(3, 1)), dict(causal=True, scale=0.3)]


@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "window", "causal-scale"])
def test_gradients_reach_q_k_v_with_the_right_arguments(torch_stubbed, mask):
    torch, calls = torch_stubbed
    import tiledsl
    q, k, v = _inputs(torch, dtype=torch.float64)   # float64 end to end: the stand-in vs autograd to 1e-12
    lens = torch.tensor([13, 4], dtype=torch.int32)   # 4 keys, 9 queries: causal rows 0..4 see none
    o, lse = tiledsl.attention(q, k, v, kv_lens=lens, return_lse=True, deterministic=True, **mask)
    assert o.shape == (2, 4, 9, 8) and o.dtype == q.dtype and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert o.requires_grad and not lse.requires_grad   # the LSE is a constant
    do = torch.randn_like(o)
    o.backward(do)
    _, _, dq, dk, dv = ref.gradients(q, k, v, do, kv_lens=lens, **mask)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        assert got.shape == want.shape and got.dtype == q.dtype
        assert ref.max_relative_error(got, want) < 1e-12
    window = mask.get("window")
    assert [c[:4] for c in calls] == [("forward", mask.get("causal", False), window, mask.get("scale")),
                                      ("backward", mask.get("causal", False), window, mask.get("scale"))]
    assert calls[0][5] is False and calls[1][5] is True   # the forward runs without grad mode; deterministic passes
    assert torch.equal(calls[0][4], lens) and torch.equal(calls[1][4], lens)


def test_no_grad_inputs_run_the_forward_alone(torch_stubbed):
    torch, calls = torch_stubbed
    import tiledsl
    q, k, v = (x.detach() for x in _inputs(torch))
    o = tiledsl.attention(q, k, v, causal=True)
    assert not o.requires_grad and [c[0] for c in calls] == ["forward"]


def test_only_some_inputs_need_grad(torch_stubbed):
    torch, _ = torch_stubbed
    import tiledsl
    q, k, v = _inputs(torch)
    k, v = k.detach(), v.detach()
    tiledsl.attention(q, k, v).sum().backward()   # do is an expanded scalar: made contiguous for the kernel
    assert q.grad is not None and k.grad is None and v.grad is None


def test_eager_training_step_does_not_import_dynamo():
    """Eager calls take EagerAttention, not the custom op, whose first call imports torch._dynamo
    (3.5 s of a first call on the H200 machine); the kernels are CPU stand-ins here."""
    pytest.importorskip("torch")
    done = _python("""
import sys, types, torch, tiledsl
from tiledsl.dispatch import tuned
tuned.forward_call = lambda *a, **kw: lambda q, k, v, *rest: (torch.zeros_like(q), torch.zeros(q.shape[:3]))
sys.modules["tiledsl.dispatch.backward"] = types.SimpleNamespace(
    backward_after_forward=lambda call, scalars, q, k, v, *a: (q, k, v))
q = torch.randn(1, 2, 4, 8, requires_grad=True)
tiledsl.attention(q, q, q, causal=True).sum().backward()
print(q.grad is not None, "torch._dynamo" in sys.modules)
""")
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_fake_refuses_like_the_eager_path(torch_stubbed):
    torch, _ = torch_stubbed
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(2, 3, 4, 8)
    op = torch.ops.tiledsl.attention_forward.default
    with torch._subclasses.FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        with pytest.raises(RuntimeInputError, match="q must be fp16 or bf16, got fp32"):
            op(fq, fq, fq, None, False, False, 0, 0, None, False, None)
        f3 = mode.from_tensor(torch.randn(2, 3, 8, dtype=torch.bfloat16))
        with pytest.raises(RuntimeInputError, match="must be 4-d"):
            op(f3, f3, f3, None, False, False, 0, 0, None, False, None)


def test_opcheck_forward_and_backward(torch_stubbed):
    torch, _ = torch_stubbed
    q, k, v = _inputs(torch, q_len=5, kv_len=7)
    fwd, bwd = torch.ops.tiledsl.attention_forward.default, torch.ops.tiledsl.attention_backward.default
    scalars = (True, False, 0, 0, None, False, None)
    torch.library.opcheck(fwd, (q, k, v, None) + scalars)
    torch.library.opcheck(fwd, (q, k, v, torch.tensor([7, 2], dtype=torch.int32), False, True, 2, 1, 0.25, True,
                                True))
    o, lse = fwd(q.detach(), k.detach(), v.detach(), None, *scalars)
    torch.library.opcheck(bwd, (q.detach(), k.detach(), v.detach(), o, lse, torch.randn_like(o), None) + scalars)


def test_torch_compile_fullgraph_matches_eager(torch_stubbed):
    torch, calls = torch_stubbed
    import tiledsl

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 16, dtype=torch.bfloat16)

        def forward(self, q, k, v):
            return self.proj(tiledsl.attention(q, k, v, causal=True, window=None, scale=0.5)).float().square().mean()

    block = Block()
    q, k, v = _inputs(torch)
    eager = block(q, k, v)
    eager.backward()
    eager_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    assert torch.equal(loss, eager)
    for got, want in zip((q.grad, k.grad, v.grad), eager_grads):
        assert torch.equal(got, want)
    assert {c[0] for c in calls} == {"forward", "backward"}


def test_eager_errors_come_from_inside_the_op_unchanged(torch_stubbed, monkeypatch):
    torch, _ = torch_stubbed
    import tiledsl
    from tiledsl.dispatch import tuned
    from tiledsl.errors import RuntimeInputError

    def refuse(*args, **kwargs):
        raise RuntimeInputError("q: is on the host (DLPack device type 1); move it to the GPU")
    monkeypatch.setattr(tuned, "forward", refuse)
    monkeypatch.setattr(tuned, "forward_call", refuse)
    q, k, v = _inputs(torch)
    with pytest.raises(RuntimeInputError, match="q: is on the host"):
        tiledsl.attention(q, k, v)
    with pytest.raises(ValueError, match="not both"):
        tiledsl.attention(q, k, v, causal=True, window=(1, 0))


# ---- the GPU tests' error bound fails for wrong gradients --------------------------------------------------

@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_gradient_bound_passes_rounding_and_fails_typical_bugs(dtype_name):
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    dtype = getattr(torch, dtype_name)
    tolerance = ref.grad_tolerance(dtype)
    q, k, v = _inputs(torch, batch=1, heads=4, kv_heads=2, q_len=200, kv_len=256, d=64, dv=64, dtype=dtype)
    do = torch.randn(1, 4, 200, 64, dtype=dtype)
    _, _, dq, dk, dv = ref.gradients(q, k, v, do, causal=True)
    for g in (dq, dk, dv):   # the exact gradient, rounded once to the dtype: well inside
        assert ref.max_relative_error(g.to(dtype), g) < tolerance / 4
    # A kernel that skips kv tile [64, 128): dQ misses its keys, dK and dV of those keys are 0.
    seen = ref.visible_keys(200, 256, 1, causal=True)
    seen[..., 64:128] = False
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    k_rep, v_rep = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    s = (q64 @ k_rep.transpose(-1, -2) / 8).masked_fill(~seen, float("-inf"))
    o_bug = torch.softmax(s, -1) @ v_rep
    bug = torch.autograd.grad(o_bug, (q64, k64, v64), do.double())
    assert all(ref.max_relative_error(b, g) > tolerance for b, g in zip(bug, (dq, dk, dv)))
    _, _, dq_noscale, dk_noscale, _ = ref.gradients(q, k, v, do, causal=True, scale=1 / 8 * 1.1)   # softmax scale 10% off
    assert ref.max_relative_error(dq_noscale, dq) > tolerance and ref.max_relative_error(dk_noscale, dk) > tolerance
    swapped = dk.clone()   # GQA: two kv heads' gradients swapped
    swapped[:, [0, 1]] = dk[:, [1, 0]]
    assert ref.max_relative_error(swapped, dk) > tolerance
    dv_one_row = dv.clone()   # one key's dV 5% off: the max norm sees a single row (the one with the max)
    dv_one_row[0, 0, int(dv[0, 0].abs().amax(-1).argmax())] *= 1.05
    assert ref.max_relative_error(dv_one_row, dv) > tolerance
