"""FP8 attention over packed sequences (float8_e4m3fn q, k, v with cu_seqlens; the hopper family's e4m3 kernels
with `layout = varlen`) on the GPU:

* against the kernel's arithmetic in float64 per sequence (reference/fp8.varlen_fp8_kernel_attention: each
  sequence's bytes times its descales, the online softmax over its own kv tiles, P rounded to e4m3 before P V),
  whole tensor and sequence by sequence, within test_gpu_fp8_forward's TOL_O / TOL_LSE (which say why);
* against float64 attention of the bf16 inputs before quantization (the user's error, TOL_USER);
* lengths mixing 0, 1, 17, 300, 1000 and 4097, q lengths other than k lengths (rows that see no key), masks none /
  causal / window, GQA, d 64 / 128 / 256, per-tensor and per-(sequence, kv head) descales, bf16 and fp16 O,
  persistent and one-block-per-item launches; outputs NaN-poisoned with guard rows either side;
* varlen_attention given max_seqlen_q / max_seqlen_k (no host read, the bounded work list) gives the same bits,
  with no host sync, and so does VarlenAttention's planned run; its refusals name the tensor; quantize_fp8's
  per-tensor output of packed tensors read as strided views; quantize_fp8 of packed sequences (cu_seqlens) against
  the per-sequence model, its offsets bounded on the device; one compute-sanitizer memcheck of small launches.

    python -m pytest -m gpu tests/test_gpu_fp8_varlen.py
"""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.spec import Descale, DType, Mask

from .gpu_support import MASKS, memcheck, no_host_sync, requires_gpu
from .test_gpu_fp8_forward import TOL_LSE, TOL_O, TOL_USER

pytestmark = [pytest.mark.gpu, requires_gpu]

GUARD = 3   # NaN rows before and after the outputs
MIXED = [1, 17, 0, 1000, 4097, 0, 300]
UNEVEN_Q, UNEVEN_K = [300, 1, 5, 129, 0, 1000], [1000, 4097, 0, 64, 64, 300]   # q > k causal: rows with no key


def _quantize(x, cu, kv_heads, per_tensor):
    """Host float32 packed x (total, heads, d) -> (e4m3 bytes, descales): one descale for the tensor, or one per
    (sequence, kv head) (reference/fp8.quantize_model, quantize_fp8's arithmetic)."""
    from tiledsl.reference.fp8 import quantize_model
    if per_tensor:
        raw, descale = quantize_model(x.transpose(1, 0, 2)[None], None, per_tensor=True)
        return np.ascontiguousarray(raw[0].transpose(1, 0, 2)), descale
    raw, descales = np.zeros(x.shape, dtype=np.uint8), []
    for b in range(len(cu) - 1):
        got, descale = quantize_model(x[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None], None, kv_heads=kv_heads)
        raw[cu[b]:cu[b + 1]] = got[0].transpose(1, 0, 2)
        descales.append(descale[0])
    return raw, np.array(descales, dtype=np.float32).reshape(len(cu) - 1, kv_heads)


def make_case(q_lens, k_lens, heads, kv_heads, d, per_tensor, seed):
    """(host bf16-valued float32 q, k, v; device e4m3 q8, k8, v8; device descales; host and device cu_seqlens)."""
    import torch
    rng = np.random.default_rng(seed)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))

    def bf16_values(rows, h):
        x = torch.from_numpy(rng.standard_normal((rows, h, d)).astype(np.float32))
        return x.to(torch.bfloat16).float().numpy()
    host = [bf16_values(sum(q_lens), heads), bf16_values(sum(k_lens), kv_heads), bf16_values(sum(k_lens), kv_heads)]
    quantized = [_quantize(host[0], cu_q, kv_heads, per_tensor)] + [_quantize(x, cu_k, kv_heads, per_tensor)
                                                                     for x in host[1:]]
    device = [torch.from_numpy(raw).cuda().view(torch.float8_e4m3fn) for raw, _ in quantized]
    descales = [torch.from_numpy(descale).cuda() for _, descale in quantized]
    cu = (torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda())
    return host, device, descales, (cu_q, cu_k), cu, quantized


