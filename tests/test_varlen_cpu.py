"""Varlen (packed) prefill on the hopper family, without a GPU: the family table picks the varlen
template for `layout = varlen` hopper specs only, the rendering reads packed rows from cu_seqlens,
and the host-built work list orders sequences and tiles by cost."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.errors import SpecError
from tiledsl.families import lower, missing_template
from tiledsl.frontend.parse import load_specs
from tiledsl.codegen.render import render
from tiledsl.runtime.varlen import visible_keys, work_list
from tiledsl.spec import DType, Family, Mask, SeqLayout
from tiledsl.serving.varlen import varlen_spec

SPEC = "specs/hopper_varlen_d128_causal.tile"


def test_varlen_hopper_spec_renders_the_packed_template():
    (spec,) = load_specs(SPEC)
    plan = lower(spec)
    assert plan.template == "hopper_varlen.cu.j2" and missing_template(spec) == ""
    source = render(plan)
    assert "const int q_end = cu_seqlens_q[sequence + 1], k_end = cu_seqlens_k[sequence + 1];" in source
    # bad offsets (or more queries than the work list covers) give the sequence no key and a report
    assert "packed_sequence_bad(q_start, q_end, k_start, k_end, total_q, total_k, max_seqlen_q)" in source
    assert "if (w.bad) report_packed_sequence(" in source and "w.bad ? QUIET_NAN" in source
    assert "q_map, p * 64, w.q_row, w.head, 0," in source and "k_map, p * 64, w.k_row + tile * C::BC, w.kv_head, 0," in source
    # rows stored: the tile's rows of its sequence, none before or past the packed tensor
    assert "lse + (i64)w.head * total_q + w.q_row,\n" in source
    assert "w.q_row < 0 ? 0 : min(w.seq_q - q0, total_q - w.q_row)" in source
    # a tile past its sequence's end (a work list built from max_seqlen_q) loads no keys
    assert "const int tile_stop = q0 < seq_q && !bad ? tile_end : tile_begin;" in source
    assert "w.batch" not in source and "order_groups" not in source.split("extern \"C\"")[1]


def test_batched_hopper_spec_keeps_its_template():
    (spec,) = load_specs(SPEC.replace("_varlen", ""))
    plan = lower(spec)
    source = render(plan)
    assert plan.template == "hopper.cu.j2" and "w.batch" in source
    assert not [p.name for line in plan.parameters for p in line if p.name.startswith("cu_seqlens")]
    assert "cu_seqlens_q[sequence" not in source   # the packed work item's read


def test_varlen_is_refused_by_families_without_a_varlen_template():
    (spec,) = load_specs("specs/fa2_d128.tile")
    import dataclasses
    fa2 = dataclasses.replace(spec, problem=dataclasses.replace(spec.problem, seq_layout=SeqLayout.VARLEN))
    with pytest.raises(SpecError, match="layout = varlen has no CUDA template yet for the fa2 family"):
        lower(fa2)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL])
def test_varlen_spec_is_the_tuned_hopper_schedule(d, mask):
    spec = varlen_spec("sm_90a", DType.BF16, d, mask)
    assert spec.family is Family.HOPPER and spec.problem.seq_layout is SeqLayout.VARLEN
    assert lower(spec).template == "hopper_varlen.cu.j2"
    assert varlen_spec("sm_90a", DType.FP16, 96, mask) is None   # no tuned hopper schedule: refused by the API


def test_work_list_costliest_sequence_first_then_its_tiles():
    q_lens, k_lens = np.array([300, 0, 1000, 5, 129]), np.array([300, 4, 1000, 0, 64])
    causal = work_list(q_lens, k_lens, 128, Mask.CAUSAL).tolist()
    assert causal == [[2, t] for t in range(7, -1, -1)] + [[0, 2], [0, 1], [0, 0], [4, 1], [4, 0], [3, 0]]
    none = work_list(q_lens, k_lens, 128, Mask.NONE).tolist()
    assert [b for b, _ in none] == [2] * 8 + [0] * 3 + [4] * 2 + [3]
    assert work_list(np.array([0, 0]), np.array([3, 0]), 128, Mask.NONE).shape == (0, 2)


def test_visible_keys_matches_the_bottom_right_masks():
    assert visible_keys(0, 128, 300, 1000, Mask.CAUSAL, 0, 0) == 128 + 700
    assert visible_keys(0, 128, 1000, 300, Mask.CAUSAL, 0, 0) == 0   # rows 0..127 sit before key 0's diagonal
    assert visible_keys(256, 128, 300, 300, Mask.WINDOW, 100, 20) == 300 - 156
    assert visible_keys(0, 128, 5, 0, Mask.NONE, 0, 0) == 0


def test_the_work_list_without_lengths_covers_every_tile_the_longest_first():
    from tiledsl.runtime.varlen import bounded_work_list
    pairs = bounded_work_list(3, 4)
    assert pairs.dtype == np.int32 and pairs.shape == (12, 2)
    assert sorted(map(tuple, pairs.tolist())) == [(b, t) for b in range(3) for t in range(4)]
    assert list(pairs[:, 1]) == sorted(pairs[:, 1], reverse=True)   # later (under causal: costlier) tiles first
    assert bounded_work_list(5, 0).shape == (0, 2)
