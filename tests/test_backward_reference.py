"""The backward graph executed in float64 gives the analytic gradients of attention to 1e-12, for
every backward schedule (both loop orders, every dq accumulation, tiles from 1 key to the whole
sequence), ragged lengths, q_len != kv_len, masks, GQA and kv_lens incl. 0. Inputs are fresh random
numbers on every run, so these tests can fail."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tiledsl.schedule.backward import build_backward_graph
from tiledsl.schedule.ops import OpKind
from tiledsl.reference.forward import naive_attention
from tiledsl.reference.backward import reference_backward
from tiledsl.spec import BackwardSchedule, DqAccumulate, KernelSpec, LoopOrder, Mask, Problem, Schedule

rng = np.random.default_rng()
TOL = 1e-12
KV_OUTER, Q_OUTER = LoopOrder.KV_OUTER, LoopOrder.Q_OUTER


def visible(mask, nq, kv_len, left, right):
    """(nq, nk) booleans straight from the mask's definition (spec.Mask), for one sequence."""
    i, j = np.arange(nq)[:, None], np.arange(kv_len)[None, :]
    diagonal = i + kv_len - nq
    if mask is Mask.CAUSAL:
        return j <= diagonal
    if mask is Mask.WINDOW:
        return (diagonal - left <= j) & (j <= diagonal + right)
    return np.ones((nq, kv_len), bool)


def analytic_grads(q, k, v, do, mask=Mask.NONE, left=0, right=0, scale=None, kv_lens=None):
    """dQ, dK, dV of sum(O * dO), row by row through the softmax's Jacobian diag(p) - p p^T."""
    B, H, nq, d = q.shape
    group, nk = H // k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        n = nk if kv_lens is None else int(kv_lens[b])
        seen = visible(mask, nq, n, left, right)
        for h in range(H):
            kh = h // group
            K, V = k[b, kh, :n], v[b, kh, :n]
            for i in range(nq):
                keys = np.flatnonzero(seen[i])
                if not len(keys):
                    continue
                s = scale * (K[keys] @ q[b, h, i])
                p = np.exp(s - s.max())
                p /= p.sum()
                dv[b, kh, keys] += np.outer(p, do[b, h, i])
                ds = (np.diag(p) - np.outer(p, p)) @ (V[keys] @ do[b, h, i])
                dq[b, h, i] = scale * ds @ K[keys]
                dk[b, kh, keys] += scale * np.outer(ds, q[b, h, i])
    return dq, dk, dv


