"""The HBM traffic model, counted from the graph, against closed forms; FLOPs; split heuristic."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tiledsl.schedule.passes import run_passes
from tiledsl.schedule.masks import key_bounds
from tiledsl.spec import AUTO, Axis, DType, KernelSpec, LoopOrder, Mask, Problem, Schedule
from tiledsl.schedule.splits import choose_splits, split_ranges
from tiledsl.schedule.traffic import hbm_traffic, standard_elements, visible_pairs

rng = np.random.default_rng()


def graph(order, d, dv, tile_q, tile_kv, mask=Mask.NONE, **kw):
    spec = KernelSpec("t", Problem(d, dv, mask=mask, **kw), Schedule(order=order, tile_q=tile_q, tile_kv=tile_kv))
    return run_passes(spec, check_legality=False)


def fa1_closed(n, d, bc):
    """Per head, N = Nq = Nk: Q read, O/m/l read and written once per kv step; K, V read once."""
    return 2 * n * d + math.ceil(n / bc) * (3 * n * d + 4 * n)


def fa2_closed(n, d, br):
    """Per head: Q read and O written once, K and V read once per q tile, plus N for the LSE."""
    return 2 * n * d + 2 * n * n * d // br + n


CASES = [(1024, 64, 64), (1024, 64, 128), (2048, 128, 64), (4096, 128, 128), (512, 32, 16)]


@pytest.mark.parametrize("n, d, tile", CASES + [tuple(int(x) for x in (rng.integers(1, 64) * 64, 64, 64))])
def test_closed_forms_square_no_mask(n, d, tile):
    other = int(rng.choice([16, 32, 64, 128]))
    fa1 = hbm_traffic(graph(LoopOrder.KV_OUTER, d, d, other, tile), 1, 1, n, n)
    fa2 = hbm_traffic(graph(LoopOrder.Q_OUTER, d, d, tile, other), 1, 1, n, n)
    assert fa1.elements == fa1_closed(n, d, tile)
    assert fa2.elements == fa2_closed(n, d, tile)
    assert fa1.standard_elements == fa2.standard_elements == 4 * n * n + 4 * n * d
    assert fa1.flops == fa2.flops == fa1.flops_executed == 4 * n * n * d


@pytest.mark.parametrize("trial", range(6))
def test_closed_forms_ragged_and_rectangular(trial):
    """Exact forms for any Nq, Nk, tiles: tiles need not divide the lengths (ragged last tile)."""
    nq, nk = (int(x) for x in rng.integers(1, 3000, size=2))
    br, bc = (int(x) for x in rng.integers(1, 200, size=2))
    d, dv = (int(x) for x in rng.choice([16, 64, 128, 256], size=2))
    b, h = (int(x) for x in rng.integers(1, 5, size=2))
    fa1 = hbm_traffic(graph(LoopOrder.KV_OUTER, d, dv, br, bc), b, h, nq, nk)
    fa2 = hbm_traffic(graph(LoopOrder.Q_OUTER, d, dv, br, bc), b, h, nq, nk)
    assert fa1.elements == b * h * (nk * (d + dv) + math.ceil(nk / bc) * nq * (d + 2 * dv + 4))
    assert fa2.elements == b * h * (nq * (d + dv + 1) + math.ceil(nq / br) * nk * (d + dv))
    assert fa2.standard_elements == b * h * standard_elements(nq, nk, d, dv)


def test_bytes_use_the_dtype_for_tensors_and_fp32_for_state():
    t = hbm_traffic(graph(LoopOrder.KV_OUTER, 64, 64, 64, 64, dtype=DType.FP16), 2, 3, 256, 256)
    sizes = {o.tensor: o.bytes // o.elements for o in t.ops}
    assert sizes == {"Q": 2, "K": 2, "V": 2, "O_state": 4, "m": 4, "l": 4}
    assert t.bytes == sum(o.bytes for o in t.ops) and t.standard_bytes == 2 * t.standard_elements
    assert t.ratio == t.standard_bytes / t.bytes


def test_split_kv_decode_closed_form():
    spec = KernelSpec("d", Problem(128, 128, queries_per_seq=4), Schedule(tile_q=16, tile_kv=64,
                                                                          warp_axis=Axis.KV, split_kv=AUTO))
    g = run_passes(spec)
    for b, h, nk in ((1, 8, 8192), (4, 32, 1000), (64, 32, 4096)):
        t = hbm_traffic(g, b, h, 4, nk)
        s, nq, d = t.splits, 4, 128
        assert (s, t.split_reason) == choose_splits(b, h, nk, 64, 132)
        assert t.elements == b * h * (s * nq * d + nk * 2 * d + 2 * s * nq * (d + 1) + nq * (d + 1))


def test_causal_skips_tiles_and_counts_visible_pairs_exactly():
    n, d, t = 1024, 64, 64
    full = hbm_traffic(graph(LoopOrder.Q_OUTER, d, d, t, t), 1, 1, n, n)
    causal = hbm_traffic(graph(LoopOrder.Q_OUTER, d, d, t, t, Mask.CAUSAL), 1, 1, n, n)
    tiles = n // t
    assert causal.flops == 4 * d * n * (n + 1) // 2
    assert causal.flops_executed == 4 * d * t * t * tiles * (tiles + 1) // 2      # T(T+1)/2 tiles computed
    kv_reads = sum(o.elements for o in causal.ops if o.tensor in ("K", "V"))
    assert kv_reads == 2 * t * d * tiles * (tiles + 1) // 2
    assert causal.bytes < full.bytes


@pytest.mark.parametrize("mask, left, right", [(Mask.CAUSAL, 0, 0), (Mask.WINDOW, 5, 3), (Mask.WINDOW, 0, 0),
                                               (Mask.NONE, 0, 0)])
def test_visible_pairs_brute_force(mask, left, right):
    for nq, nk in ((13, 7), (7, 13), (1, 50), (40, 40)):
        lo, hi = key_bounds(np.arange(nq), nq, nk, mask, left, right)
        brute = sum(1 for i in range(nq) for j in range(nk)
                    if (mask is not Mask.CAUSAL or j <= i + nk - nq)
                    and (mask is not Mask.WINDOW or i + nk - nq - left <= j <= i + nk - nq + right))
        assert visible_pairs(nq, nk, mask, left, right) == brute == int((hi - lo).sum())


def test_choose_splits():
    assert choose_splits(64, 32, 8192, 64, 132)[0] == 1                 # 2048 blocks fill the GPU
    s, why = choose_splits(1, 8, 65536, 64, 132)
    assert s == 132 // 8 and "one wave" in why                            # one wave of resident blocks
    assert choose_splits(1, 32, 32768, 64, 132, blocks_per_sm=2)[0] == 8  # 256 of 264 slots
    assert choose_splits(1, 1, 100, 64, 132)[0] == 2                      # capped at the kv tiles
    assert choose_splits(1, 1, 0, 64, 132)[0] == 1
    for _ in range(50):
        b, h, n, t = (int(x) for x in (rng.integers(1, 64), rng.integers(1, 64), rng.integers(1, 100000),
                                       rng.choice([16, 64, 128])))
        s, _ = choose_splits(b, h, n, t, 132)
        assert 1 <= s <= max(1, math.ceil(n / t))
        if b * h >= 132:
            assert s == 1


def test_split_ranges_partition_the_tiles():
    for tiles, splits in ((10, 3), (1000, 1500), (0, 4), (7, 7), (5, 1)):
        ranges = split_ranges(tiles, splits)
        assert len(ranges) == splits
        assert [t for a, b in ranges for t in range(a, b)] == list(range(tiles))
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1