def _poisoned(total_q, heads, dv, dtype):
    import torch
    out_buf = torch.full((total_q + 2 * GUARD, heads, dv), float("nan"), device="cuda", dtype=dtype)
    lse_buf = torch.full((heads * (total_q + 2 * GUARD),), float("nan"), device="cuda", dtype=torch.float32)
    lse = lse_buf[GUARD * heads:GUARD * heads + heads * total_q].view(heads, total_q)
    return out_buf[GUARD:GUARD + total_q], lse, out_buf, lse_buf


def _relative(a, b):
    return np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0)


CASES = [  # (d, mask, q lens, k lens, heads, kv heads, per tensor, O dtype, persistent)
    (128, "none", MIXED, MIXED, 4, 2, False, "bf16", None),
    (128, "causal", MIXED, MIXED, 4, 1, True, "bf16", True),
    (64, "causal", UNEVEN_Q, UNEVEN_K, 2, 2, False, "fp16", False),
    (64, "window", MIXED, MIXED, 4, 2, False, "bf16", None),
    (256, "none", [17, 1, 1000], [17, 4097, 1000], 2, 1, False, "bf16", True),
    (256, "causal", MIXED, MIXED, 2, 2, True, "fp16", None),
    (128, "window", UNEVEN_Q, UNEVEN_K, 8, 2, True, "bf16", False),
]


@pytest.mark.parametrize("d, mask, q_lens, k_lens, heads, kv_heads, per_tensor, out, persistent", CASES)
def test_fp8_varlen_against_the_kernels_arithmetic(d, mask, q_lens, k_lens, heads, kv_heads, per_tensor, out,
                                                   persistent):
    import torch

    import tiledsl
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.reference.fp8 import varlen_fp8_kernel_attention
    from tiledsl.reference.serving import varlen_attention as float64_varlen
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.varlen import fp8_varlen_spec
    kind, left, right = MASKS[mask]
    window = (left, right) if kind == "window" else None
    host, (q8, k8, v8), (qs, ks, vs), (cu_q, cu_k), (cu_qd, cu_kd), quantized = make_case(
        q_lens, k_lens, heads, kv_heads, d, per_tensor, seed=d + len(mask) + heads)
    out_dtype = DType(out)
    spec = fp8_varlen_spec(device_arch(), d, Mask(kind), window, None,
                           Descale.PER_TENSOR if per_tensor else Descale.PER_HEAD, out_dtype)
    kernel = kernel_for(spec)
    torch_out = torch.bfloat16 if out_dtype is DType.BF16 else torch.float16
    o, lse, o_buf, lse_buf = _poisoned(q8.shape[0], heads, d, torch_out)
    if persistent and kernel.plan.launch_kind == "grid":   # one item a block (d256: O staged in K's ring)
        from tiledsl.errors import LaunchError
        kernel.persistent = True
        try:
            with pytest.raises(LaunchError, match="runs one work item per block"):
                kernel(q8, k8, v8, cu_qd, cu_kd, out=o, lse=lse, q_descale=qs, k_descale=ks, v_descale=vs)
        finally:
            kernel.persistent = None
        persistent = None
    kernel.persistent = persistent
    try:
        kernel(q8, k8, v8, cu_qd, cu_kd, out=o, lse=lse, q_descale=qs, k_descale=ks, v_descale=vs)
    finally:
        kernel.persistent = None
    torch.cuda.synchronize()
    for guard in (o_buf[:GUARD], o_buf[GUARD + q8.shape[0]:], lse_buf[:GUARD * heads],
                  lse_buf[GUARD * heads + heads * q8.shape[0]:]):
        assert torch.isnan(guard.float()).all(), "a store spilled past the outputs"
    got, got_lse = o.float().cpu().numpy().astype(np.float64), lse.cpu().numpy().T.astype(np.float64)
    assert not np.isnan(got).any() and not np.isnan(got_lse).any(), "unwritten rows"
    (q_raw, q_d), (k_raw, k_d), (v_raw, v_d) = quantized
    ref_o, ref_lse = varlen_fp8_kernel_attention(spec, q_raw, k_raw, v_raw, cu_q, cu_k, q_d, k_d, v_d)
    error = _relative(got, ref_o)
    assert error <= TOL_O, f"O is {error:.3e} normwise from the kernel's arithmetic (bound {TOL_O})"
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == finite).all(), "LSE -inf (no visible key) where the reference differs"
    assert np.abs(got_lse[finite] - ref_lse[finite]).max(initial=0) <= TOL_LSE
    for b in range(len(q_lens)):   # a wrong short sequence hides in the whole tensor's norm
        rows = slice(cu_q[b], cu_q[b + 1])
        if np.linalg.norm(ref_o[rows]) > 0:
            assert _relative(got[rows], ref_o[rows]) <= TOL_O, f"sequence {b}"
        else:
            assert not got[rows].any(), f"sequence {b} sees no key: O must be 0"
    user_o, _ = float64_varlen(*host, cu_q, cu_k, mask=kind, window_left=left, window_right=right)
    assert _relative(got, user_o) <= TOL_USER
    # the API with both bounds: the bounded work list (no host read), the same bits on fresh outputs
    again, again_lse = tiledsl.varlen_attention(q8, k8, v8, cu_qd, cu_kd, max(q_lens), max(k_lens),
                                                causal=kind == "causal", window=window, return_lse=True,
                                                q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=torch_out)
    assert again.dtype == torch_out and torch.equal(again, o)
    assert bool(((again_lse == lse) | (again_lse.isinf() & lse.isinf())).all())


