"""Packed-sequence offsets bounded on the device (templates/index_bounds.cuh, hopper_varlen.cu.j2): a call given
max_seqlen_q and max_seqlen_k reads nothing on the host, so the kernel checks each sequence's cu_seqlens entries
against the packed tensors and the rows its work list covers. A bad sequence loads no key, stores NaN in the rows
it names inside the tensor, and is reported through the error word (tiledsl.check_errors(), and the next call);
every other sequence is bit-identical to the all-good call, which matches the float64 reference. The unchecked
calls run with torch's sync debug mode set to "error"; bad offsets run under compute-sanitizer too.

    python -m pytest -m gpu tests/test_gpu_varlen_bounds.py
"""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import Mask

from .gpu_support import TOLERANCE_O, memcheck, no_host_sync, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")

import tiledsl

Q_LENS, K_LENS, HEADS, KV_HEADS, D = (200, 333, 77), (150, 400, 90), 4, 2, 128
HUGE = 2**31 - 1
MAX_Q, MAX_K = max(Q_LENS), max(K_LENS)


def packed_case():
    cu_q = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(K_LENS)]).astype(np.int32)
    q = torch.randn(int(cu_q[-1]), HEADS, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), KV_HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, cu_q, cu_k


def device(offsets):
    return torch.as_tensor(offsets, device="cuda")


def unchecked(q, k, v, cu_q, cu_k, causal, max_q=MAX_Q, max_k=MAX_K):
    """varlen_attention without host reads (max_seqlen given): (O, LSE), under torch's sync check."""
    cu_q, cu_k = device(cu_q), device(cu_k)
    with no_host_sync():
        return tiledsl.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)


def sequence_rows(cu_q, s):
    return slice(int(cu_q[s]), int(cu_q[s + 1]))


# (what breaks, the sequences it makes bad, the report's words): each changes one entry of cu_seqlens_q / _k, or
# passes a max_seqlen_q that a sequence exceeds. An entry between two sequences belongs to both.
CASES = {
    "k start negative": ("k", 0, -3, (0,), r"cu_seqlens_k\[0\] = -3 is out of range: the packed tensor holds 640"),
    "k end past the tensor": ("k", 3, 641, (2,), r"cu_seqlens_k\[3\] = 641 is out of range: the packed tensor holds"),
    "k entry huge": ("k", 2, HUGE, (1, 2), rf"cu_seqlens_k\[2\] = {HUGE} is out of range"),
    "k end below start": ("k", 1, -1, (0, 1), r"cu_seqlens_k\[1\] = -1 is (below the entry before it|out of range)"),
    "q over max_seqlen_q": ("max", None, 250, (1,), (r"sequence 1 has 333 queries \(cu_seqlens_q\), more "
                                                     r"than max_seqlen_q = 250")),
}


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_sequence_is_nan_and_reported_and_the_others_are_exact(case, causal):
    from tiledsl.reference.serving import varlen_attention as reference
    q, k, v, cu_q, cu_k = packed_case()
    good_o, good_lse = unchecked(q, k, v, cu_q, cu_k, causal)
    tiledsl.check_errors()   # raises nothing
    ref_o, _ = reference(*(x.float().cpu().numpy() for x in (q, k, v)), cu_q, cu_k,
                         mask=Mask.CAUSAL if causal else Mask.NONE)
    err = np.linalg.norm(good_o.float().cpu().numpy() - ref_o) / np.linalg.norm(ref_o)
    assert err < TOLERANCE_O, f"the all-good call's O relative error {err}"

    which, index, value, bad, match = CASES[case]
    bad_q, bad_k, max_q = cu_q.copy(), cu_k.copy(), max(Q_LENS)
    if which == "k":
        bad_k[index] = value
    else:
        max_q = value
    o, lse = unchecked(q, k, v, bad_q, bad_k, causal, max_q=max_q)
    with pytest.raises(RuntimeInputError, match=match):
        tiledsl.check_errors()
    for s in range(len(Q_LENS)):
        rows = sequence_rows(cu_q, s)
        if s in bad:   # a sequence over max_seqlen_q: the rows past what the work list covers are not written
            rows = slice(rows.start, rows.start + min(Q_LENS[s], max_q))
            assert torch.isnan(o[rows].float()).all() and torch.isnan(lse[:, rows]).all(), f"sequence {s} not NaN"
        else:
            assert torch.equal(o[rows], good_o[rows]) and torch.equal(lse[:, rows], good_lse[:, rows]), \
                f"good sequence {s} changed"


