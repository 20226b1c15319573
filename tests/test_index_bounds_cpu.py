"""The Python side of device-bounded index tensors (no GPU): which kernels bound them (their parameter
list), which calls then skip the host check, the error word's reading (a report still being written
is not read), and the template's codes matching the host's."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from tiledsl.cli.common import concrete_specs
from tiledsl.errors import SpecError
from tiledsl.families import WITH_TEMPLATE, lower
from tiledsl.lower.plan import bounds_indices
from tiledsl.runtime import device_errors
from tiledsl.runtime.index_checks import host_validation
from tiledsl.serving.paged import paged_spec
from tiledsl.spec import DType, Mask

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "templates" / "index_bounds.cuh"


def test_decode_and_fa2_bound_their_indices_and_skip_the_host_check():
    plan = lower(paged_spec(DType.BF16, 128, 128, Mask.NONE, 16, 1))
    names = [p.name for line in plan.parameters for p in line]
    assert bounds_indices(plan) and {"index_errors", "table_pages", "num_pages"} <= set(names)
    assert not host_validation(None, bounds_indices(plan))
    assert host_validation(True, True) and not host_validation(False, False)
    assert host_validation(None, False)   # a kernel that does not bound them keeps the host check


def test_every_bundled_forward_kernel_that_reads_kv_lens_bounds_it():
    """Every forward kernel the bundled specs build (fa1, fa2 and fa2 on wgmma, hopper with and without
    score modifications, decode) takes the error word where it takes kv_lens, and varlen where it takes
    cu_seqlens."""
    files = sorted(str(p) for p in (ROOT / "specs").rglob("*.tile"))
    plans = []
    for spec in concrete_specs(files):
        if spec.family in WITH_TEMPLATE:
            try:
                plans.append(lower(spec))
            except SpecError:   # a modification with no template yet
                continue
    readers = [p for p in plans if any(q.name in ("kv_lens", "cu_seqlens_q") for line in p.parameters for q in line)]
    assert {p.family for p in readers} >= {"fa1", "fa2", "hopper", "decode"}
    assert any(q.name == "cu_seqlens_q" for p in readers for line in p.parameters for q in line)
    assert any(p.mma == "wgmma" and p.family == "fa2" for p in readers)
    assert any(getattr(p, "score_mods", False) for p in readers)
    assert [p.kernel_name for p in readers if not bounds_indices(p)] == []
    assert [p.kernel_name for p in plans if p not in readers and bounds_indices(p)] == []


def test_report_being_written_is_not_read_and_a_report_is_read_once(monkeypatch):
    host = np.zeros(device_errors.WORDS, dtype=np.int32)
    monkeypatch.setitem(device_errors._words, 99, (host, host))
    host[:6] = (-1, 1, 2, 3, 4, 5)
    assert device_errors.take(99) is None
    host[0] = 1
    error = device_errors.take(99)
    assert error is not None and "block_table[2, 3] = 4 is out of range: the cache has 5 pages" in str(error)
    assert device_errors.take(99) is None and not host.any()


def test_a_descale_report_shows_the_float_it_read(monkeypatch):
    import struct
    host = np.zeros(device_errors.WORDS, dtype=np.int32)
    monkeypatch.setitem(device_errors._words, 98, (host, host))
    bits = struct.unpack("<i", struct.pack("<f", -0.25))[0]
    host[:6] = (8, 5, 1, 3, bits, 0)
    error = device_errors.take(98)
    assert error is not None and "q_descale entry 3 (flat) = -0.25 is not a finite number >= 0" in str(error)
    assert "the rows that read it are NaN" in str(error) and not host.any()
    host[:6] = (9, 7, 0, 11, 0, 0)
    assert "v_descale entry 11 (flat) = 0: a per-block V descale must be > 0" in str(device_errors.take(98))


def test_template_codes_match_the_host_tables():
    text = HEADER.read_text()
    codes = {int(v): k for k, v in re.findall(r"INDEX_(?!TENSOR_)(\w+) = (\d+)", text)}
    assert codes[1] == "PAGE_OUT_OF_RANGE" and codes[2] == "LEN_OVER_TABLE" and codes[3] == "LEN_NEGATIVE"
    assert codes[4] == "LEN_OVER_K" and codes[5] == "OFFSET_OUT_OF_RANGE" and codes[6] == "OFFSET_DECREASING"
    assert codes[7] == "SEQUENCE_OVER_MAX" and codes[8] == "DESCALE_INVALID" and codes[9] == "DESCALE_ZERO_V_BLOCK"
    assert set(device_errors.CODES) == set(codes)
    tensors = dict(re.findall(r"INDEX_TENSOR_(\w+) = (\d+)", text))
    assert {int(v): k.lower() for k, v in tensors.items()} == device_errors.TENSORS


def test_length_bounds_are_non_negative_ints():
    import pytest
    from tiledsl.errors import RuntimeInputError
    from tiledsl.runtime.arguments import length_bound
    assert length_bound("f", "max_seqlen_q", None) is None
    assert length_bound("f", "max_seqlen_q", np.int64(7)) == 7 and length_bound("f", "max_seqlen_q", 0) == 0
    for bad in (-1, 2.5, True, "8", np.float32(3)):
        with pytest.raises(RuntimeInputError, match=r"f: max_seqlen_q must be a non-negative int, got"):
            length_bound("f", "max_seqlen_q", bad)
