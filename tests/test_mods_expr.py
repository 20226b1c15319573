"""The expression trees' meaning (mods/numeric.py), ranges (mods/intervals.py) and derivatives (mods/expr.py),
and dropout's random numbers (mods/philox.py), each against an independent statement of it."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from tiledsl.mods.expr import Const, Type, Var, apply, derivative, reads
from tiledsl.mods.intervals import INT32, interval, truth
from tiledsl.mods.model import geometric_slopes
from tiledsl.mods.numeric import evaluate
from tiledsl.mods.philox import drop_threshold, keep_mask, philox4x32

from .mods_support import INDEX_NAMES, expressions


@st.composite
def boxes(draw):
    """An interval per name, and points inside it."""
    box = {}
    for name in INDEX_NAMES:
        lo = draw(st.integers(-40, 40))
        box[name] = (lo, lo + draw(st.integers(0, 30)))
    lo = draw(st.floats(-6, 6))
    box["score"] = (lo, lo + draw(st.floats(0, 6)))
    return box


def points(box, rng, n=64):
    env = {name: rng.integers(lo, hi + 1, n) for name, (lo, hi) in box.items() if name != "score"}
    lo, hi = box["score"]
    env["score"] = np.concatenate([[lo, hi], rng.uniform(lo, hi, n - 2)])
    return env


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([Type.FLOAT, Type.INT, Type.BOOL]), st.data(), boxes(), st.integers(0, 2**32 - 1))
def test_an_interval_holds_every_value_the_expression_takes_in_its_box(t, data, box, seed):
    expr = data.draw(expressions(t, score=True, aux=False))
    values = np.broadcast_to(evaluate(expr, points(box, np.random.default_rng(seed)), {}), (64,))
    span = interval(expr, box)
    if t is Type.BOOL:
        can_false, can_true = span
        assert can_true or not values.any(), (expr, span)
        assert can_false or values.all(), (expr, span)
        return
    lo, hi, nan = span
    if t is Type.INT:   # launches whose ints could leave int32 are refused (mods/checks.py); NumPy wraps them
        assume(INT32[0] <= lo and hi <= INT32[1])
    assert nan or not np.isnan(values).any(), (expr, span)
    finite = np.isfinite(values)
    slack = 1e-9 * max(1.0, abs(lo) if math.isfinite(lo) else 1.0, abs(hi) if math.isfinite(hi) else 1.0)
    assert (values[finite] >= lo - slack).all() and (values[finite] <= hi + slack).all(), (expr, span, values)


@pytest.mark.parametrize("q, kv, expected", [
    ((128, 255), (0, 63), "always"), ((0, 63), (64, 127), "never"), ((0, 127), (0, 63), "maybe"),
])
def test_causal_intervals_are_exact_on_tiles(q, kv, expected):
    causal = apply("le", Var("kv_idx"), Var("q_idx"))
    assert truth(interval(causal, {"q_idx": q, "kv_idx": kv})) == expected


def test_a_window_with_a_global_token_is_classified_exactly():
    i, j = Var("q_idx"), Var("kv_idx")
    window = apply("or", apply("and", apply("le", j, i), apply("le", apply("sub", i, j), Const(64))),
                   apply("eq", j, Const(0)))
    assert truth(interval(window, {"q_idx": (512, 639), "kv_idx": (0, 15)})) == "maybe"      # the global key
    assert truth(interval(window, {"q_idx": (512, 639), "kv_idx": (128, 255)})) == "never"
    assert truth(interval(window, {"q_idx": (512, 575), "kv_idx": (512, 511 + 1)})) == "always"


@settings(max_examples=300, deadline=None)
@given(st.data(), st.floats(-4, 4).filter(lambda s: abs(s) > 1e-3), st.integers(0, 2**32 - 1))
def test_the_derivative_matches_central_differences_where_the_expression_is_smooth(data, s0, seed):
    expr = data.draw(expressions(Type.FLOAT, score=True, aux=False, depth=3))
    assume(not any(n.op in ("floor", "ceil") for n in _applies(expr)))
    env = {name: np.int64(v) for name, v in zip(INDEX_NAMES, np.random.default_rng(seed).integers(-20, 20, 6))}

    def f(s):
        return float(evaluate(expr, {**env, "score": np.float64(s)}, {}))
    h = 1e-5
    fd = (f(s0 + h) - f(s0 - h)) / (2 * h)
    right, left = (f(s0 + h) - f(s0)) / h, (f(s0) - f(s0 - h)) / h
    assume(all(map(math.isfinite, (f(s0), fd, right, left))) and abs(fd) < 1e6)
    point = {**env, "score": np.float64(s0)}   # every intermediate finite too: no x / 0 inside
    assume(all(np.isfinite(np.asarray(evaluate(n, point, {}), dtype=float)).all() for n in _applies(expr)))
    assume(abs(right - left) <= 1e-3 * max(1.0, abs(fd)))   # smooth here: no kink, branch or pole within h
    d = float(evaluate(derivative(expr), {**env, "score": np.float64(s0)}, {}))
    assert d == pytest.approx(fd, rel=1e-3, abs=1e-5), expr


def _applies(expr):
    found = [expr] if hasattr(expr, "op") else []
    for a in expr.args:
        found += _applies(a)
    return found


def test_the_softcap_derivative_is_one_minus_tanh_squared():
    cap = Const(30.0)
    expr = apply("mul", cap, apply("tanh", apply("div", Var("score"), cap)))
    s = np.linspace(-100, 100, 41)
    assert np.allclose(evaluate(derivative(expr), {"score": s}, {}), 1 - np.tanh(s / 30) ** 2, rtol=1e-13)


def test_a_bias_has_derivative_one_and_no_score_has_zero():
    bias = apply("add", Var("score"), Const(3.0))
    assert derivative(bias) == Const(1.0)
    assert derivative(Const(2.0)) == Const(0.0)
    assert reads(derivative(apply("mul", Var("score"), Var("h"))), Var) == [Var("h")]


def test_philox_matches_random123s_known_answers():
    # Random123's kat_vectors for philox4x32_10
    assert [int(w) for w in philox4x32((0, 0, 0, 0), (0, 0))] == [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    ones = 0xFFFFFFFF
    assert [int(w) for w in philox4x32((ones,) * 4, (ones, ones))] == [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    assert [int(w) for w in philox4x32((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0))] \
        == [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]


def test_the_keep_mask_reads_one_word_per_key_and_drops_about_p():
    b, h, rows, cols = np.arange(2)[:, None, None, None], np.arange(3)[None, :, None, None], \
        np.arange(40)[None, None, :, None], np.arange(64)[None, None, None, :]
    keep = keep_mask(0.25, seed=1234, offset=7, heads=3, b=b, h=h, rows=rows, cols=cols)
    assert keep.shape == (2, 3, 40, 64) and abs(1 - keep.mean() - 0.25) < 0.02
    words = philox4x32((5 >> 2, 9, 1 * 3 + 2, 7), (1234, 0))
    assert keep[1, 2, 9, 5] == (words[5 & 3] >= drop_threshold(0.25))
    again = keep_mask(0.25, seed=1234, offset=7, heads=3, b=b, h=h, rows=rows, cols=cols)
    other = keep_mask(0.25, seed=1234, offset=8, heads=3, b=b, h=h, rows=rows, cols=cols)
    assert (again == keep).all() and (other != keep).any()


def test_geometric_slopes_are_alibis():
    assert geometric_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    twelve = geometric_slopes(12)   # 8 of the power of two, then every other one of 16's
    assert twelve[:8] == geometric_slopes(8) and twelve[8:] == geometric_slopes(16)[0::2][:4]
