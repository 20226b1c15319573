"""FP8 attention (float8_e4m3fn q, k, v; the hopper family's e4m3 kernels) on the GPU, through tiledsl.attention
and tiledsl.quantize_fp8:

* against the kernel's arithmetic in float64 (reference/fp8.fp8_kernel_attention: the bytes the kernel reads
  times their descales, an online softmax over the kernel's kv tiles with P rounded to e4m3 (x 256) before P V,
  l the unrounded sum): O within TOL_O normwise, LSE within TOL_LSE. What remains is the GPU's own: O rounded to
  bf16 (~1.7e-3 normwise), fp32 accumulation and ex2.approx (~1e-7 on a weight), and the FP8 tensor cores'
  accumulators, which keep fewer than fp32's mantissa bits (modelled as e8m13, truncated after each k32 wgmma,
  they add 4e-3 - 5.5e-3 at these shapes, mostly where a score moves a weight across an e4m3 rounding boundary).
  TOL_O = 8e-3 holds all of that with ~1.4x to spare and sits 2.5x below what leaving P's rounding out costs
  (1.8e-2 - 2.7e-2);
* against float64 attention of the original bf16 inputs (the user's error, loose: Q, K and V each rounded to
  3 mantissa bits): TOL_USER normwise for N(0, 1) inputs;
* masks none / causal / window, seqlens 1, 17, 1000, 4097, GQA, kv_lens with 0, per tensor / head / block
  descales, Hadamard rotation, NaN-poisoned outputs (torch.full NaN out=) ;
* quantize_fp8 against its NumPy model (reference/fp8.quantize_model, rotate_rows): bytes and descales equal;
* every schedule of FP8_VARIANTS (what the bench's --variants times) against the same reference, none and causal,
  per head and per block descales, GQA, a ragged kv_lens;
* one compute-sanitizer memcheck of a small case.

    python -m pytest -m gpu tests/test_gpu_fp8_forward.py
"""
from __future__ import annotations

import dataclasses
import textwrap

import numpy as np
import pytest

import tiledsl
from tiledsl.dispatch.kernels import kernel_for
from tiledsl.dispatch.tuned import FP8_VARIANTS, fp8_descale_kind, fp8_spec
from tiledsl.runtime.device import device_arch
from tiledsl.spec import Descale, DType, Mask
from tiledsl.errors import RuntimeInputError
from tiledsl.reference.forward import naive_attention
from tiledsl.reference.fp8 import fp8_kernel_attention, hadamard_signs, quantize_model, rotate_rows

from .gpu_support import memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

TOL_O, TOL_LSE, TOL_USER = 8e-3, 1e-3, 1e-1


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _inputs(torch, batch, heads, kv_heads, q_len, kv_len, d, outliers=False):
    g = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))

    def make(h, n):
        x = torch.randn(batch, h, n, d, device="cuda", generator=g)
        if outliers:
            x += 10 * torch.randn(batch, h, n, d, device="cuda", generator=g) * (
                torch.rand(batch, h, n, d, device="cuda", generator=g) < 1e-3)
        return x.to(torch.bfloat16)
    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def _bytes(t):
    return t.view(__import__("torch").uint8).cpu().numpy()


def _relative(out, ref):
    out = np.asarray(out, dtype=np.float64)
    if not np.isfinite(out).all():
        return np.inf
    return np.linalg.norm(out - ref) / (np.linalg.norm(ref) or 1.0)


CASES = [  # (d, mask, q_len, kv_len, heads, kv_heads, block)
    (128, "none", 1000, 1000, 2, 2, None), (128, "causal", 1000, 1000, 4, 1, None),
    (64, "none", 17, 4097, 2, 1, None), (64, "causal", 4097, 4097, 2, 2, 128),
    (256, "none", 1, 17, 2, 2, None), (256, "causal", 1000, 1000, 2, 1, "block"),
    (128, "window", 1000, 1000, 2, 2, "tensor"), (128, "none", 17, 1, 2, 2, "block"),
]