def test_fp8_varlen_runs_without_host_sync_and_refuses_bad_descales():
    import torch

    import tiledsl
    from tiledsl import RuntimeInputError
    _, (q8, k8, v8), (qs, ks, vs), _, (cu_q, cu_k), _ = make_case([5, 130, 0], [9, 200, 3], 4, 2, 128, False, 1)
    o = tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, 130, 200, causal=True, q_descale=qs, k_descale=ks,
                                 v_descale=vs)
    with no_host_sync():
        again = tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, 130, 200, causal=True, q_descale=qs, k_descale=ks,
                                         v_descale=vs)
    assert torch.equal(o, again) and o.dtype == torch.bfloat16
    ones = tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, causal=True)   # None: descales of 1.0
    assert torch.isfinite(ones[:5].float()).all()
    with pytest.raises(RuntimeInputError, match=r"k_descale must have shape \(sequences, kv_heads\) = \(3, 2\)"):
        tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, q_descale=qs, k_descale=ks[:2], v_descale=vs)
    with pytest.raises(RuntimeInputError, match="v_descale must be float32"):
        tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, q_descale=qs, k_descale=ks, v_descale=vs.double())
    with pytest.raises(RuntimeInputError, match="per-block"):
        tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, q_descale=qs[:, :, None], k_descale=ks, v_descale=vs)
    with pytest.raises(RuntimeInputError, match="k is bf16"):
        tiledsl.varlen_attention(q8, k8.view(torch.uint8).to(torch.bfloat16), v8, cu_q, cu_k, q_descale=qs)


def test_planned_fp8_varlen_run_matches_the_call():
    import torch

    import tiledsl
    q_lens, k_lens = [300, 1, 17, 0, 129], [1000, 5, 17, 64, 129]
    _, (q8, k8, v8), (qs, ks, vs), (cu_q, cu_k), (cu_qd, cu_kd), _ = make_case(q_lens, k_lens, 8, 2, 128, False, 4)
    wrapper = tiledsl.VarlenAttention(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.float8_e4m3fn,
                                      device="cuda", max_batch=8, causal=True, out_dtype=torch.float16)
    wrapper.plan(cu_q, cu_k)
    out = torch.full((q8.shape[0], 8, 128), float("nan"), dtype=torch.float16, device="cuda")
    wrapper.run(q8, k8, v8, out=out, q_descale=qs, k_descale=ks, v_descale=vs)   # prepares the call
    out.fill_(float("nan"))
    with no_host_sync():
        got = wrapper.run(q8, k8, v8, out=out, q_descale=qs, k_descale=ks, v_descale=vs)
    expected = tiledsl.varlen_attention(q8, k8, v8, cu_qd, cu_kd, causal=True, q_descale=qs, k_descale=ks,
                                        v_descale=vs, out_dtype=torch.float16)
    assert got is out and torch.equal(out, expected)


