"""Packed variable-length prefill (`layout = varlen`, the hopper family) on the GPU against the float64
serving reference: lengths 1..4097 mixed with empty sequences, q lengths != k lengths per sequence
(rows with no visible key), every mask, GQA, both dtypes, d 64/128, both launches. Outputs are
NaN-poisoned slices of larger buffers: every row of every sequence must be written, and the guard
rows around them must stay NaN (no store spills past a sequence or the tensor)."""
from __future__ import annotations


import numpy as np
import pytest

from tiledsl.spec import DType, Mask

from .gpu_support import MASKS, TOLERANCE_LSE, TOLERANCE_O, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

GUARD = 3   # poisoned rows before and after the outputs


def _case(q_lens, k_lens, heads, kv_heads, d, dtype, seed):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tdtype = torch.bfloat16 if dtype is DType.BF16 else torch.float16
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), heads, d, device="cuda", dtype=tdtype, generator=gen)
    k = torch.randn(sum(k_lens), kv_heads, d, device="cuda", dtype=tdtype, generator=gen)
    v = torch.randn(sum(k_lens), kv_heads, d, device="cuda", dtype=tdtype, generator=gen)
    return q, k, v, cu_q, cu_k


def _poisoned(total_q, heads, dv, tdtype):
    """(out, lse, out buffer, lse buffer): outputs inside NaN buffers with GUARD rows either side."""
    import torch
    out_buf = torch.full((total_q + 2 * GUARD, heads, dv), float("nan"), device="cuda", dtype=tdtype)
    lse_buf = torch.full((heads * total_q + 2 * GUARD * heads,), float("nan"), device="cuda", dtype=torch.float32)
    out = out_buf[GUARD:GUARD + total_q]
    lse = lse_buf[GUARD * heads:GUARD * heads + heads * total_q].view(heads, total_q)
    return out, lse, out_buf, lse_buf


def _check(q, k, v, cu_q, cu_k, mask, left, right, out, lse, out_buf=None, lse_buf=None, mods=None, aux=None):
    """out, lse against the float64 reference (with `mods` and their host `aux` tensors, if any), per tensor and
    per sequence; with the poisoned buffers around them, their guard rows must still be NaN."""
    import torch
    from tiledsl.reference.serving import varlen_attention as reference
    torch.cuda.synchronize()
    host = [x.float().cpu().numpy() for x in (q, k, v)]
    ref_o, ref_lse = reference(*host, cu_q.cpu().numpy(), cu_k.cpu().numpy(), mask=mask, window_left=left,
                               window_right=right, mods=mods, aux=aux)
    o = out.float().cpu().numpy().astype(np.float64)
    got_lse = lse.cpu().numpy().T.astype(np.float64)   # (heads, total_q) -> the reference's (total_q, heads)
    assert not np.isnan(o).any(), f"unwritten O rows: {sorted(set(np.argwhere(np.isnan(o))[:, 0].tolist()))[:10]}"
    assert not np.isnan(got_lse).any(), "unwritten LSE entries"
    err_o = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30)
    assert err_o < TOLERANCE_O, f"O relative error {err_o}"
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == finite).all(), "LSE -inf (no visible key) where the reference differs"
    if finite.any():
        err_lse = np.abs(got_lse[finite] - ref_lse[finite]).max()
        assert err_lse < TOLERANCE_LSE, f"LSE error {err_lse}"
    # every row's own error too: a wrong short sequence hides in the whole tensor's norm
    for b in range(cu_q.shape[0] - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref_rows = ref_o[rows]
        if ref_rows.size and np.linalg.norm(ref_rows) > 0:
            err = np.linalg.norm(o[rows] - ref_rows) / np.linalg.norm(ref_rows)
            assert err < TOLERANCE_O, f"sequence {b}: O relative error {err}"
        elif ref_rows.size:
            assert not o[rows].any(), f"sequence {b} sees no key: O must be 0"
    if out_buf is None:
        return
    total_q, heads = out.shape[:2]
    for guard in (out_buf[:GUARD], out_buf[GUARD + total_q:], lse_buf[:GUARD * heads], lse_buf[GUARD * heads + heads * total_q:]):
        assert torch.isnan(guard.float()).all(), "a store spilled past the outputs"


def run_varlen(q_lens, k_lens, mask="none", d=128, dtype=DType.BF16, heads=4, kv_heads=2, persistent=None, seed=0):
    from tiledsl import varlen_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.serving.varlen import varlen_spec
    kind, left, right = MASKS[mask]
    q, k, v, cu_q, cu_k = _case(q_lens, k_lens, heads, kv_heads, d, dtype, seed)
    window = (left, right) if kind == "window" else None
    spec = varlen_spec(device_arch(), dtype, d, Mask(kind), d, window)
    kernel_for(spec).persistent = persistent
    out, lse, out_buf, lse_buf = _poisoned(q.shape[0], heads, d, q.dtype)
    kernel_for(spec)(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), out=out, lse=lse)
    _check(q, k, v, cu_q, cu_k, kind, left, right, out, lse, out_buf, lse_buf)
    kernel_for(spec).persistent = None
    # the public API gives the same O (and LSE) on fresh outputs
    o2, lse2 = varlen_attention(q, k, v, cu_q, cu_k, causal=kind == "causal", window=window, return_lse=True)
    assert torch_equal(o2, out) and torch_equal(lse2, lse, nan_ok=True)