@pytest.mark.parametrize("d, mask, q_len, kv_len, heads, kv_heads, block", CASES)
@pytest.mark.parametrize("rotate", [None, "hadamard"])
def test_fp8_attention_against_dequantized_reference(torch, d, mask, q_len, kv_len, heads, kv_heads, block, rotate):
    q, k, v = _inputs(torch, 2, heads, kv_heads, q_len, kv_len, d)
    window = (100, 0) if mask == "window" else None
    per_block_spec = fp8_spec(device_arch(), d, Mask(mask), window, None, Descale.PER_BLOCK, DType.BF16)
    tiles = (per_block_spec.schedule.tile_q, per_block_spec.schedule.tile_kv)   # per-block descales: one per tile
    blocks = tiles if block in ("block", 128) else block
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v, block=blocks, rotate=rotate, seed=5)
    kv_lens = torch.tensor([0, kv_len], dtype=torch.int32, device="cuda") if q_len > 1 else None
    out = torch.full((2, heads, q_len, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, heads, q_len), float("nan"), dtype=torch.float32, device="cuda")
    spec = fp8_spec(device_arch(), d, Mask(mask), window, None, fp8_descale_kind(qs, ks, vs), DType.BF16)
    kernel_for(spec)(q8, k8, v8, kv_lens=kv_lens, out=out, lse=lse, q_descale=qs, k_descale=ks, v_descale=vs)
    torch.cuda.synchronize()
    mask_kw = {"mask": "window", "window_left": 100} if window else {"mask": mask}
    lens = None if kv_lens is None else kv_lens.cpu().numpy()
    ref_o, ref_lse = fp8_kernel_attention(spec, _bytes(q8), _bytes(k8), _bytes(v8), qs.cpu().numpy(),
                                          ks.cpu().numpy(), vs.cpu().numpy(), kv_lens=lens)
    got = out.float().cpu().numpy()
    error = _relative(got, ref_o)
    assert error <= TOL_O, f"O is {error:.3e} normwise from the kernel's arithmetic (bound {TOL_O})"
    got_lse, finite = lse.cpu().numpy(), np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == finite).all()
    assert np.abs(got_lse[finite] - ref_lse[finite]).max(initial=0) <= TOL_LSE
    # the user's error: the original bf16 inputs (rotation cancels in Q K^T)
    user_o, _ = naive_attention(q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy(),
                                kv_lens=lens, **mask_kw)
    assert _relative(got, user_o) <= TOL_USER


@pytest.mark.parametrize("d, variant", [(d, name) for d, names in FP8_VARIANTS.items() for name in names])
@pytest.mark.parametrize("mask, block", [("none", None), ("causal", "block")])
def test_fp8_variant_against_dequantized_reference(torch, d, variant, mask, block):
    """Each variant's kernel (intra overlap, ping-pong: their peeled first and last tiles, the V descale carried
    across tiles by the rescale of the tile before) on several kv tiles with a ragged last one and kv_lens."""
    schedule = FP8_VARIANTS[d][variant]
    q, k, v = _inputs(torch, 2, 4, 2, 300, 1000, d)
    blocks = (schedule.tile_q, schedule.tile_kv) if block else None
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v, block=blocks)
    spec = fp8_spec(device_arch(), d, Mask(mask), None, None, fp8_descale_kind(qs, ks, vs), DType.BF16)
    spec = dataclasses.replace(spec, name=f"{spec.name}_{variant}", schedule=schedule)
    kv_lens = torch.tensor([1000, 517], dtype=torch.int32, device="cuda")
    out = torch.full((2, 4, 300, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, 4, 300), float("nan"), dtype=torch.float32, device="cuda")
    kernel_for(spec)(q8, k8, v8, kv_lens=kv_lens, out=out, lse=lse, q_descale=qs, k_descale=ks, v_descale=vs)
    torch.cuda.synchronize()
    ref_o, ref_lse = fp8_kernel_attention(spec, _bytes(q8), _bytes(k8), _bytes(v8), qs.cpu().numpy(),
                                          ks.cpu().numpy(), vs.cpu().numpy(), kv_lens=kv_lens.cpu().numpy())
    error = _relative(out.float().cpu().numpy(), ref_o)
    assert error <= TOL_O, f"{variant}: O is {error:.3e} normwise from the kernel's arithmetic (bound {TOL_O})"
    got_lse, finite = lse.cpu().numpy(), np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == finite).all()
    assert np.abs(got_lse[finite] - ref_lse[finite]).max(initial=0) <= TOL_LSE