def test_quantize_fp8_of_packed_tensors_per_tensor_feeds_varlen_in_place():
    """The README's recipe: the packed tensors quantized as one batch entry (block="tensor"), their e4m3 results
    passed back as strided (total, heads, d) views."""
    import torch

    import tiledsl
    from tiledsl.reference.fp8 import varlen_fp8_kernel_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.varlen import fp8_varlen_spec
    lens = [17, 300, 1, 0, 129]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, 64, device="cuda").to(torch.bfloat16) for h in (4, 2, 2))
    batched = tiledsl.quantize_fp8(*(x[None].transpose(1, 2) for x in (q, k, v)), block="tensor")
    q8, k8, v8 = (x[0].transpose(0, 1) for x in batched[:3])
    assert not q8.is_contiguous() and q8.shape == q.shape
    o = tiledsl.varlen_attention(q8, k8, v8, cu, cu, causal=True, q_descale=batched[3], k_descale=batched[4],
                                 v_descale=batched[5])
    torch.cuda.synchronize()
    spec = fp8_varlen_spec(device_arch(), 64, Mask.CAUSAL, None, None, Descale.PER_TENSOR, DType.BF16)
    raw = [x.contiguous().view(torch.uint8).cpu().numpy() for x in (q8, k8, v8)]
    ref_o, _ = varlen_fp8_kernel_attention(spec, *raw, cu.cpu().numpy(), cu.cpu().numpy(),
                                           *(x.cpu().numpy() for x in batched[3:]))
    assert _relative(o.float().cpu().numpy(), ref_o) <= TOL_O


PACKED_CASES = [  # (d, lens q, lens k, heads, kv heads, block, rotate)
    (128, MIXED, MIXED, 4, 2, None, None), (64, UNEVEN_Q, UNEVEN_K, 4, 1, None, "hadamard"),
    (256, [17, 0, 1000], [5, 4097, 0], 2, 2, "tensor", None), (128, [0, 0], [3, 0], 8, 2, None, "hadamard"),
]