def torch_equal(a, b, nan_ok=False):
    import torch
    return bool(torch.equal(a, b)) if not nan_ok else bool(((a == b) | (a.isinf() & b.isinf())).all())


MIXED = [1, 17, 0, 1000, 4097, 0, 300]


# every mask on bf16, fp16 on two of them (its kernels share every size with bf16's)
CASES = [(d, mask, DType.BF16) for d in (64, 128) for mask in MASKS] + [(128, "causal", DType.FP16), (64, "none", DType.FP16)]


@pytest.mark.parametrize("d, mask, dtype", CASES)
def test_mixed_lengths_with_empty_sequences(d, mask, dtype):
    run_varlen(MIXED, MIXED, mask, d, dtype, seed=d + len(mask))


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("mask", list(MASKS))
def test_q_lengths_differ_from_k_lengths(mask, persistent):
    # q > k under causal leaves a sequence's first rows with no visible key (O = 0, LSE = -inf);
    # q = 5, k = 0 sees nothing at all; q = 0, k = 64 gives no work item.
    run_varlen([300, 1, 5, 129, 0, 1000], [1000, 4097, 0, 64, 64, 300], mask, 128, persistent=persistent, seed=7)


@pytest.mark.parametrize("d", [64, 128])
def test_gqa_and_one_kv_head(d):
    run_varlen([17, 1000, 250], [17, 1000, 700], "causal", d, heads=8, kv_heads=1, seed=3)


def test_input_errors_name_the_tensor():
    import torch
    from tiledsl import RuntimeInputError, varlen_attention
    q, k, v, cu_q, cu_k = _case([5, 7], [5, 7], 2, 2, 64, DType.BF16, 0)
    with pytest.raises(RuntimeInputError, match="cu_seqlens_q"):
        varlen_attention(q, k, v, cu_q.to(torch.int64), cu_k)
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_k\[2\] = 12, but the packed tensor holds 11"):
        varlen_attention(q, k[:11], v[:11], cu_q, cu_k)
    with pytest.raises(RuntimeInputError, match="max_seqlen for cu_seqlens_q is 6"):
        varlen_attention(q, k, v, cu_q, cu_k, 6)
    with pytest.raises(RuntimeInputError, match="cu_seqlens_q.*GPU"):
        varlen_attention(q, k, v, cu_q.cpu(), cu_k)
    with pytest.raises(RuntimeInputError, match="k: .*head_dim|k has head_dim"):
        varlen_attention(q, k[..., :32].contiguous(), v, cu_q, cu_k)
    with pytest.raises(RuntimeInputError, match="head_dim 96"):
        varlen_attention(q.new_zeros(12, 2, 96), k.new_zeros(12, 2, 96), v.new_zeros(12, 2, 96), cu_q, cu_k)


def test_sanitizer_memcheck_small_varlen_launch():
    import os
    import subprocess
    import sys
    script = ("from tests.test_gpu_varlen import run_varlen\n"
              "for mask in ('none', 'causal', 'window'):\n"
              "    for persistent in (True, False):\n"
              "        run_varlen([1, 17, 0, 200, 5], [3, 17, 9, 130, 0], mask, 64, persistent=persistent)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        result = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "9",
                                 sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=600)
    except FileNotFoundError:
        pytest.skip("compute-sanitizer not on PATH")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout, result.stdout[-3000:]
