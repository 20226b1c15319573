"""FP8 attention's edges beside tests/test_gpu_fp8_forward.py's grid, through tiledsl.attention: rows that see no key
(causal with more queries than keys, kv_lens of 0 for every sequence), a window open on both sides, per-block
descales with a ragged kv_lens (tiles past a sequence's keys, a last tile cut short), and kv_lens entries out of
range, which the kernel bounds on the device (NaN rows for that sequence only, the entry reported by
tiledsl.check_errors(), no host sync) and validate=True refuses on the host. Each against the kernel's arithmetic
in float64 (reference/fp8.fp8_kernel_attention) within test_gpu_fp8_forward's TOL_O / TOL_LSE.

    python -m pytest -m gpu tests/test_gpu_fp8_edges.py
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import Descale, DType, Mask

from .gpu_support import no_host_sync, refused_on_host_and_by_the_kernel, requires_gpu
from .test_gpu_fp8_forward import TOL_LSE, TOL_O, _bytes, _inputs, _relative

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")


def _run(mask, window, q_len, kv_len, d, kv_lens, block, heads=4, kv_heads=2):
    """(O, LSE, spec, quantized inputs) of tiledsl.attention into NaN-poisoned outputs; block as quantize_fp8's."""
    import tiledsl
    from tiledsl.dispatch.tuned import fp8_descale_kind, fp8_spec
    from tiledsl.runtime.device import device_arch
    q, k, v = _inputs(torch, len(kv_lens), heads, kv_heads, q_len, kv_len, d)
    tiles = fp8_spec(device_arch(), d, mask, window, None, Descale.PER_BLOCK, DType.BF16).schedule
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v, block=(tiles.tile_q, tiles.tile_kv) if block else None)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    o, lse = tiledsl.attention(q8, k8, v8, causal=mask is Mask.CAUSAL, window=window, kv_lens=lens, return_lse=True,
                               q_descale=qs, k_descale=ks, v_descale=vs)
    torch.cuda.synchronize()
    spec = fp8_spec(device_arch(), d, mask, window, None, fp8_descale_kind(qs, ks, vs), DType.BF16)
    return o, lse, spec, (q8, k8, v8, qs, ks, vs), np.array(kv_lens)


def _check(o, lse, spec, inputs, kv_lens):
    from tiledsl.reference.fp8 import fp8_kernel_attention
    q8, k8, v8, qs, ks, vs = inputs
    ref_o, ref_lse = fp8_kernel_attention(spec, _bytes(q8), _bytes(k8), _bytes(v8), qs.cpu().numpy(),
                                          ks.cpu().numpy(), vs.cpu().numpy(), kv_lens=kv_lens)
    got, got_lse = o.float().cpu().numpy(), lse.cpu().numpy()
    assert not np.isnan(got).any() and not np.isnan(got_lse).any()
    assert _relative(got, ref_o) <= TOL_O
    seen = np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == seen).all(), "rows that see no key: LSE -inf exactly there"
    assert not got[~seen].any(), "rows that see no key: O = 0"
    assert np.abs(got_lse[seen] - ref_lse[seen]).max(initial=0) <= TOL_LSE
    return ref_lse


EDGES = [  # (mask, window, q_len, kv_len, d, kv_lens, per-block descales)
    (Mask.CAUSAL, None, 1000, 300, 128, [300, 17], False),       # 700 (983) leading rows see no key
    (Mask.CAUSAL, None, 1000, 300, 64, [300, 1], True),
    (Mask.WINDOW, (64, 32), 1000, 1000, 128, [1000, 333], True),  # both sides open; a ragged last kv tile
    (Mask.NONE, None, 17, 4097, 256, [4097, 1000], True),         # per block: tiles past 1000 are never read
    (Mask.NONE, None, 300, 300, 128, [0, 0], False),              # no keys anywhere
]


@pytest.mark.parametrize("mask, window, q_len, kv_len, d, kv_lens, block", EDGES)
def test_fp8_edges_against_the_kernels_arithmetic(mask, window, q_len, kv_len, d, kv_lens, block):
    o, lse, spec, inputs, lens = _run(mask, window, q_len, kv_len, d, kv_lens, block)
    ref_lse = _check(o, lse, spec, inputs, lens)
    if not any(kv_lens):
        assert np.isneginf(ref_lse).all() and not o.float().abs().sum().item()


@contextlib.contextmanager
def _reports_cleared():
    import tiledsl
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeInputError):
        tiledsl.check_errors()
    yield
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeInputError):
        tiledsl.check_errors()


@pytest.mark.parametrize("value", [-1, 301, 2**31 - 1])
def test_fp8_kv_lens_out_of_range_poison_only_their_sequence(value):
    import tiledsl
    q, k, v = _inputs(torch, 3, 4, 2, 200, 300, 128)
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
    good = torch.tensor([300, 123, 77], dtype=torch.int32, device="cuda")
    bad = good.clone()
    bad[1] = value
    with _reports_cleared():
        clean = tiledsl.attention(q8, k8, v8, causal=True, kv_lens=good, q_descale=qs, k_descale=ks, v_descale=vs)
        torch.cuda.synchronize()
        tiledsl.check_errors()   # nothing reported for good lengths
        with no_host_sync():
            o = tiledsl.attention(q8, k8, v8, causal=True, kv_lens=bad, q_descale=qs, k_descale=ks, v_descale=vs)
        torch.cuda.synchronize()
        assert torch.isnan(o[1].float()).all()
        assert torch.equal(o[[0, 2]], clean[[0, 2]])   # the other sequences bit for bit
        with pytest.raises(RuntimeInputError, match=rf"kv_lens\[1\] = {value}"):
            tiledsl.check_errors()
        refused_on_host_and_by_the_kernel(
            lambda validate: tiledsl.attention(q8, k8, v8, causal=True, kv_lens=bad, q_descale=qs, k_descale=ks,
                                               v_descale=vs, validate=validate), rf"kv_lens\[1\] = {value}",
            r"kv_lens must lie in \[0, 300\]")


def test_fp8_refuses_modifications_and_kv_cache_scales():
    import tiledsl
    q, k, v = _inputs(torch, 1, 2, 2, 64, 64, 64)
    q8, k8, v8, qs, ks, vs = tiledsl.quantize_fp8(q, k, v)
    with pytest.raises(RuntimeInputError, match=r"FP8 .* no kernel with score or mask modifications \(softcap\)"):
        tiledsl.attention(q8, k8, v8, softcap=30.0, q_descale=qs, k_descale=ks, v_descale=vs)
    with pytest.raises(RuntimeInputError, match="k_scale / v_scale dequantize an FP8 KV cache"):
        tiledsl.attention(q8, k8, v8, k_scale=1.0)
