"""Index tensors bounded on the device (templates/index_bounds.cuh): a bad block-table entry or kv_len
makes only its sequence's rows NaN, reads nothing through it, and is reported through the error word
(tiledsl.check_errors(), and the next call of a bounded kernel); the other sequences of the batch are
bit-identical to an all-good batch and match the float64 reference. Paged: decode (both warp forms,
split-KV, 4 queries, FP8 K/V) and the chunked prefill; contiguous kv_lens: decode, fa2 (mma.sync and
wgmma), fa1 and hopper (static, persistent and dynamic launches, score modifications), and the
tuned `tiledsl.attention` path. The unchecked calls run with torch's sync debug mode set to "error";
decode, the paged prefill and the hopper prefill with bad entries run under compute-sanitizer.

    python -m pytest -m gpu tests/test_gpu_device_bounds.py
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.mods.model import AUX_ALIBI, AUX_SINKS, AlibiSlopes, Modifications
from tiledsl.spec import (
    Axis,
    CopyVia,
    DType,
    Family,
    KernelSpec,
    LaunchKind,
    Mask,
    Mma,
    Problem,
    Schedule,
)

from .gpu_support import TOLERANCE_O, memcheck, no_host_sync, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
torch = pytest.importorskip("torch")

import tiledsl

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
    return spec(device_arch(), DType.BF16, D, D, Mask.CAUSAL, PAGE)


@functools.cache
def kernel_for(spec):
    return tiledsl.compile(spec)


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
    dev = lambda a: torch.tensor(a, device="cuda")
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


ROOT = Path(__file__).resolve().parent.parent
PREFILL_Q, PREFILL_KV, PREFILL_LENS = 200, 300, (300, 123, 77)   # sequence BAD's entry is replaced


def bundled(name: str, pick=lambda spec: True) -> KernelSpec:
    from tiledsl.cli.common import concrete_specs
    return next(s for s in concrete_specs([str(ROOT / "specs" / name)]) if pick(s))


def hopper_spec(mask: Mask, mods: Modifications | None = None, launch: LaunchKind | None = None) -> KernelSpec:
    schedule = Schedule(tile_q=128, tile_kv=128, stages=2, copy=CopyVia.TMA, mma=Mma.WGMMA, producer_warpgroups=1,
                        producer_regs=24, consumer_warpgroups=2, consumer_regs=240, intra_overlap=True, launch=launch)
    return KernelSpec(f"bounds_hopper_{mask.value}_{launch.value if launch else 'rule'}{'_mods' if mods else ''}",
                      Problem(D, D, DType.BF16, mask, mods=mods or Modifications()), schedule)


CONTIGUOUS_KERNELS = {
    "hopper_causal": lambda: hopper_spec(Mask.CAUSAL),
    "hopper_none_persistent": lambda: hopper_spec(Mask.NONE, launch=LaunchKind.PERSISTENT),
    "hopper_dynamic": lambda: hopper_spec(Mask.CAUSAL, launch=LaunchKind.DYNAMIC),
    "hopper_softcap_alibi_sinks": lambda: hopper_spec(
        Mask.CAUSAL, Modifications(softcap=20.0, alibi=AlibiSlopes.GIVEN, sinks=True)),
    "fa2_wgmma": lambda: bundled("fa2_wgmma_d64_causal.tile"),
    "fa2_mma_sync": lambda: bundled("fa2_d64_causal.tile"),
    "fa1_split_q": lambda: bundled("fa1_d64.tile", lambda s: s.schedule.warp_axis is Axis.Q),
    "fa1_split_kv": lambda: bundled("fa1_d64.tile", lambda s: s.schedule.warp_axis is Axis.KV),
}


def prefill_aux(mods: Modifications) -> dict:
    aux = {}
    if mods.alibi is AlibiSlopes.GIVEN:
        aux[AUX_ALIBI] = torch.rand(HEADS, device="cuda", dtype=torch.float32) * 0.5
    if mods.sinks:
        aux[AUX_SINKS] = torch.randn(HEADS, device="cuda", dtype=torch.float32) * 2
    return aux


@pytest.mark.parametrize("value", [-1, PREFILL_KV + 1, HUGE])
@pytest.mark.parametrize("name", CONTIGUOUS_KERNELS)
def test_contiguous_prefill_kv_lens_bounded(name, value):
    from tiledsl.reference.forward import reference_attention
    spec = CONTIGUOUS_KERNELS[name]()
    kernel, d, mods = kernel_for(spec), spec.problem.head_dim_qk, spec.problem.mods
    q = torch.randn(BATCH, HEADS, PREFILL_Q, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, KV_HEADS, PREFILL_KV, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    aux = prefill_aux(mods)
    options = {"aux": aux} if spec.family is Family.HOPPER else {}
    lens = torch.tensor(PREFILL_LENS, device="cuda", dtype=torch.int32)
    clear_reports()
    with no_host_sync():
        clean_o, clean_lse = kernel(q, k, v, lens, **options)
    torch.cuda.synchronize()
    tiledsl.check_errors()   # nothing reported for good lengths
    bad = lens.clone()
    bad[BAD] = value
    with no_host_sync():
        o, lse = kernel(q, k, v, bad, **options)
    torch.cuda.synchronize()
    good = [b for b in range(BATCH) if b != BAD]
    assert torch.isnan(o[BAD].float()).all() and torch.isnan(lse[BAD]).all()
    assert torch.equal(o[good], clean_o[good]) and torch.equal(lse[good], clean_lse[good])   # bit for bit
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    ref_o, ref_lse = reference_attention(spec, q64, k64, v64, np.array(PREFILL_LENS),
                                         aux={n: t.cpu().numpy() for n, t in aux.items()})
    got_o, got_lse = o.double().cpu().numpy()[good], lse.double().cpu().numpy()[good]
    assert np.linalg.norm(got_o - ref_o[good]) / np.linalg.norm(ref_o[good]) < TOLERANCE_O
    seen = np.isfinite(ref_lse[good])
    assert np.array_equal(seen, np.isfinite(got_lse)) and np.abs(got_lse[seen] - ref_lse[good][seen]).max() < 1e-3
    with pytest.raises(RuntimeInputError, match=rf"kv_lens\[{BAD}\] = {value}"):
        tiledsl.check_errors()
    with no_host_sync():
        kernel(q, k, v, bad, **options)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeInputError, match=r"kv_lens"):   # the next call raises the report
        kernel(q, k, v, lens, **options)
    clear_reports()


@pytest.mark.parametrize("causal", [False, True])
def test_attention_api_bounds_kv_lens_without_a_sync(causal):
    """The tuned path (hopper at d128 on Hopper) called as a person calls it: no validate=, no sync."""
    q = torch.randn(BATCH, HEADS, PREFILL_Q, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, KV_HEADS, PREFILL_KV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor(PREFILL_LENS, device="cuda", dtype=torch.int32)
    clear_reports()
    tiledsl.attention(q, k, v, causal=causal, kv_lens=lens)   # compiles (off the no-sync region)
    with no_host_sync():
        clean = tiledsl.attention(q, k, v, causal=causal, kv_lens=lens)
    bad = lens.clone()
    bad[BAD] = -3
    with no_host_sync():
        o = tiledsl.attention(q, k, v, causal=causal, kv_lens=bad)
    torch.cuda.synchronize()
    good = [b for b in range(BATCH) if b != BAD]
    assert torch.isnan(o[BAD].float()).all() and torch.equal(o[good], clean[good])
    with pytest.raises(RuntimeInputError, match=rf"kv_lens\[{BAD}\] = -3 is negative"):
        tiledsl.check_errors()


def test_validate_true_keeps_the_host_check():
    kernel = kernel_for(decode_spec(4, 5))
    q, k, v, table, lens = paged_case(1)
    bad_table, bad_lens, _ = bad_inputs(table, lens, "middle_page")
    dev = lambda a: torch.tensor(a, device="cuda")
    with pytest.raises(RuntimeInputError, match=r"block_table\[1, "):
        kernel(q, k, v, dev(bad_table), dev(bad_lens), validate=True)


SANITIZED = r"""
import torch, tiledsl
from tiledsl.errors import RuntimeInputError
pages, page = 5, 16
k = torch.randn(pages, page, 2, 64, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
def expect_report(out):
    torch.cuda.synchronize()
    try:
        tiledsl.check_errors()
        raise SystemExit("no report")
    except RuntimeInputError as e:
        print("reported:", e)
    assert torch.isnan(out[1].float()).all() and torch.isfinite(out[0].float()).all()
bad = (([[0, 1], [4, 2**31 - 1]], [20, 30]), ([[0, 1], [-7, 3]], [20, 5]), ([[0, 1], [2, 3]], [20, 33]))
for queries in (1, 24):   # decode, then the chunked prefill (fa2 paged)
    qp = torch.randn(2, queries, 4, 64, device="cuda", dtype=torch.bfloat16)
    for table, lens in bad:
        expect_report(tiledsl.paged_attention(qp, k, v, torch.tensor(table, device="cuda", dtype=torch.int32),
                                              torch.tensor(lens, device="cuda", dtype=torch.int32),
                                              causal=queries > 1))
qc = torch.randn(2, 4, 150, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(2, 2, 160, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for lens in ([160, 2**31 - 1], [160, -1], [160, 161]):   # the tuned prefill (hopper) over contiguous K/V
    expect_report(tiledsl.attention(qc, kc, vc, causal=True, kv_lens=torch.tensor(lens, device="cuda",
                                                                                   dtype=torch.int32)))
print("ran")
"""


def test_memcheck_bad_entries_read_nothing(tmp_path):
    script = tmp_path / "bounds_memcheck.py"
    script.write_text(SANITIZED)
    memcheck(script)
