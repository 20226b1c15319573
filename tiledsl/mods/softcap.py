"""How softcap's tanh runs on Hopper (`softcap = 30 via ex2 | fma | split | tanh_approx`), and what each way
costs in accuracy: the one home of the error figures the rules check and the lowering reads.

softcap writes t' = cap tanh(t / cap) for every scaled score t, between the two GEMMs, where the consumer's
softmax already spends one MUFU op (ex2) and about ten issue slots per score. With |t| / cap = a and
w = e^(-2a) in (0, 1], tanh(a) = (1 - w) / (1 + w), a function of w with no pole on [0, 1]:

  ex2          w by MUFU's ex2.approx (one op), the quotient by a minimax polynomial in w on the FMA pipes
               (6 to 8 FMAs, cap / scale folded into its coefficients), the sign copied back: one MUFU op and
               about ten issue slots per score. The default: the fewest issue slots of the accurate ways.
  fma          w by 2^x on the FMA pipes (round-to-nearest split, a degree-4 polynomial, the exponent added
               as an integer), then the same quotient: no MUFU op, about eighteen issue slots.
  split        the first half of each thread's 8-column tiles of S by ex2, the rest by fma: MUFU and the
               FMA pipes share the work (for kernels whose MUFU unit, not issue, is the limit).
  tanh_approx  MUFU's tanh.approx.f32 (one op, two multiplies): its relative error 2^-11 comes back times
               the cap, so it meets the score budget only for caps below about 0.5; refused above.

The budget: the forward's LSE is held to 1e-3 absolute against float64 (tests/gpu_support.py, cli run),
and an error e in every capped score moves the LSE by up to e (the softmax is 1-Lipschitz in the max norm),
so a way's worst-case score error, summed over its parts, must stay under SCORE_ERROR_BUDGET, a quarter
of that. O's error is bounded by the same e plus the bf16 rounding of P (2^-9), which the score error
stays far below.
"""
from __future__ import annotations

import math
from enum import Enum


class TanhVia(Enum):
    EX2 = "ex2"
    FMA = "fma"
    SPLIT = "split"
    TANH_APPROX = "tanh_approx"


DEFAULT_VIA = TanhVia.EX2

SCORE_ERROR_BUDGET = 2.5e-4          # scaled-score units: a quarter of the forward's LSE tolerance (1e-3)
TANH_APPROX_RELATIVE_ERROR = 2.0 ** -11   # PTX ISA, tanh.approx.f32
EX2_APPROX_RELATIVE_ERROR = 2.0 ** -22    # PTX ISA, ex2.approx.ftz.f32 (2^-22.5, rounded up)
EXP2_FMA_RELATIVE_ERROR = 3.8e-6          # exp2_fma's degree-4 polynomial for 2^f on [-1/2, 1/2]
FLOAT32_EVALUATION_ERROR = 8 * 2.0 ** -24  # a few float32 roundings of values <= 1 along a Horner chain
# The exp2 argument is clamped here in the fma way: w = 2^-64 is 0 to the quotient's precision.
EXP2_FMA_FLOOR = -64.0

# (1 - w) / (1 + w) on w in [0, 1] by degree: (coefficients of w^0.., max absolute error), fitted by
# fit_quotient (Lawson's iteration towards the minimax polynomial); tests/test_softcap_variants.py refits
# them and checks the errors.
QUOTIENT_FITS: dict[int, tuple[tuple[float, ...], float]] = {
    6: ((0.9999872459367685, -1.9985977702137805, 1.9745952059393164, -1.8219946415526194, 1.3658197838535184,
         -0.6720420825396757, 0.1522450126290541), 1.28e-05),
    7: ((0.9999978117594699, -1.999690141060704, 1.9927559644307793, -1.9341455311127138, 1.693533782353003,
         -1.1614286145575792, 0.5134589980607707, -0.10448445811167192), 2.19e-06),
    8: ((0.9999996245591143, -1.9999334492401348, 1.998049433705402, -1.9776707871243597, 1.86831057936047,
         -1.5410140622406194, 0.9687881847324564, -0.38823594381637383, 0.07170679550459674), 3.75e-07),
}