def assert_close(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and not np.isnan(g).any()
        assert np.abs(g - w).max(initial=0.0) <= TOL * max(1.0, np.abs(w).max(initial=0.0))


def spec_of(mask=Mask.NONE, left=0, right=0, d=8, dv=8, **backward):
    return KernelSpec("bwd", Problem(d, dv, mask=mask, window_left=left, window_right=right), Schedule(),
                      backward=BackwardSchedule(**backward))


def inputs(b, h, hkv, nq, nk, d=8, dv=8):
    return (rng.normal(size=(b, h, nq, d)), rng.normal(size=(b, hkv, nk, d)), rng.normal(size=(b, hkv, nk, dv)),
            rng.normal(size=(b, h, nq, dv)))


def check(spec, q, k, v, do, kv_lens=None, **kw):
    p = spec.problem
    got = reference_backward(spec, q, k, v, do, kv_lens=kv_lens, **kw)
    want = analytic_grads(q, k, v, do, p.mask, p.window_left, p.window_right, p.scale, kv_lens)
    assert_close(got, want)
    return got


def test_analytic_gradients_match_finite_differences():
    """The test's own closed form, checked once against central differences of sum(O * dO)."""
    q, k, v, do = inputs(1, 2, 1, 3, 4, d=3, dv=2)
    lens = np.array([3])
    grads = analytic_grads(q, k, v, do, Mask.CAUSAL, kv_lens=lens)

    def loss():
        return (naive_attention(q, k, v, Mask.CAUSAL, kv_lens=lens)[0] * do).sum()
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + eps
            up = loss()
            x[idx] = keep - eps
            numeric[idx] = (up - loss()) / (2 * eps)
            x[idx] = keep
        assert np.abs(numeric - g).max() < 1e-8   # the differences' own error, not the reference's


ORDERS = [(KV_OUTER, DqAccumulate.ATOMIC), (KV_OUTER, DqAccumulate.SEPARATE), (KV_OUTER, DqAccumulate.ORDERED),
          (Q_OUTER, DqAccumulate.ATOMIC)]
MASKS = [(Mask.NONE, 0, 0), (Mask.CAUSAL, 0, 0), (Mask.WINDOW, 3, 1)]


@pytest.mark.parametrize("order,dq", ORDERS)
@pytest.mark.parametrize("mask,left,right", MASKS)
@pytest.mark.parametrize("tiles", [(1, 1), (3, 5), (16, 16), (None, None)])
def test_every_schedule_gives_the_gradients(order, dq, mask, left, right, tiles):
    """Ragged tiles, q_len != kv_len, GQA (2 query heads per kv head), kv_lens with a 0."""
    nq, nk = 11, 17
    tq, tkv = (nq, nk) if tiles == (None, None) else tiles   # None: one tile holds the whole sequence
    spec = spec_of(mask, left, right, order=order, dq=dq, tile_q=tq, tile_kv=tkv)
    check(spec, *inputs(3, 4, 2, nq, nk), kv_lens=np.array([17, 0, 6]))


@pytest.mark.parametrize("nq,nk", [(9, 4), (4, 9), (1, 13)])
@pytest.mark.parametrize("order", [KV_OUTER, Q_OUTER])
def test_causal_q_len_not_kv_len(order, nq, nk):
    check(spec_of(Mask.CAUSAL, order=order, tile_q=4, tile_kv=3), *inputs(2, 2, 1, nq, nk))


def test_fully_masked_rows_get_zero_gradients_not_nan():
    """Causal with more queries than keys: the first rows see no key (LSE = -inf)."""
    q, k, v, do = inputs(1, 2, 2, 8, 3)
    for order, dq in ORDERS:
        dQ, dK, dV = check(spec_of(Mask.CAUSAL, order=order, dq=dq, tile_q=4, tile_kv=2), q, k, v, do)
        assert (dQ[:, :, :5] == 0).all() and not np.isnan(dK).any() and not np.isnan(dV).any()
    dQ, dK, dV = check(spec_of(order=KV_OUTER), q, k, v, do, kv_lens=np.array([0]))
    assert not dQ.any() and not dK.any() and not dV.any()


def test_dq_modes_agree_and_ordered_is_deterministic():
    q, k, v, do = inputs(2, 4, 1, 40, 56, d=16, dv=16)
    runs = {mode: [reference_backward(spec_of(Mask.CAUSAL, d=16, dv=16, dq=mode, tile_q=8, tile_kv=8),
                                      q, k, v, do, rng=seed) for seed in (1, 2)] for mode in DqAccumulate}
    first = runs[DqAccumulate.ORDERED][0]
    for mode, results in runs.items():
        for got in results:
            assert_close(got, first)
    for a, b in zip(*runs[DqAccumulate.ORDERED]):
        assert np.array_equal(a, b)   # bit-identical, whatever order the atomics would land in


def test_given_o_and_lse_are_used():
    """The backward recomputes P from the forward's LSE: a wrong LSE must change dQ."""
    spec = spec_of(tile_q=4, tile_kv=4)
    q, k, v, do = inputs(1, 1, 1, 6, 6)
    o, lse = naive_attention(q, k, v)
    good = reference_backward(spec, q, k, v, do, o, lse)
    assert_close(good, analytic_grads(q, k, v, do))
    bad = reference_backward(spec, q, k, v, do, o, lse + 0.5)
    assert np.abs(bad[0] - good[0]).max() > 1e-3


def test_graph_has_the_backward_ops_in_each_order():
    common = {OpKind.ROWSUM_D, OpKind.RECOMPUTE_P, OpKind.MMA_DV, OpKind.MMA_DP, OpKind.SOFTMAX_GRAD,
              OpKind.MMA_DK, OpKind.MMA_DQ, OpKind.MASK}
    for order, dq in ORDERS:
        g = build_backward_graph(spec_of(Mask.CAUSAL, order=order, dq=dq))
        kinds = {g.op(n).kind for n in g.names()}
        assert common <= kinds
        kernels = [g.op(n).kernel for n in g.children(None)]
        assert kernels[:2] == ["preprocess", "backward"]
        outer = g.op(g.children(None)[1]).var
        assert outer == ("kv" if order is KV_OUTER else "q")
        workspace = [a.tensor for n in g.names(OpKind.ACCUMULATE) for a in g.op(n).hbm]
        assert workspace == ([] if dq is DqAccumulate.SEPARATE else ["dQ_accum"] if order is KV_OUTER
                             else ["dK_accum", "dV_accum"])


def test_no_backward_schedule_is_an_error():
    with pytest.raises(ValueError, match="no backward schedule"):
        build_backward_graph(KernelSpec("fwd", Problem(8, 8), Schedule()))


@pytest.mark.parametrize("d,dv", [(40, 40), (24, 8), (8, 72)])
@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL])
def test_zero_padded_head_dims_give_the_unpadded_gradients(d, dv, mask):
    """attention_backward's padding (dispatch/backward.PaddedBackward): q, k, v, dO zero-padded to the next multiple
    of 16, at the unpadded head dim's softmax scale, give the unpadded problem's gradients in their leading columns
    and exact zeros in the padded ones."""
    from tiledsl.layout.backward import BACKWARD_DIM_MULTIPLE
    from tiledsl.spec import default_softmax_scale
    padded_d, padded_dv = (-(-n // BACKWARD_DIM_MULTIPLE) * BACKWARD_DIM_MULTIPLE for n in (d, dv))
    q, k, v, do = inputs(2, 4, 2, 9, 13, d, dv)

    def pad(x, width):
        return np.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    spec = KernelSpec("bwd", Problem(padded_d, padded_dv, mask=mask, softmax_scale=default_softmax_scale(d)),
                      Schedule(), backward=BackwardSchedule())
    got = reference_backward(spec, pad(q, padded_d), pad(k, padded_d), pad(v, padded_dv), pad(do, padded_dv))
    want = analytic_grads(q, k, v, do, mask)
    assert_close([got[0][..., :d], got[1][..., :d], got[2][..., :dv]], want)
    assert not got[0][..., d:].any() and not got[1][..., d:].any() and not got[2][..., dv:].any()
