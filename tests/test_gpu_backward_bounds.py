"""The backward's kv_lens bounded on the device (templates/backward_ops.j2, backward_common.cuh): a bad entry
(negative, over the keys k holds, huge) gives its sequence no key, NaN dQ, dK and dV in every head, and one
report that tiledsl.check_errors() raises naming kv_lens, the batch, the value and the bound; the next call
raises it too. The other sequences' gradients are the same as with the bad entry replaced by a good one (bit for
bit where the sum is order-free: dK and dV always, dQ when deterministic or when each dQ element gets at most two
fp32 adds, one kv tile) and match the float64 reference. The default backward of d64 and d128 (the warp-
specialized family), wgmma and mma.sync forced; causal or not; deterministic or not; dQ, dK and dV allocated
filled with 0.5, so the NaN is the kernels'. The unchecked calls run with torch's sync debug mode at "error";
validate=True refuses on the host; a small case runs under compute-sanitizer memcheck.

    python -m pytest -m gpu -n 14 tests/test_gpu_backward_bounds.py
"""
from __future__ import annotations

import contextlib

import pytest

from tests.gpu_support import (TOLERANCE_O, memcheck, no_host_sync, poison_outputs, refused_on_host_and_by_the_kernel,
                               requires_gpu)
from tests.test_gpu_backward import reference, rel

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")

import tiledsl
from tiledsl.dispatch.backward import attention_backward
from tiledsl.errors import RuntimeInputError

BATCH, HEADS, KV_HEADS, BAD, Q_LEN = 3, 4, 2, 1, 200   # sequence BAD gets the bad entry
# (kv_len, the good kv_lens): three kv tiles of 128 keys, and one (each dQ element then gets at most two adds)
SHAPES = ((300, (300, 211, 77)), (128, (128, 100, 77)))
CONFIGS = [(d, causal, deterministic, mma) for d in (64, 128) for causal in (False, True)
           for deterministic in (False, True) for mma in (None, "wgmma", "mma.sync")
           if not (mma == "wgmma" and deterministic)]   # the wgmma kernel sums dQ with atomics only


def bad_values(kv_len: int) -> dict:
    """bad kv_lens value -> what the report says of it."""
    return {-1: "-1 is negative", kv_len + 1: f"{kv_len + 1} is over the {kv_len} keys k holds",
            2**30: f"{2**30} is over the {kv_len} keys k holds"}


def clear_reports():
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeInputError):
        tiledsl.check_errors()


def case(d: int, kv_len: int, lens: tuple, causal: bool):
    """Fresh q, k, v, dO; O, LSE and the gradients in float64 (O and LSE cast for the kernel)."""
    q = torch.randn(BATCH, HEADS, Q_LEN, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, KV_HEADS, kv_len, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse, *grads = reference(q, k, v, do, causal, kv_lens=torch.tensor(lens, device="cuda"))
    return (q, k, v, o.to(q.dtype), lse.float(), do), grads


@pytest.mark.parametrize("d,causal,deterministic,mma", CONFIGS,
                         ids=[f"d{d}-{'causal' if c else 'none'}-{'det' if t else 'atomic'}-{m or 'default'}"
                              for d, c, t, m in CONFIGS])
def test_bad_kv_lens_entry_poisons_only_its_sequence_without_a_sync(d, causal, deterministic, mma, monkeypatch):
    from tiledsl.runtime import launch
    poison_outputs(monkeypatch, 0.5)   # dQ, dK, dV start finite: a NaN below is the kernels' own
    try:
        check_bad_entries(d, causal, deterministic, mma)
    finally:
        monkeypatch.undo()
        launch.clear_prepared()


def check_bad_entries(d, causal, deterministic, mma):
    good = [b for b in range(BATCH) if b != BAD]
    for kv_len, lens in SHAPES:
        tensors, ref = case(d, kv_len, lens, causal)

        def call(kv_lens, **options):
            return attention_backward(*tensors, causal=causal, kv_lens=kv_lens, deterministic=deterministic, mma=mma,
                                      **options)
        good_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        clear_reports()
        call(good_lens)   # compiles and prepares (off the no-sync region)
        with no_host_sync():
            clean = call(good_lens)
        torch.cuda.synchronize()
        tiledsl.check_errors()   # nothing reported for good lengths
        errors = [rel(x[good].double(), r[good]) for x, r in zip(clean, ref)]
        assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"
        order_free = deterministic or kv_len <= 128
        for value, says in bad_values(kv_len).items():
            bad = good_lens.clone()
            bad[BAD] = value
            with no_host_sync():
                dq, dk, dv = call(bad)
            torch.cuda.synchronize()
            for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
                assert torch.isnan(x[BAD].float()).all(), (name, value)   # every head, every row
            assert torch.equal(dk[good], clean[1][good]) and torch.equal(dv[good], clean[2][good]), value
            if order_free:
                assert torch.equal(dq[good], clean[0][good]), value
            else:   # fp32 atomics from several kv tiles: the order of the adds varies from run to run
                assert rel(dq[good].double(), ref[0][good]) < TOLERANCE_O, value
            with pytest.raises(RuntimeInputError, match=rf"kv_lens\[{BAD}\] = {says}"):
                tiledsl.check_errors()
            tiledsl.check_errors()   # raised once, then cleared
        call(bad)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeInputError, match=rf"kv_lens\[{BAD}\] = {2**30}"):   # the next call raises it
            call(good_lens)
        clear_reports()
        bad[BAD] = -1
        refused_on_host_and_by_the_kernel(lambda validate: call(bad, validate=validate),
                                          rf"kv_lens\[{BAD}\] = -1 is negative",
                                          rf"kv_lens must lie in \[0, {kv_len}\], got values in \[-1, ")


SANITIZED = r"""
import torch, tiledsl
from tiledsl.dispatch.backward import attention_backward
from tiledsl.errors import RuntimeInputError
q = torch.randn(3, 2, 70, 64, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(3, 2, 90, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
o, do = torch.randn_like(q), torch.randn_like(q)
lse = torch.randn(3, 2, 70, device="cuda")
for mma, deterministic in ((None, False), (None, True), ("wgmma", False), ("mma.sync", False), ("mma.sync", True)):
    for value in (-1, 91, 2**30, 2**31 - 1):
        lens = torch.tensor([90, value, 33], device="cuda", dtype=torch.int32)
        grads = attention_backward(q, k, v, o, lse, do, causal=True, kv_lens=lens, mma=mma, deterministic=deterministic)
        torch.cuda.synchronize()
        try:
            tiledsl.check_errors()
            raise SystemExit(f"no report for kv_lens {value} ({mma}, deterministic={deterministic})")
        except RuntimeInputError as e:
            print("reported:", e)
        assert all(torch.isnan(g[1].float()).all() for g in grads)
print("ran")
"""


def test_memcheck_bad_entries_read_nothing(tmp_path):
    script = tmp_path / "backward_bounds_memcheck.py"
    script.write_text(SANITIZED)
    memcheck(script)