def fit_quotient(degree: int, iterations: int = 400):
    """(coefficients, max error) of a near-minimax polynomial for (1 - w) / (1 + w) on [0, 1]."""
    import numpy as np
    x = (1 - np.cos(np.linspace(0, np.pi, 6001))) / 2
    y = (1 - x) / (1 + x)
    weights = np.ones_like(x) / x.size
    vander = np.vander(x, degree + 1, increasing=True)
    for _ in range(iterations):
        root = np.sqrt(weights)
        coefficients, *_ = np.linalg.lstsq(vander * root[:, None], y * root, rcond=None)
        weights = weights * np.abs(vander @ coefficients - y)
        weights /= weights.sum()
    grid = np.linspace(0, 1, 400001)
    return tuple(float(c) for c in coefficients), float(np.abs(np.polyval(coefficients[::-1], grid)
                                                                - (1 - grid) / (1 + grid)).max())


def score_error(cap: float, via: TanhVia, degree: int | None = None) -> float:
    """The worst-case error of one capped score t' = cap tanh(t / cap), in scaled-score units."""
    if via is TanhVia.TANH_APPROX:
        return cap * (TANH_APPROX_RELATIVE_ERROR + FLOAT32_EVALUATION_ERROR)
    # d tanh / d w = -2 / (1 + w)^2 and w's relative error r moves tanh by 2 w r / (1 + w)^2 <= r / 2
    exp_error = max(EX2_APPROX_RELATIVE_ERROR if via is not TanhVia.FMA else 0.0,
                    EXP2_FMA_RELATIVE_ERROR if via is not TanhVia.EX2 else 0.0) / 2
    return cap * (QUOTIENT_FITS[degree][1] + exp_error + FLOAT32_EVALUATION_ERROR)


def quotient_degree(cap: float, via: TanhVia) -> int | None:
    """The lowest polynomial degree whose score error fits the budget at this cap (None: none does)."""
    for degree in sorted(QUOTIENT_FITS):
        if score_error(cap, via, degree) <= SCORE_ERROR_BUDGET:
            return degree
    return None


def refusal(cap: float, via: TanhVia) -> str | None:
    """Why `softcap = cap via via` cannot meet the score budget, or None when it can."""
    if via is TanhVia.TANH_APPROX:
        error = score_error(cap, via)
        if error <= SCORE_ERROR_BUDGET:
            return None
        largest = SCORE_ERROR_BUDGET / (TANH_APPROX_RELATIVE_ERROR + FLOAT32_EVALUATION_ERROR)
        return (f"tanh.approx's relative error 2^-11 times the cap {cap:g} can move a capped score by "
                f"{error:.2g}, past the {SCORE_ERROR_BUDGET:g} a score may move (a quarter of the forward's "
                f"1e-3 LSE tolerance); it fits caps up to {math.floor(largest * 1000) / 1000:g}: use ex2, fma or split")
    if quotient_degree(cap, via) is None:
        degree = max(QUOTIENT_FITS)
        return (f"the degree-{degree} quotient's error times the cap {cap:g} can move a capped score by "
                f"{score_error(cap, via, degree):.2g}, past the {SCORE_ERROR_BUDGET:g} a score may move; "
                f"caps this large change scores by less than tanh's curvature: leave softcap out")
    return None


def mufu_tiles(via: TanhVia, s_tiles: int) -> int:
    """How many of a thread's S_TILES 8-column tiles of S take w from MUFU's ex2 (the rest: the FMA pipes)."""
    return {TanhVia.EX2: s_tiles, TanhVia.FMA: 0, TanhVia.SPLIT: s_tiles // 2}.get(via, 0)