def test_fp16_output_and_refusals(torch):
    q, k, v = _inputs(torch, 1, 2, 2, 130, 130, 128)
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
    o = tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=torch.float16)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    o16 = tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)   # the API: bf16, same kernel math
    assert o16.dtype == torch.bfloat16 and (o16.float() - o.float()).abs().max() < 1e-2
    with pytest.raises(RuntimeInputError, match="k_descale must have shape"):
        tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks[:, :1], v_descale=vs)
    with pytest.raises(RuntimeInputError, match="v_descale must be float32"):
        tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs.double())
    with pytest.raises(RuntimeInputError, match="k is bf16"):
        tiledsl.attention(q8, k, v8, q_descale=qs, k_descale=ks, v_descale=vs)
    with pytest.raises(RuntimeInputError, match="for FP8 attention"):
        tiledsl.attention(q, k, v, q_descale=qs)
    with pytest.raises(RuntimeInputError, match="q_descale is required"):
        q8b, k8b, v8b, *_ = tiledsl.quantize_fp8(q, k, v, block=128)
        tiledsl.attention(q8b, k8b, v8b, k_descale=torch.ones(1, 2, 2, device="cuda"),
                          v_descale=torch.ones(1, 2, 2, device="cuda"))


@pytest.mark.parametrize("causal", [False, True])
def test_a_zero_score_descale_gives_uniform_weights(torch, causal):
    """q_descale 0 (an all-zero Q's): every true score is 0, so each row averages the values it sees; masked keys
    stay out (their raw -inf must not become -inf * 0 = NaN)."""
    q, k, v = _inputs(torch, 1, 2, 2, 200, 200, 128)
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
    o = tiledsl.attention(q8, k8, v8, causal=causal, q_descale=torch.zeros_like(qs), k_descale=ks, v_descale=vs)
    values = v8.float() * vs.view(1, -1, 1, 1)
    if causal:
        ref = values.cumsum(2) / torch.arange(1, 201, device="cuda").view(1, 1, -1, 1)
    else:
        ref = values.mean(2, keepdim=True).expand_as(values)
    assert torch.isfinite(o).all() and _relative(o.float().cpu().numpy(), ref.double().cpu().numpy()) < 2e-2


@pytest.mark.parametrize("block", [None, "tensor", 128, (128, 64)])
@pytest.mark.parametrize("rotate", [None, "hadamard"])
def test_quantize_fp8_matches_its_numpy_model(torch, block, rotate):
    q, k, v = _inputs(torch, 2, 4, 2, 300, 200, 128, outliers=True)
    got = tiledsl.quantize_fp8(q, k, v, block=block, rotate=rotate, seed=9)
    signs = hadamard_signs(128, 9)
    rows = {"q": block if not isinstance(block, tuple) else block[0],
            "k": block if not isinstance(block, tuple) else block[1]}
    for i, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        x = x.float().cpu().numpy()
        if rotate and name != "v":
            x = rotate_rows(x, signs)
        r = rows["q" if name == "q" else "k"]
        raw, descale = quantize_model(x, r if isinstance(r, int) else None, kv_heads=2 if name == "q" else None,
                                      per_tensor=block == "tensor")
        np.testing.assert_array_equal(got[3 + i].cpu().numpy(), descale)
        np.testing.assert_array_equal(_bytes(got[i]), raw)


