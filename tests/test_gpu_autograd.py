"""Training through `tiledsl.attention` on a real GPU (pytest -m gpu; skipped without one or without
torch): gradients of Q, K, V against float64 torch autograd of standard attention
(tests/attention_reference.py: bottom-right masks, GQA by repeat_interleave, kv_lens by hiding keys,
fully masked rows give zero output and zero gradients) for masks none / causal / window, seqlens
1, 17, 1000, 4097, q_len != kv_len both ways, GQA, kv_lens including 0, bf16 and fp16, head dims
64 and 128; torch.compile(fullgraph=True) of modules calling it, forward and backward, against
eager; deterministic=True twice gives identical bits; torch.library.opcheck of both ops; and a
CUDA-graph capture of forward + backward.

Errors are relative to the max norm, bounded by attention_reference.GRAD_TOLERANCE (8 unit
roundoffs of the dtype; the reason, and the check that typical kernel bugs exceed it, are there
and in tests/test_autograd_cpu.py). Everything the ops allocate through torch.empty /
torch.empty_like / new_empty (outputs, gradients, workspaces) starts as NaN in the numeric tests,
so an element a kernel fails to write fails them."""
from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import tiledsl  # noqa: E402
from .gpu_support import poison_outputs  # noqa: E402
from tests import attention_reference as ref  # noqa: E402

WINDOW = (100, 20)
MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": WINDOW}}
DTYPES = (torch.bfloat16, torch.float16)


def _case(q_len, kv_len, mask, dtype, d, batch=2, heads=4, kv_heads=4, kv_lens=None):
    return dict(q_len=q_len, kv_len=kv_len, mask=mask, dtype=dtype, d=d, batch=batch, heads=heads,
                kv_heads=kv_heads, kv_lens=kv_lens)


def _sweep() -> list[dict]:
    """Seqlens x masks, with dtype, head dim and GQA rotating so each dtype meets each mask and
    both head dims; 4097 keeps batch and heads small (the float64 reference holds S)."""
    cases = []
    for i, (n, mask) in enumerate(itertools.product((1, 17, 1000, 4097), MASKS)):
        small = n > 2000
        cases.append(_case(n, n, mask, DTYPES[i % 2], (64, 128)[(i // 2) % 2], batch=1 if small else 2,
                           heads=2 if small else 4, kv_heads=(1 if small else 2) if i % 3 == 2 else (2 if small else 4)))
    return cases


CROSS = [  # q_len != kv_len both ways (causal and window rows that see nothing when q_len > kv_len), GQA
    _case(300, 517, "causal", torch.bfloat16, 128, kv_heads=2), _case(517, 300, "causal", torch.float16, 64),
    _case(300, 517, "window", torch.float16, 128), _case(517, 300, "window", torch.bfloat16, 64, kv_heads=1),
    _case(1, 1000, "causal", torch.bfloat16, 128, kv_heads=2), _case(1000, 17, "none", torch.float16, 64),
    # head dims the backward's kernels take zero-padded to 16 (dispatch/backward.PaddedBackward)
    _case(300, 517, "causal", torch.bfloat16, 40, kv_heads=2), _case(200, 200, "window", torch.float16, 72),
]
KV_LENS = [  # a sequence with no keys, one with all, one with 37 (its causal rows mostly blind)
    _case(200, 300, "causal", torch.bfloat16, 128, batch=3, kv_heads=2, kv_lens=(0, 300, 37)),
    _case(200, 300, "none", torch.float16, 64, batch=3, kv_lens=(0, 300, 37)),
    _case(5, 300, "window", torch.bfloat16, 64, batch=3, kv_lens=(0, 300, 37)),
]
CASES = _sweep() + CROSS + KV_LENS


def _id(c: dict) -> str:
    dtype = "bf16" if c["dtype"] is torch.bfloat16 else "fp16"
    gqa = f"-gqa{c['heads']}:{c['kv_heads']}" if c["heads"] != c["kv_heads"] else ""
    lens = "-kvlens" if c["kv_lens"] else ""
    return f"{c['mask']}-q{c['q_len']}kv{c['kv_len']}-d{c['d']}-{dtype}{gqa}{lens}"


def _inputs(c: dict, seed: int = 0, requires_grad: bool = True):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads, n):
        x = torch.randn(c["batch"], heads, n, c["d"], device="cuda", dtype=c["dtype"], generator=gen)
        return x.requires_grad_(requires_grad)
    q, k, v = make(c["heads"], c["q_len"]), make(c["kv_heads"], c["kv_len"]), make(c["kv_heads"], c["kv_len"])
    do = torch.randn(c["batch"], c["heads"], c["q_len"], c["d"], device="cuda", dtype=c["dtype"], generator=gen)
    lens = torch.tensor(c["kv_lens"], device="cuda", dtype=torch.int32) if c["kv_lens"] else None
    return q, k, v, do, lens


@pytest.fixture
def poisoned(monkeypatch):
    """Floating tensors from torch.empty / empty_like / new_empty and attention's own outputs start
    as NaN (filled on the current stream, so before any kernel that should overwrite them)."""
    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(new_empty(self, *a, **kw)))
    poison_outputs(monkeypatch)
    yield
    from tiledsl.runtime.launch import clear_prepared
    clear_prepared()


