"""Index tensors bounded on the device (templates/index_bounds.cuh): a bad block-table entry or kv_len
makes only its sequence's rows NaN, reads nothing through it, and is reported through the error word
(tiledsl.check_errors(), and the next call of a bounded kernel); the other sequences of the batch are
bit-identical to an all-good batch and match the float64 reference. The unchecked calls run with
torch's sync debug mode set to "error"; one launch with bad entries runs under compute-sanitizer.

    python -m pytest -m gpu tests/test_gpu_device_bounds.py
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.spec import Axis, DType, KernelSpec, Mask, Problem, Schedule

from .gpu_support import TOLERANCE_O, memcheck, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")

import tiledsl  # noqa: E402

PAGE, D, HEADS, KV_HEADS, BATCH, BAD = 16, 128, 8, 2, 3, 1   # sequence BAD gets the bad entry
LENS = (200, 333, 77)
HUGE = 2**31 - 1


def decode_spec(warps: int, splits: int, queries: int = 1, page: int | None = PAGE, fp8: bool = False):
    problem = Problem(D, D, DType.BF16, Mask.CAUSAL if queries > 1 else Mask.NONE, queries_per_seq=queries,
                      kv_page_size=page, kv_dtype=DType.E4M3 if fp8 else None)
    return KernelSpec(f"bounds_w{warps}_s{splits}", problem,
                      Schedule(tile_q=16, tile_kv=32 * warps, warps=warps, warp_axis=Axis.KV, stages=1, split_kv=splits))


def prefill_spec():
    from tiledsl.runtime.device import device_arch
    from tiledsl.serving.prefill import prefill_spec as spec
    return spec(device_arch(0), DType.BF16, D, D, Mask.CAUSAL, PAGE)


@functools.lru_cache(maxsize=None)
def kernel_for(spec):
    return tiledsl.compile(spec)


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def paged_case(q_len: int, fp8: bool = False):
    rng = np.random.default_rng()
    need = [-(-n // PAGE) for n in LENS]
    num_pages = sum(need) + 2
    order = rng.permutation(num_pages)
    table = np.full((BATCH, max(need) + 1), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used:used + n]
        used += n
    q = torch.randn(BATCH, q_len, HEADS, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(num_pages, PAGE, KV_HEADS, D, device="cuda").to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
            for _ in range(2))
    return q, k, v, table, np.asarray(LENS, dtype=np.int32)


def run(kernel, q, k, v, table, lens, fp8):
    out = torch.full((q.shape[0], q.shape[1], HEADS, D), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[0], HEADS, q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    scales = {"k_scale": 1.0, "v_scale": 1.0} if fp8 else {}
    with no_host_sync():
        kernel(q, k, v, table, lens, out=out, lse=lse, **scales)
    return out, lse


def bad_inputs(table, lens, what):
    """(table, lens) with sequence BAD's entry broken as `what` says; (tensor, index) the report names."""
    table, lens = table.copy(), lens.copy()
    last = -(-int(lens[BAD]) // PAGE) - 1
    entry = {"first_page": 0, "middle_page": last // 2, "last_page": last}
    if what in entry:
        table[BAD, entry[what]] = -5 if what == "middle_page" else HUGE if what == "last_page" else table.max() + 1
        return table, lens, f"block_table[{BAD}, {entry[what]}]"
    lens[BAD] = {"len_over_table": table.shape[1] * PAGE + 1, "len_negative": -1, "len_huge": HUGE}[what]
    return table, lens, f"kv_lens[{BAD}]"


BAD_CASES = ("first_page", "middle_page", "last_page", "len_over_table", "len_negative", "len_huge")
PAGED_KERNELS = {
    "decode_w4_split5": (lambda: decode_spec(4, 5), 1, False),
    "decode_w2_nosplit": (lambda: decode_spec(2, 1), 1, False),
    "decode_w4_q4_split3": (lambda: decode_spec(4, 3, queries=4), 4, False),
    "decode_fp8_split5": (lambda: decode_spec(4, 5, fp8=True), 1, True),
    "prefill": (prefill_spec, 40, False),
}


def clear_reports():
    torch.cuda.synchronize()
    with contextlib.suppress(RuntimeInputError):
        tiledsl.check_errors()


@pytest.mark.parametrize("what", BAD_CASES)
@pytest.mark.parametrize("name", PAGED_KERNELS)
def test_paged_bad_entry_poisons_only_its_sequence(name, what):
    from tiledsl.reference.serving import paged_attention as reference
    make_spec, q_len, fp8 = PAGED_KERNELS[name]
    spec = make_spec()
    kernel = kernel_for(spec)
    q, k, v, table, lens = paged_case(q_len, fp8)
    clear_reports()
    dev = lambda a: torch.tensor(a, device="cuda")   # noqa: E731
    clean_o, clean_lse = run(kernel, q, k, v, dev(table), dev(lens), fp8)
    torch.cuda.synchronize()
    tiledsl.check_errors()   # nothing reported for good indices
    kf, vf = k.float().cpu().numpy(), v.float().cpu().numpy()
    ref_o, _ = reference(q.float().cpu().numpy(), kf, vf, table, lens, spec.problem.mask)
    good = [b for b in range(BATCH) if b != BAD]
    err = np.linalg.norm(clean_o.double().cpu().numpy()[good] - ref_o[good]) / np.linalg.norm(ref_o[good])
    assert err < TOLERANCE_O

    bad_table, bad_lens, named = bad_inputs(table, lens, what)
    o, lse = run(kernel, q, k, v, dev(bad_table), dev(bad_lens), fp8)
    torch.cuda.synchronize()
    assert torch.isnan(o[BAD].float()).all() and torch.isnan(lse[BAD]).all()
    assert torch.equal(o[good], clean_o[good]) and torch.equal(lse[good], clean_lse[good])   # bit for bit
    with pytest.raises(RuntimeInputError, match=named.replace("[", r"\[").replace("]", r"\]")):
        tiledsl.check_errors()
    tiledsl.check_errors()   # raised once, then cleared

    run(kernel, q, k, v, dev(bad_table), dev(bad_lens), fp8)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeInputError, match=named.split("[")[0]):   # the next call raises the report
        run(kernel, q, k, v, dev(table), dev(lens), fp8)
    clear_reports()


@pytest.mark.parametrize("value", [-1, 1001, HUGE])
@pytest.mark.parametrize("splits", [1, 5])
def test_contiguous_kv_lens_bounded(splits, value):
    from tests import attention_reference as ref
    kernel = kernel_for(decode_spec(4, splits, page=None))
    q = torch.randn(BATCH, HEADS, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(BATCH, KV_HEADS, 1000, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([1000, 500, 321], device="cuda", dtype=torch.int32)
    clear_reports()
    with no_host_sync():
        clean_o, clean_lse = kernel(q, k, v, lens)
    bad = lens.clone()
    bad[BAD] = value
    with no_host_sync():
        o, lse = kernel(q, k, v, bad)
    torch.cuda.synchronize()
    good = [b for b in range(BATCH) if b != BAD]
    assert torch.isnan(o[BAD].float()).all() and torch.isnan(lse[BAD]).all()
    assert torch.equal(o[good], clean_o[good]) and torch.equal(lse[good], clean_lse[good])
    for b in good:
        n = int(lens[b])
        group = HEADS // KV_HEADS
        kk, vv = (x[b:b + 1, :, :n].repeat_interleave(group, 1).double() for x in (k, v))
        ref_o, _ = ref.attention(q[b:b + 1].double(), kk, vv)
        assert float(torch.linalg.norm(o[b:b + 1].double() - ref_o) / torch.linalg.norm(ref_o)) < TOLERANCE_O
    with pytest.raises(RuntimeInputError, match=rf"kv_lens\[{BAD}\] = {value}"):
        tiledsl.check_errors()


def test_validate_true_keeps_the_host_check():
    kernel = kernel_for(decode_spec(4, 5))
    q, k, v, table, lens = paged_case(1)
    bad_table, bad_lens, named = bad_inputs(table, lens, "middle_page")
    dev = lambda a: torch.tensor(a, device="cuda")   # noqa: E731
    with pytest.raises(RuntimeInputError, match=r"block_table\[1, "):
        kernel(q, k, v, dev(bad_table), dev(bad_lens), validate=True)


SANITIZED = r"""
import torch, tiledsl
from tiledsl.errors import RuntimeInputError
pages, page = 5, 16
q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(pages, page, 2, 64, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for table, lens in (([[0, 1], [4, 2**31 - 1]], [20, 30]), ([[0, 1], [-7, 3]], [20, 5]), ([[0, 1], [2, 3]], [20, 33])):
    out = tiledsl.paged_attention(q, k, v, torch.tensor(table, device="cuda", dtype=torch.int32),
                                  torch.tensor(lens, device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    try:
        tiledsl.check_errors()
        raise SystemExit("no report")
    except RuntimeInputError as e:
        print("reported:", e)
    assert torch.isnan(out[1].float()).all() and torch.isfinite(out[0].float()).all()
print("ran")
"""


def test_memcheck_bad_entries_read_nothing(tmp_path):
    script = tmp_path / "bounds_memcheck.py"
    script.write_text(SANITIZED)
    memcheck(script)
