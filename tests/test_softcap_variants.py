"""softcap's ways of running tanh (mods/softcap.py): the quotient fits refit and within their errors, each
way's float32 arithmetic simulated on the CPU (the kernel's constants, its operation order, FMAs rounded
once, MUFU's ex2 perturbed by its documented relative error both ways) against float64 at caps 15, 30 and
50 within the score budget; tanh.approx refused where its bound breaks the budget; the DSL's `via`."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tiledsl.errors import SpecError
from tiledsl.frontend.parse import parse_text
from tiledsl.mods.softcap import (EX2_APPROX_RELATIVE_ERROR, QUOTIENT_FITS, SCORE_ERROR_BUDGET, TanhVia,
                                  fit_quotient, quotient_degree, refusal, score_error)

SCALE = 1 / math.sqrt(128)
F32 = np.float32


def fma32(a, b, c):
    """fmaf: a * b + c rounded once to float32 (float64 holds the float32 product exactly)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(F32)


def exp2_fma32(x):
    """templates/score_mods.cuh exp2_fma, operation for operation."""
    shift = F32(12582912.0)
    x = np.maximum(x, F32(-126.0))
    t = (x + shift).astype(F32)
    f = (x - (t - shift).astype(F32)).astype(F32)
    p = F32(0.009570102207362652)
    for c in (0.05591785907745361, 0.240247443318367, 0.6931217908859253, 0.9999992847442627):
        p = fma32(p, f, F32(c))
    bits = p.view(np.int32) + (t.view(np.int32) << 23)
    return bits.astype(np.int32).view(F32)


def kernel_softcap(s, cap: float, via: TanhVia, ex2_sign: float = 0.0):
    """The kernel's capped score in raw units for raw scores `s` (float32), its constants as lower/hopper.py
    writes them; MUFU's ex2 is 2^x (1 + ex2_sign * its relative error)."""
    degree = quotient_degree(cap, via)
    coefficients = [F32(c * cap / SCALE) for c in QUOTIENT_FITS[degree][0]]
    x = (np.abs(s) * F32(-2.0 * math.log2(math.e) * SCALE / cap)).astype(F32)
    if via is TanhVia.FMA:
        w = exp2_fma32(x)
    else:
        w = (np.exp2(x.astype(np.float64)) * (1 + ex2_sign * EX2_APPROX_RELATIVE_ERROR)).astype(F32)
    p = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        p = fma32(p, w, c)
    return np.copysign(p, s)


def test_quotient_fits_refit_and_hold_their_errors():
    grid = np.linspace(0, 1, 100001)
    for degree, (coefficients, error) in QUOTIENT_FITS.items():
        refit, refit_error = fit_quotient(degree)
        assert np.allclose(refit, coefficients, atol=1e-9)
        measured = np.abs(np.polyval(coefficients[::-1], grid) - (1 - grid) / (1 + grid)).max()
        assert measured <= error * 1.01 and refit_error <= error * 1.01


@pytest.mark.parametrize("cap", [15.0, 30.0, 50.0])
@pytest.mark.parametrize("via", [TanhVia.EX2, TanhVia.FMA])
def test_simulated_float32_softcap_meets_the_score_budget(cap, via):
    rng = np.random.default_rng()
    t = np.concatenate([np.linspace(-6 * cap, 6 * cap, 400001), rng.normal(0, cap, 100000), [0.0, -0.0, 1e-30]])
    s = (t / SCALE).astype(F32)
    truth = cap * np.tanh(s.astype(np.float64) * SCALE / cap)
    for sign in ((-1.0, 1.0) if via is TanhVia.EX2 else (0.0,)):
        got = kernel_softcap(s, cap, via, sign).astype(np.float64) * SCALE
        error = np.abs(got - truth).max()
        assert error <= score_error(cap, via, quotient_degree(cap, via)) <= SCORE_ERROR_BUDGET, (cap, via, error)
        assert np.all(np.abs(got) <= cap * (1 + 1e-5))   # capped: never past the cap beyond rounding


def test_each_way_picks_the_lowest_degree_that_fits():
    assert quotient_degree(15.0, TanhVia.EX2) == 6
    assert quotient_degree(30.0, TanhVia.EX2) == 7 and quotient_degree(50.0, TanhVia.SPLIT) == 7
    assert quotient_degree(2000.0, TanhVia.EX2) is None and "leave softcap out" in refusal(2000.0, TanhVia.EX2)


def test_tanh_approx_is_refused_where_its_error_breaks_the_budget():
    for cap in (15.0, 30.0, 50.0):
        why = refusal(cap, TanhVia.TANH_APPROX)
        assert why and "2^-11" in why and "use ex2" in why
    assert refusal(0.5, TanhVia.TANH_APPROX) is None
    assert score_error(30.0, TanhVia.TANH_APPROX) > 50 * SCORE_ERROR_BUDGET


SPEC = "attention a {{\n    head_dim = 128\n    mask = causal\n    {line}\n}}\n"


@pytest.mark.parametrize("via", list(TanhVia))
def test_the_dsl_writes_each_way(via):
    cap = 0.5 if via is TanhVia.TANH_APPROX else 30
    (spec,) = parse_text(SPEC.format(line=f"softcap = {cap} via {via.value}"), "v.tile")
    assert spec.problem.mods.softcap_via is via
    assert f"_softcap{cap:g}".replace(".", "p") + via.value.replace("_", "") + "_" in spec.kernel_name
    assert f"via {via.value}" in "\n".join(spec.problem.mods.dsl_lines())


def test_no_via_keeps_the_kernel_name():
    (spec,) = parse_text(SPEC.format(line="softcap = 30"), "v.tile")
    assert spec.problem.mods.softcap_via is None and "_softcap30_" in spec.kernel_name


@pytest.mark.parametrize("line, column, words", [
    ("softcap = 30 via tanh_approx", 5, "tanh.approx's relative error 2^-11"),
    ("softcap = 30 via ex3", 22, "unknown softcap via 'ex3'; did you mean 'ex2'?"),
])
def test_dsl_errors_point_at_the_setting(line, column, words):
    with pytest.raises(SpecError) as err:
        parse_text(SPEC.format(line=line), "v.tile")
    assert words in err.value.message and (err.value.span.line, err.value.span.column) == (4, column)


def test_via_on_another_setting_is_refused():
    with pytest.raises(SpecError, match="'head_dim' takes no `via`") as err:
        parse_text("attention a {\n    head_dim = 128 via ex2\n}\n", "v.tile")
    assert (err.value.span.line, err.value.span.column) == (2, 24)