@pytest.mark.parametrize("d, q_lens, k_lens, heads, kv_heads, block, rotate", PACKED_CASES)
def test_quantize_fp8_of_packed_sequences_matches_the_per_sequence_model(d, q_lens, k_lens, heads, kv_heads, block,
                                                                        rotate):
    """quantize_fp8 with cu_seqlens: bytes and (sequences, kv_heads) descales equal to quantize_model on each
    sequence (rotated as rotate_rows does), unchanged with both bounds given (no host sync then); poisoned outputs
    in the packed layout are all written; the result feeds varlen_attention."""
    import torch

    import tiledsl
    from tiledsl.reference.fp8 import hadamard_signs, rotate_rows, varlen_fp8_kernel_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.varlen import fp8_varlen_spec
    rng = np.random.default_rng()
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_lens, k_lens))
    q, k, v = (torch.from_numpy(rng.standard_normal((total, h, d)).astype(np.float32) * 3).to(torch.bfloat16).cuda()
               for total, h in ((cu_q[-1], heads), (cu_k[-1], kv_heads), (cu_k[-1], kv_heads)))
    cu_qd, cu_kd = torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()
    got = tiledsl.quantize_fp8(q, k, v, block=block, rotate=rotate, seed=3, cu_seqlens_q=cu_qd, cu_seqlens_k=cu_kd)
    torch.cuda.synchronize()
    signs = hadamard_signs(d, 3)
    for i, (name, x, cu) in enumerate((("q", q, cu_q), ("k", k, cu_k), ("v", v, cu_k))):
        host = x.float().cpu().numpy()
        if rotate and name != "v":
            host = rotate_rows(host, signs)
        raw, descale = _quantize(host, cu, kv_heads, block == "tensor")
        assert got[i].shape == x.shape and got[i].dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(got[3 + i].cpu().numpy(), descale, err_msg=f"{name}'s descales")
        np.testing.assert_array_equal(got[i].view(torch.uint8).cpu().numpy(), raw, err_msg=f"{name}'s bytes")
    tiledsl.quantize_fp8(q, k, v, block=block, rotate=rotate, seed=3, cu_seqlens_q=cu_qd, cu_seqlens_k=cu_kd,
                         max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))   # compiled and warm
    with no_host_sync():
        bounded = tiledsl.quantize_fp8(q, k, v, block=block, rotate=rotate, seed=3, cu_seqlens_q=cu_qd,
                                       cu_seqlens_k=cu_kd, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
    for a, b in zip(got, bounded):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    if cu_q[-1] and cu_k[-1]:
        o = tiledsl.varlen_attention(*got[:3], cu_qd, cu_kd, max(q_lens), max(k_lens), causal=True,
                                     q_descale=got[3], k_descale=got[4], v_descale=got[5])
        torch.cuda.synchronize()
        kind = Descale.PER_TENSOR if block == "tensor" else Descale.PER_HEAD
        spec = fp8_varlen_spec(device_arch(), d, Mask.CAUSAL, None, None, kind, DType.BF16)
        raw = [x.view(torch.uint8).cpu().numpy() for x in got[:3]]
        ref_o, _ = varlen_fp8_kernel_attention(spec, *raw, cu_q, cu_k, *(x.cpu().numpy() for x in got[3:]))
        assert _relative(o.float().cpu().numpy(), ref_o) <= TOL_O


def test_quantize_fp8_of_packed_sequences_reports_bad_offsets_and_refuses_bad_arguments():
    import torch

    import tiledsl
    from tiledsl import RuntimeInputError
    lens = [5, 130, 0]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, 128, device="cuda").to(torch.bfloat16) for h in (4, 2, 2))
    down = cu.clone()
    down[2] = 2   # below the entry before it
    tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=down, max_seqlen_q=130, max_seqlen_k=200)
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_k\[2\] = 2 is below the entry before it \(5\)"):
        tiledsl.check_errors()
    tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=130)
    with pytest.raises(RuntimeInputError, match=r"sequence 1 has 130 queries \(cu_seqlens_q\), more than "
                                                r"max_seqlen_q = 100"):
        tiledsl.check_errors()
    tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130, max_seqlen_k=0)
    with pytest.raises(RuntimeInputError, match=r"sequence [01] has (5|130) keys \(cu_seqlens_k\), more than "
                                                r"max_seqlen_k = 0"):
        tiledsl.check_errors()
    past = cu.clone()
    past[3] = 10**6
    tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=past, cu_seqlens_k=cu, max_seqlen_q=130, max_seqlen_k=130)
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_q\[3\] = 1000000 is out of range: the packed tensor "
                                                r"holds 135"):
        tiledsl.check_errors()
    with pytest.raises(RuntimeInputError, match="block None .* or 'tensor'"):
        tiledsl.quantize_fp8(q, k, v, block=128, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(RuntimeInputError, match="cu_seqlens_k must be an int32 tensor"):
        tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu.long())
    with pytest.raises(RuntimeInputError, match="need both cu_seqlens_q and cu_seqlens_k"):
        tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu)
    with pytest.raises(RuntimeInputError, match=r"\(total, heads, d\)"):
        tiledsl.quantize_fp8(q[None], k[None], v[None], cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(RuntimeInputError, match="max_seqlen_q must be an int >= 0"):
        tiledsl.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=-1)
    with pytest.raises(RuntimeInputError, match="bound packed sequences"):
        tiledsl.quantize_fp8(q[None], k[None], v[None], max_seqlen_q=4)


def test_memcheck_small_fp8_varlen_launches(tmp_path):
    script = tmp_path / "fp8_varlen_small.py"
    script.write_text(textwrap.dedent("""
        import torch, tiledsl
        from tests.test_gpu_fp8_varlen import make_case
        for per_tensor, causal in ((False, True), (True, False)):
            _, (q8, k8, v8), (qs, ks, vs), _, (cu_q, cu_k), _ = make_case([1, 17, 0, 200, 5], [3, 17, 9, 130, 0], 2,
                                                                          1, 64, per_tensor, 0)
            o = tiledsl.varlen_attention(q8, k8, v8, cu_q, cu_k, causal=causal, q_descale=qs, k_descale=ks,
                                         v_descale=vs)
        torch.cuda.synchronize()
        assert not torch.isnan(o.float()).any()
    """))
    memcheck(script)
