"""The float64 reference executes each schedule exactly: agreement with textbook attention to
1e-12 for every tiling, ragged lengths, masks, fully masked rows, GQA, per-sequence lengths and
split-KV. Inputs are fresh random numbers on every run, so these tests can fail."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tiledsl.reference import forward as reference
from tiledsl.reference.forward import merge_partials, naive_attention, reference_attention
from tiledsl.spec import AUTO, Axis, CopyVia, KernelSpec, LoopOrder, Mask, Problem, Schedule

rng = np.random.default_rng()
TOL = 1e-12


def assert_exact(got, want):
    """O normwise to 1e-12 of its size; LSE -inf exactly where expected, else to 1e-12 relative."""
    (o, lse), (o_ref, lse_ref) = got, want
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    scale = max(1.0, np.abs(o_ref).max(initial=0.0))
    assert np.abs(o - o_ref).max(initial=0.0) <= TOL * scale
    assert (np.isneginf(lse) == np.isneginf(lse_ref)).all()
    finite = np.isfinite(lse_ref)
    assert np.isfinite(lse[finite]).all()
    err = np.abs(lse[finite] - lse_ref[finite]) / np.maximum(1.0, np.abs(lse_ref[finite]))
    assert err.max(initial=0.0) <= TOL
    assert (o[np.isneginf(lse_ref)] == 0).all()


def problem(mask=Mask.NONE, d=8, dv=8, left=0, right=0, **kw):
    return Problem(d, dv, mask=mask, window_left=left, window_right=right, **kw)


def fa1(p, **kw):
    return KernelSpec("fa1", p, Schedule(order=LoopOrder.KV_OUTER, **kw))


def fa2(p, **kw):
    return KernelSpec("fa2", p, Schedule(**kw))


def hopper(p):
    return KernelSpec("fa3", p, Schedule(tile_q=128, tile_kv=128, producer_warpgroups=1, consumer_warpgroups=2,
                                         copy=CopyVia.TMA))


def decode(p, split=AUTO):
    return KernelSpec("dec", p, Schedule(tile_q=16, tile_kv=32, warps=4, warp_axis=Axis.KV, split_kv=split))


def inputs(b, h, hkv, nq, nk, d=8, dv=8, spread=1.0):
    return (rng.normal(size=(b, h, nq, d)) * spread, rng.normal(size=(b, hkv, nk, d)) * spread,
            rng.normal(size=(b, hkv, nk, dv)))


def naive_for(spec, q, k, v, kv_lens=None):
    p = spec.problem
    return naive_attention(q, k, v, p.mask, p.window_left, p.window_right, p.scale, kv_lens=kv_lens)


def textbook(q, k, v, visible, scale):
    """Attention straight from the definition, one row at a time, with an explicit visibility
    predicate visible(b, i, j): the check on naive_attention itself."""
    B, H, nq, _ = q.shape
    group = H // k.shape[1]
    o, lse = np.zeros((B, H, nq, v.shape[3])), np.full((B, H, nq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                keys = [j for j in range(k.shape[2]) if visible(b, i, j)]
                if not keys:
                    continue
                s = np.array([q[b, h, i] @ k[b, h // group, j] * scale for j in keys])
                w = np.exp(s - s.max())
                o[b, h, i] = (w[:, None] * v[b, h // group, keys]).sum(0) / w.sum()
                lse[b, h, i] = s.max() + math.log(w.sum())
    return o, lse


@pytest.mark.parametrize("mask, left, right", [(Mask.NONE, 0, 0), (Mask.CAUSAL, 0, 0), (Mask.WINDOW, 3, 1),
                                               (Mask.WINDOW, 0, 0)])
@pytest.mark.parametrize("nq, nk", [(7, 11), (11, 7), (1, 5), (9, 9)])
def test_naive_matches_the_definition(mask, left, right, nq, nk, monkeypatch):
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 20)      # force several query chunks
    q, k, v = inputs(2, 4, 2, nq, nk)
    lens = rng.integers(0, nk + 1, size=2)

    def visible(b, i, j):
        off = lens[b] - nq
        ok = j < lens[b]
        if mask is Mask.CAUSAL:
            ok &= j <= i + off
        if mask is Mask.WINDOW:
            ok &= i + off - left <= j <= i + off + right
        return ok

    scale = rng.uniform(0.1, 1.0)
    assert_exact(naive_attention(q, k, v, mask, left, right, scale, kv_lens=lens), textbook(q, k, v, visible, scale))


@pytest.mark.parametrize("build", [fa1, fa2], ids=["fa1", "fa2"])
@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL])
def test_every_tile_size_from_one_key_to_the_whole_sequence(build, mask):
    n = 19
    q, k, v = inputs(1, 2, 1, n, n)
    want = naive_for(fa2(problem(mask)), q, k, v)
    for tile in range(1, n + 1):
        other = int(rng.integers(1, n + 1))
        assert_exact(reference_attention(build(problem(mask)), q, k, v, tile_q=other, tile_kv=tile), want)
        assert_exact(reference_attention(build(problem(mask)), q, k, v, tile_q=tile, tile_kv=other), want)
    assert_exact(reference_attention(build(problem(mask)), q, k, v, tile_q=n + 5, tile_kv=n + 5), want)


SCHEDULES = {
    "fa1": lambda p: fa1(p, tile_q=16, tile_kv=16),
    "fa1_splitk": lambda p: fa1(p, tile_q=16, tile_kv=16, warps=4, warp_axis=Axis.KV),
    "fa2": lambda p: fa2(p, tile_q=16, tile_kv=16),
    "hopper": hopper,
    "decode_auto": decode,
    "decode_3": lambda p: decode(p, 3),
    "decode_nosplit": lambda p: decode(p, 1),
}
MASKS = [(Mask.NONE, 0, 0), (Mask.CAUSAL, 0, 0), (Mask.WINDOW, 4, 2), (Mask.WINDOW, 0, 0)]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("mask, left, right", MASKS)
@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 17), (17, 1), (17, 17), (17, 40), (40, 17), (33, 65)])
def test_ragged_lengths_masks_and_fully_masked_rows(name, mask, left, right, nq, nk):
    p = problem(mask, left=left, right=right)
    spec = SCHEDULES[name](p)
    q, k, v = inputs(2, 2, 2, nq, nk)
    tq, tk = (int(x) for x in rng.integers(1, 9, size=2))
    assert_exact(reference_attention(spec, q, k, v, tile_q=tq, tile_kv=tk), naive_for(spec, q, k, v))


@pytest.mark.parametrize("name", SCHEDULES)
def test_gqa_and_per_sequence_lengths(name):
    spec = SCHEDULES[name](problem(Mask.CAUSAL, d=16, dv=8))
    lens = rng.integers(0, 30, size=3)
    lens[0] = 0                                              # one sequence with no keys at all
    q, k, v = inputs(3, 6, 2, 13, 29, d=16, dv=8)
    got = reference_attention(spec, q, k, v, kv_lens=lens, tile_q=int(rng.integers(1, 8)), tile_kv=5)
    want = naive_for(spec, q, k, v, kv_lens=lens)
    assert_exact(got, want)
    assert np.isneginf(got[1][0]).all() and (got[0][0] == 0).all()


def test_fully_masked_rows_give_zero_and_minus_infinity():
    # causal with more queries than keys: the first nq - nk rows see nothing
    for build in (fa1, fa2):
        spec = build(problem(Mask.CAUSAL), tile_q=4, tile_kv=3)
        q, k, v = inputs(1, 1, 1, 12, 5)
        o, lse = reference_attention(spec, q, k, v)
        assert np.isneginf(lse[0, 0, :7]).all() and (o[0, 0, :7] == 0).all() and np.isfinite(lse[0, 0, 7:]).all()
        assert_exact((o, lse), naive_for(spec, q, k, v))


def test_large_scores_do_not_overflow():
    spec = fa2(problem(Mask.WINDOW, left=2, right=2), tile_q=3, tile_kv=4)
    q, k, v = inputs(1, 2, 2, 20, 20, spread=30.0)           # scores of several hundred
    got = reference_attention(spec, q, k, v)
    assert np.isfinite(got[0]).all()
    assert_exact(got, naive_for(spec, q, k, v))


@pytest.mark.parametrize("splits", [1, 7, 999, 1000, 1001, 1500] + [int(x) for x in rng.integers(2, 1500, size=3)])
def test_split_kv_up_to_1500_splits_over_1000_keys(splits):
    spec = decode(problem(Mask.CAUSAL, queries_per_seq=2))
    q, k, v = inputs(1, 2, 1, 2, 1000)
    got = reference_attention(spec, q, k, v, split_kv=splits, tile_kv=1)   # one key per tile
    assert_exact(got, naive_for(spec, q, k, v))


def test_split_kv_with_wider_tiles_and_empty_splits():
    spec = decode(problem(queries_per_seq=3))
    q, k, v = inputs(2, 4, 2, 3, 100)
    lens = np.array([100, 37])
    for splits in (1, 2, 3, 4, 5, 8):                        # tile 25: 4 tiles, so 5 and 8 leave splits empty
        assert_exact(reference_attention(spec, q, k, v, kv_lens=lens, split_kv=splits, tile_kv=25),
                     naive_for(spec, q, k, v, kv_lens=lens))


def test_worked_example_online_softmax_in_two_blocks():
    """Scores ln 2, ln 1, ln 8, ln 4 (head dim 1: q = 1, k = the scores, scale 1), values 1..4,
    two blocks of two keys: O = 44/15, LSE = ln 15."""
    p = Problem(1, 1, softmax_scale=1.0)
    q = np.ones((1, 1, 1, 1))
    k = np.log([2.0, 1.0, 8.0, 4.0]).reshape(1, 1, 4, 1)
    v = np.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 4, 1)
    for spec in (fa1(p, tile_q=1, tile_kv=2), fa2(p, tile_q=1, tile_kv=2)):
        o, lse = reference_attention(spec, q, k, v)
        assert abs(o.item() - 44 / 15) <= TOL and abs(lse.item() - math.log(15)) <= TOL
    o, lse = reference_attention(decode(Problem(1, 1, softmax_scale=1.0, queries_per_seq=1)), q, k, v,
                                 split_kv=2, tile_kv=2)
    assert abs(o.item() - 44 / 15) <= TOL and abs(lse.item() - math.log(15)) <= TOL


def test_merge_of_two_partials():
    o, lse = merge_partials(np.array([[4 / 3], [10 / 3]]), np.log([3.0, 12.0]))
    assert abs(o.item() - 44 / 15) <= TOL and abs(lse.item() - math.log(15)) <= TOL
    # a -inf partial weighs nothing; all -inf gives (0, -inf) without NaN
    o, lse = merge_partials(np.array([[5.0], [0.0]]), np.array([math.log(3.0), -np.inf]))
    assert o.item() == 5.0 and abs(lse.item() - math.log(3.0)) <= TOL
    o, lse = merge_partials(np.zeros((3, 1)), np.full(3, -np.inf))
    assert o.item() == 0 and np.isneginf(lse.item())


def test_bad_inputs_are_refused():
    spec = fa2(problem())
    q, k, v = inputs(1, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        reference_attention(spec, q, k, v)
    q, k, v = inputs(1, 2, 1, 4, 4, d=16)
    with pytest.raises(ValueError, match="head dims"):
        reference_attention(spec, q, k, v)
    q, k, v = inputs(1, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="kv_lens"):
        reference_attention(spec, q, k, v, kv_lens=[5])


def test_naive_handles_the_gpu_test_size_in_chunks():
    """One (batch, kv head) slice of the 4 x 8 x 4096^2 case runs in bounded memory."""
    q, k, v = inputs(1, 2, 1, 1024, 1024, d=64, dv=64)
    o, lse = naive_attention(q, k, v, Mask.CAUSAL)
    o2, lse2 = reference_attention(fa2(problem(Mask.CAUSAL, d=64, dv=64)), q, k, v, tile_q=256, tile_kv=256)
    assert_exact((o2, lse2), (o, lse))