def test_decreasing_query_offsets_are_reported_and_the_sequence_after_them_is_exact():
    """cu_seqlens_q[1] below cu_seqlens_q[0]: sequences 0 and 1 are bad (their rows have no owner); sequence 2's
    offsets are unchanged and its rows are exact. The report names the entry (which sequence reports first
    varies)."""
    q, k, v, cu_q, cu_k = packed_case()
    good_o, _ = unchecked(q, k, v, cu_q, cu_k, True)
    bad_q = cu_q.copy()
    bad_q[1] = -5
    o, _ = unchecked(q, k, v, bad_q, cu_k, True)
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_q\[1\] = -5 is (below the entry before it|out of range)"):
        tiledsl.check_errors()
    rows = sequence_rows(cu_q, 2)
    assert torch.equal(o[rows], good_o[rows])


def test_the_next_call_raises_a_pending_report_and_validate_refuses_on_the_host():
    q, k, v, cu_q, cu_k = packed_case()
    bad_k = cu_k.copy()
    bad_k[3] = 641
    unchecked(q, k, v, cu_q, bad_k, False)
    torch.cuda.synchronize()   # the report has landed; the next call's O(1) look finds it
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_k\[3\] = 641 is out of range"):
        unchecked(q, k, v, cu_q, cu_k, False)
    tiledsl.check_errors()   # read once: raises nothing now
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_k"):
        tiledsl.varlen_attention(q, k, v, device(cu_q), device(bad_k), max(Q_LENS), max(K_LENS), validate=True)
    with pytest.raises(RuntimeInputError, match="max_seqlen_q must be a non-negative int, got -1"):
        tiledsl.varlen_attention(q, k, v, device(cu_q), device(cu_k), -1, max(K_LENS))
    with pytest.raises(RuntimeInputError, match="max_seqlen_k must be a non-negative int, got 2.5"):
        tiledsl.varlen_attention(q, k, v, device(cu_q), device(cu_k), max(Q_LENS), 2.5)


def test_max_seqlen_q_zero_with_queries_is_reported():
    """A bound of 0 still gives every sequence one tile, so that the sequences it undercounts are reported."""
    q, k, v, cu_q, cu_k = packed_case()
    o, _ = unchecked(q, k, v, cu_q, cu_k, False, max_q=0)
    with pytest.raises(RuntimeInputError, match=r"sequence \d has \d+ queries \(cu_seqlens_q\), more than "
                                                r"max_seqlen_q = 0"):
        tiledsl.check_errors()
    assert torch.isnan(o[:64].float()).all()   # sequence 0's first tile (every tile is at least 64 rows)


SANITIZED = """
import numpy as np, torch, tiledsl
from tests.test_gpu_varlen_bounds import packed_case, unchecked, HUGE
q, k, v, cu_q, cu_k = packed_case()
for which, index, value in (("k", 0, -3), ("k", 2, HUGE), ("k", 3, 10**6), ("q", 1, -5), ("q", 3, 10**6),
                            ("q", 2, HUGE)):
    bad_q, bad_k = cu_q.copy(), cu_k.copy()
    (bad_k if which == "k" else bad_q)[index] = value
    for causal in (False, True):
        unchecked(q, k, v, bad_q, bad_k, causal)
        torch.cuda.synchronize()
        try:
            tiledsl.check_errors()
            raise SystemExit(f"{which}[{index}] = {value}: no report")
        except tiledsl.RuntimeInputError:
            pass
"""


def test_memcheck_bad_offsets_read_and_write_nothing_outside(tmp_path):
    script = tmp_path / "varlen_bounds_memcheck.py"
    script.write_text(SANITIZED)
    memcheck(script)