def _check_gradients(c: dict, q, k, v, do, lens, o, grads):
    mask = MASKS[c["mask"]]
    ref_o, _, *ref_grads = ref.gradients(q, k, v, do, kv_lens=lens, **mask)
    errors = {"o": ref.max_relative_error(o, ref_o)}
    errors.update({name: ref.max_relative_error(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    tolerance = ref.grad_tolerance(c["dtype"])
    assert max(errors.values()) < tolerance, (errors, tolerance)
    seen = ref.visible_keys(c["q_len"], c["kv_len"], c["batch"], kv_lens=lens, device="cuda", **mask)
    blind = ~seen.any(-1).expand(-1, c["heads"], c["q_len"])   # rows that see no key: O and dQ exactly 0
    assert bool((o[blind] == 0).all()) and bool((grads[0][blind] == 0).all())
    return errors


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gradients_match_float64_autograd(case, poisoned):
    q, k, v, do, lens = _inputs(case)
    o = tiledsl.attention(q, k, v, kv_lens=lens, **MASKS[case["mask"]])
    assert o.requires_grad and o.shape == (case["batch"], case["heads"], case["q_len"], case["d"])
    o.backward(do)
    grads = (q.grad, k.grad, v.grad)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    _check_gradients(case, q, k, v, do, lens, o.detach(), grads)


def test_forward_with_and_without_grad_is_the_same_kernel():
    case = CASES[7]
    q, k, v, _, _ = _inputs(case)
    with torch.no_grad():
        plain = tiledsl.attention(q, k, v, **MASKS[case["mask"]])
    o, lse = tiledsl.attention(q, k, v, return_lse=True, **MASKS[case["mask"]])
    assert torch.equal(o.detach(), plain) and not lse.requires_grad


def test_deterministic_gives_identical_bits():
    case = _case(1000, 1000, "causal", torch.bfloat16, 128, heads=8, kv_heads=2)   # GQA: dK, dV summed over 4 heads
    q, k, v, do, _ = _inputs(case)
    runs = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        tiledsl.attention(q, k, v, causal=True, deterministic=True).backward(do)
        runs.append([x.grad.clone() for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    _check_gradients(case, q, k, v, do, None, tiledsl.attention(q, k, v, causal=True).detach(), runs[0])


# ---- torch.compile -----------------------------------------------------------------------------------------

class Attention(torch.nn.Module):
    """Only attention (and layout ops): compiled and eager run the same kernels on the same bits."""
    def forward(self, q, k, v):
        return tiledsl.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                 deterministic=True).transpose(1, 2)


class Block(torch.nn.Module):
    """A pre-norm attention block: projections and a norm around tiledsl.attention."""
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        o = tiledsl.attention(q, k, v, causal=True, deterministic=True)
        return x + self.out(o.transpose(1, 2).reshape(b, n, dim))


def test_compile_fullgraph_attention_matches_eager_bit_for_bit():
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    module = Attention()
    results = []
    for run in (module, torch.compile(module, fullgraph=True)):
        for x in (q, k, v):
            x.grad = None
        out = run(q, k, v)
        out.backward(do)
        results.append([out.detach()] + [x.grad.clone() for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_compile_fullgraph_block_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(4)
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 257, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for run in (block, torch.compile(block, fullgraph=True)):
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = run(x)
        y.float().square().mean().backward()
        results.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in block.parameters()])
    tolerance = ref.grad_tolerance(torch.bfloat16)   # inductor fuses the norm and bias ops its own way
    for eager, compiled in zip(*results):
        assert ref.max_relative_error(compiled, eager.double()) < tolerance


# ---- the ops themselves --------------------------------------------------------------------------------------

def test_opcheck_both_ops():
    from torch.library import opcheck
    gen = torch.Generator(device="cuda").manual_seed(5)
    make = lambda h, n: torch.randn(1, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v = make(2, 33).requires_grad_(), make(1, 40).requires_grad_(), make(1, 40).requires_grad_()
    scalars = (True, False, 0, 0, None, True, None)   # causal, no window, default scale, deterministic, validate
    import tiledsl.dispatch.autograd
    fwd, bwd = torch.ops.tiledsl.attention_forward.default, torch.ops.tiledsl.attention_backward.default
    opcheck(fwd, (q, k, v, None) + scalars)
    opcheck(fwd, (q, k, v, torch.tensor([40], device="cuda", dtype=torch.int32), False, True, 8, 2, 0.2, True, True))
    o, lse = fwd(q.detach(), k.detach(), v.detach(), None, *scalars)
    opcheck(bwd, (q.detach(), k.detach(), v.detach(), o, lse, torch.randn_like(o), None) + scalars)


def test_cuda_graph_capture_of_forward_and_backward():
    case = _case(1000, 1000, "causal", torch.bfloat16, 128, kv_heads=2)
    q, k, v, do, _ = _inputs(case, seed=6)

    def step():
        for x in (q, k, v):
            x.grad = None
        tiledsl.attention(q, k, v, causal=True, deterministic=True).backward(do)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # the eager warm-up torch asks for before capturing a backward
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for x in (q, k, v):
        x.grad = None
    with torch.cuda.graph(graph):
        tiledsl.attention(q, k, v, causal=True, deterministic=True).backward(do)
    captured = (q.grad, k.grad, v.grad)
    for seed in (7, 8):   # new inputs in the same memory, then replay
        nq, nk, nv, ndo, _ = _inputs(case, seed=seed, requires_grad=False)
        with torch.no_grad():
            q.copy_(nq), k.copy_(nk), v.copy_(nv), do.copy_(ndo)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [g.clone() for g in captured]
        step()
        assert all(torch.equal(a, x.grad) for a, x in zip(replayed, (q, k, v)))


# ---- training -------------------------------------------------------------------------------------------------

def test_short_training_run_matches_sdpa():
    """bench/train_check.py shortened to 10 steps: the tiledsl loss curve within the bound of SDPA's."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / "train_check.py"
    spec = importlib.util.spec_from_file_location("train_check", path)
    train_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_check)
    result = train_check.run(10)
    assert result["passed"], {k: result[k] for k in ("max_abs_difference", "floor_sdpa_vs_math", "bound", "curves")}