def test_memcheck_small_case(tmp_path):
    script = tmp_path / "fp8_small.py"
    script.write_text(textwrap.dedent("""
        import torch, tiledsl
        q, k, v = (torch.randn(1, 2, n, 64, device="cuda").to(torch.bfloat16) for n in (33, 70, 70))
        for block in (None, (128, 128)):
            q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v, block=block, rotate="hadamard")
            o = tiledsl.attention(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
        torch.cuda.synchronize()
        assert torch.isfinite(o).all()
    """))
    memcheck(script)


# A descale the kernel cannot use: (quantize_fp8's block, which descale, its flat entry, value, what the report says,
# the first row a causal mask makes NaN). The rows that read it are NaN and the kernel reports the entry; every other
# row is the good call's bits. Shapes: per head (batch 2, kv heads 2), per block (2, 2, 3 kv tiles of 128).
BAD_DESCALES = {
    "negative q per tensor": ("tensor", 0, 0, -1.0, r"q_descale entry 0 \(flat\) = -1\.0 is not a finite number", 0),
    "NaN k per head": (None, 1, 3, float("nan"), r"k_descale entry 3 \(flat\) = nan is not a finite number", 0),
    "inf v per head": (None, 2, 1, float("inf"), r"v_descale entry 1 \(flat\) = inf is not a finite number", 0),
    # kv tile 2 of (batch 1, kv head 0): causal, the q tile that reaches it
    "negative k per block": (128, 1, 8, -0.5, r"k_descale entry 8 \(flat\) = -0\.5 is not a finite number", 256),
    # kv tile 1 of (batch 0, kv head 1): causal, the q tiles that reach it (the first stops at tile 0)
    "zero v per block": (128, 2, 4, 0.0, r"v_descale entry 4 \(flat\) = 0: a per-block V descale must be > 0", 128),
}


@pytest.mark.parametrize("case", list(BAD_DESCALES))
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_a_bad_descale_is_nan_and_reported(torch, case, causal):
    """batch 2, 4 heads over 2 kv heads, 300 queries and keys: a bad entry of one (batch, kv head) makes that
    group's rows NaN (under causal, the q tiles that see the bad kv tile), and the kernel reports it."""
    block, which, flat, value, match, causal_first_row = BAD_DESCALES[case]
    q, k, v = _inputs(torch, 2, 4, 2, 300, 300, 128)
    q8, k8, v8, *descales = tiledsl.quantize_fp8(q, k, v, block=block)
    good = tiledsl.attention(q8, k8, v8, causal=causal, q_descale=descales[0], k_descale=descales[1],
                             v_descale=descales[2])
    tiledsl.check_errors()   # raises nothing
    bad = [d.clone() for d in descales]
    bad[which].view(-1)[flat] = value
    out = torch.full_like(good, float("nan"))
    out.copy_(tiledsl.attention(q8, k8, v8, causal=causal, q_descale=bad[0], k_descale=bad[1], v_descale=bad[2]))
    with pytest.raises(RuntimeInputError, match=match):
        tiledsl.check_errors()
    expected = torch.zeros(out.shape[:3], dtype=torch.bool, device="cuda")
    if block == "tensor":
        expected[:] = True
    else:
        batch, kv_head = divmod(flat // (3 if block else 1), 2)
        expected[batch, 2 * kv_head:2 * kv_head + 2, causal_first_row if causal else 0:] = True
    assert torch.equal(torch.isnan(out.float()).all(-1), expected)
    assert not torch.isnan(out[~expected].float()).any()
    assert torch.equal(out[~expected], good[~expected]), "rows that read no bad descale changed"


def test_nan_bytes_in_the_inputs_give_nan_rows_and_no_report(torch):
    q, k, v = _inputs(torch, 1, 2, 2, 200, 200, 128)
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
    q8.view(torch.uint8)[0, 1, 7, 3] = 0x7F   # e4m3fn's NaN
    o = tiledsl.attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
    torch.cuda.synchronize()
    tiledsl.check_errors()   # the descales are good: nothing is reported
    assert torch.isnan(o[0, 1, 7].float()).all() and torch.isfinite(o[0, 0].float()).all()
