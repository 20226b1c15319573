"""lower/expressions.py's CUDA spelling of score_mod / mask_mod trees, against mods/numeric.py (values) and
mods/intervals.py (mask_mod's box): golden strings, then the spelled device functions (macros.j2's
expression_functions over templates/expression_ops.cuh) compiled for the host with g++ and run on fresh
points and boxes; the routing of expressions to the hopper forward and the refusals around it."""
from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tiledsl.codegen.render import TEMPLATE_DIR, environment
from tiledsl.dispatch.modified import expression
from tiledsl.lower.expressions import (
    box,
    cuda,
    expression_fields,
    expression_parameters,
)
from tiledsl.mods.expr import OPS, Apply, Aux, Const, Type, Var, apply, reads
from tiledsl.mods.intervals import INT32, interval, truth
from tiledsl.mods.model import Modifications
from tiledsl.mods.numeric import evaluate

from .mods_support import expressions

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def tree(role: str, text: str):
    return expression("test", role, text, {})[0]


# ---- golden strings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("role, text, spelled", [
    ("score_mod", "score + bias[h, q_idx - kv_idx + 4095]",
     "(score + __ldg(aux.t_bias + ((h) * aux.t_bias_s0 + (((q_idx - kv_idx) + 4095)) * aux.t_bias_s1)))"),
    ("score_mod", "50.0 * tanh(score / 50.0)", "(50.0f * tanhf((score / 50.0f)))"),
    ("mask_mod", "kv_idx == 0 | q_idx - kv_idx < 256", "((kv_idx == 0) || ((q_idx - kv_idx) < 256))"),
    ("mask_mod", "(q_idx - kv_idx) // 64 % 4 != -1", "(py_mod(py_floordiv((q_idx - kv_idx), 64), 4) != (-1))"),
    ("score_mod", "score * int(q_idx * 2.5) + q_idx / 2", "((score * (float)((int)(((float)(q_idx) * 2.5f)))) + "
                                                          "((float)(q_idx) / (float)(2)))"),
    ("score_mod", "where(kv_idx < q_idx, min(score, 3), max(score, kv_idx))",
     "((kv_idx < q_idx) ? py_minf(score, (float)(3)) : py_maxf(score, (float)(kv_idx)))"),
    ("mask_mod", "~(q_idx < 3) & (kv_idx > 2) == (q_idx > 1)", "((!(q_idx < 3)) && ((kv_idx > 2) == (q_idx > 1)))"),
])
def test_golden_spellings(role, text, spelled):
    assert cuda(tree(role, text)) == spelled


def test_every_op_has_a_spelling():
    x, i, c = Var("score"), Var("q_idx"), apply("lt", Var("q_idx"), Var("kv_idx"))
    for op, info in OPS.items():
        args = {"logic": (c,) * info.arity, "where": (c, x, i), "integer": (i, Const(3))}.get(
            info.rule, (x, i)[:info.arity])
        if info.rule == "to_int" or info.rule in ("unary_float", "round"):
            args = (x,)
        assert cuda(apply(op, *args))


def test_constants_outside_int32_are_refused_and_infinities_spelled_by_bits():
    with pytest.raises(ValueError, match="int32"):
        cuda(Const(1 << 31))
    assert cuda(Const(-(1 << 31))) == "(-2147483648)"
    assert "0x7f800000" in cuda(Const(float("inf")))


def test_a_box_of_float_or_aux_reads_is_either_and_its_answer_a_partial_tile():
    lines, answer = box(tree("mask_mod", "doc[b, q_idx] == doc[b, kv_idx]"))
    assert (lines, answer) == ([], ("true", "true"))
    lines, answer = box(tree("mask_mod", "q_idx / 2 < kv_idx"))
    assert answer == ("true", "true")


# ---- the spelled functions on the host ------------------------------------------------------------------

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdint>
#define __device__
#define __forceinline__ inline
#define __restrict__
using std::max;
using std::min;
using std::abs;
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __logf(float x) { return logf(x); }
template <class T> inline T __ldg(const T* p) { return *p; }
"""
T1 = np.arange(64, dtype=np.int64) * 7 % 13 - 6          # int table t1 (64,)
T2 = np.linspace(-3, 3, 4 * 64).reshape(4, 64)           # float table t2 (4, 64)


def host_source(trees: list, score: bool) -> str:
    """C++ that prints, for each input line, every tree's value (score_mod_of or mask_mod_of), or its box's
    class (mask_mod_box) for a line starting with 'box'."""
    env = environment()
    macro = env.from_string('{% import "macros.j2" as m %}{{ m.expression_functions(plan) }}')
    parts = [PRELUDE, (TEMPLATE_DIR / "expression_ops.cuh").read_text(),
             "static const int t1_data[64] = {" + ", ".join(str(int(x)) for x in T1) + "};",
             "static const float t2_data[256] = {" + ", ".join(f"{float(x)!r}f" for x in T2.ravel()) + "};"]
    calls = []
    for n, t in enumerate(trees):
        mods = Modifications(score_mod=t) if score else Modifications(mask_mod=t)
        fields = expression_fields(mods)
        text = macro.render(plan=SimpleNamespace(**fields))
        for name in ("ExprAux", "score_mod_of", "mask_mod_of", "mask_mod_box"):
            text = text.replace(name, f"{name}_{n}")
        parts.append(text)
        values = {"aux_t1": "t1_data", "aux_t1_stride0": "1", "aux_t2": "t2_data", "aux_t2_stride0": "64",
                  "aux_t2_stride1": "1"}
        init = "{" + ", ".join(values[p.name] for p in expression_parameters(mods)) + "}"
        parts.append(f"static const ExprAux_{n} aux_{n} = {init};")
        calls.append((n, init))
    value = "\n".join(
        (f'        printf(" %a", (double)score_mod_of_{n}(s, b, h, q, kv, ql, kl, aux_{n}));' if score else
         f'        printf(" %d", (int)mask_mod_of_{n}(b, h, q, kv, ql, kl, aux_{n}));') for n, _ in calls)
    boxes = "\n".join(f'            printf(" %d", mask_mod_box_{n}(b, h, q, q2, kv, kv2, ql, kl));'
                      for n, _ in calls) if not score else ""
    parts.append(f"""
int main() {{
    char kind[8];
    while (scanf("%7s", kind) == 1) {{
        float s; int b, h, q, kv, ql, kl, q2 = 0, kv2 = 0;
        if (kind[0] == 'b') {{
            scanf("%d %d %d %d %d %d %d %d", &b, &h, &q, &q2, &kv, &kv2, &ql, &kl);
{boxes}
            printf("\\n");
            continue;
        }}
        scanf("%a %d %d %d %d %d %d", &s, &b, &h, &q, &kv, &ql, &kl);
{value}
        printf("\\n");
    }}
}}
""")
    return "\n".join(parts)


def run_host(source: str, lines: list[str], tmp: Path) -> list[list[str]]:
    src, exe = tmp / "expr.cpp", tmp / "expr"
    src.write_text(source)
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unused-variable",
                    "-Wno-unused-but-set-variable", "-Wno-tautological-compare", "-Wno-unknown-pragmas", str(src),
                    "-o", str(exe)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return [line.split() for line in out.stdout.splitlines()]


def env_of(point: dict) -> dict:
    return {k: np.asarray(v, dtype=np.float64 if k == "score" else np.int64) for k, v in point.items()}


FLOAT_CASES = [
    "score + q_idx - kv_idx * 0.5", "score * 3 - -score / 4", "score / (q_idx - kv_idx)", "abs(score) + abs(q_idx - 9)",
    "min(score, q_idx) + max(score, -2.5)", "tanh(score / 7.0) * 7.0", "exp(score / 8)", "log(abs(score) + 1)",
    "sqrt(abs(score))", "sigmoid(score)", "floor(score) + ceil(-score)", "score + int(q_idx * 2.5)",
    "score + int(-kv_idx / 1.5)", "where(q_idx >= kv_idx, score, -score * 2)", "score + (q_idx - kv_idx) // 4",
    "score + (q_idx - kv_idx) % 5", "score + (kv_idx - 2 * q_idx) % 3 * (q_idx - kv_idx) // 7",
    "where((q_idx < kv_idx) == (h > 1), score, 0.0)", "score + t2[h, min(abs(q_idx - kv_idx), 63)]",
    "score + t2[b, (q_idx - kv_idx) % 64]", "score + q_len - kv_len + b * h", "log(score)", "sqrt(score) + 0 * b",
    "min(score * 0.0 + log(score), 1.0)", "max(log(score), -1.0)",
]
MASK_CASES = [
    "kv_idx == 0 | q_idx - kv_idx < 6", "(q_idx - kv_idx) // 4 == -2", "(q_idx - kv_idx) % 7 >= 3",
    "(q_idx - kv_idx) % 7 == 6",
    "(kv_idx - q_idx) // 5 == 2",
    "(q_idx - kv_idx) % 4 != q_idx // 3 * 0", "t1[kv_idx % 64] == t1[q_idx % 64]", "~(q_idx < kv_idx) & (h != 2)",
    "where(q_idx > 5, kv_idx < 3, kv_idx >= q_idx)", "(q_idx > kv_idx) == (kv_idx > 4)", "int(q_idx / 3) == kv_idx",
    "int(-q_idx / 3) == -kv_idx", "abs(q_idx - kv_idx) * 2 < kv_len - q_len + 4", "min(q_idx, kv_idx) + max(b, h) > 5",
]


def points(rng, n: int) -> list[dict]:
    scores = rng.integers(-160, 161, n) / 8.0   # exact in float32: products with small constants round alike
    scores[:4] = [0.0, -0.0, np.inf, -np.inf]
    return [dict(score=float(s), b=int(rng.integers(0, 4)), h=int(rng.integers(0, 4)), q_idx=int(rng.integers(-20, 40)),
                 kv_idx=int(rng.integers(-20, 40)), q_len=int(rng.integers(1, 50)), kv_len=int(rng.integers(0, 50)))
            for s in scores]


def aux_tables() -> dict:
    return {"t1": T1, "t2": T2}


def in_tables(t, point) -> bool:
    try:
        evaluate(t, env_of(point), aux_tables())
        return True
    except IndexError:
        return False


@needs_gxx
def test_spelled_score_mods_compute_numeric_pys_values(tmp_path):
    trees = [tree("score_mod", text) for text in FLOAT_CASES]
    rng = np.random.default_rng()
    pts = points(rng, 200)
    rows = run_host(host_source(trees, score=True), [
        f"v {float(p['score']).hex()} {p['b']} {p['h']} {p['q_idx']} {p['kv_idx']} {p['q_len']} {p['kv_len']}"
        for p in pts], tmp_path)
    for p, row in zip(pts, rows):
        for t, text, got in zip(trees, FLOAT_CASES, row):
            # int() of an infinite score is undefined in C (and wraps in NumPy)
            if not in_tables(t, p) or (not np.isfinite(p["score"]) and any(
                    isinstance(n, Apply) and n.op == "int" for n in nodes(t))):
                continue
            want = float(evaluate(t, env_of(p), aux_tables()))
            got = float.fromhex(got)
            if np.isnan(want):
                assert np.isnan(got), (text, p, want, got)
            elif np.isinf(want):
                assert got == want, (text, p, want, got)
            elif abs(want) < 3e38:
                assert got == pytest.approx(want, rel=4e-6, abs=1e-6), (text, p, want, got)


@needs_gxx
def test_spelled_mask_mods_compute_numeric_pys_values_and_intervals_pys_boxes(tmp_path):
    trees = [tree("mask_mod", text) for text in MASK_CASES]
    check_masks(trees, MASK_CASES, tmp_path, np.random.default_rng())


def check_masks(trees, texts, tmp_path, rng, n_points=200, n_boxes=120):
    pts = points(rng, n_points)
    boxes = []
    for _ in range(n_boxes):
        q, kv = int(rng.integers(-10, 30)), int(rng.integers(-10, 30))
        boxes.append(dict(b=int(rng.integers(0, 4)), h=int(rng.integers(0, 4)), q=(q, q + int(rng.integers(0, 12))),
                          kv=(kv, kv + int(rng.integers(0, 12))), q_len=int(rng.integers(1, 50)),
                          kv_len=int(rng.integers(0, 50))))
    lines = [f"v 0x0p+0 {p['b']} {p['h']} {p['q_idx']} {p['kv_idx']} {p['q_len']} {p['kv_len']}" for p in pts]
    lines += [f"box {x['b']} {x['h']} {x['q'][0]} {x['q'][1]} {x['kv'][0]} {x['kv'][1]} {x['q_len']} {x['kv_len']}"
              for x in boxes]
    rows = run_host(host_source(trees, score=False), lines, tmp_path)
    for p, row in zip(pts, rows[:len(pts)]):
        for t, text, got in zip(trees, texts, row):
            if in_tables(t, p):
                assert int(got) == int(bool(evaluate(t, env_of(p), aux_tables()))), (text, p)
    for x, row in zip(boxes, rows[len(pts):]):
        span = {"b": (x["b"],) * 2, "h": (x["h"],) * 2, "q_idx": x["q"], "kv_idx": x["kv"],
                "q_len": (x["q_len"],) * 2, "kv_len": (x["kv_len"],) * 2}
        q, kv = np.arange(x["q"][0], x["q"][1] + 1), np.arange(x["kv"][0], x["kv"][1] + 1)
        grid = dict(b=x["b"], h=x["h"], q_idx=q[:, None], kv_idx=kv[None, :], q_len=x["q_len"], kv_len=x["kv_len"])
        for t, text, got in zip(trees, texts, row):
            got = int(got)
            if not (reads(t, Aux) or any(n.type is Type.FLOAT for n in nodes(t))):   # spelled whole: exact
                want = truth(interval(t, span))
                assert got == {"never": 0, "maybe": 1, "always": 2}[want], (text, x, want, got)
            try:
                seen = evaluate(t, {k: np.asarray(v) for k, v in grid.items()}, aux_tables())
            except IndexError:
                continue
            seen = np.broadcast_to(seen, (len(q), len(kv)))
            if got == 0:   # sound: an empty box sees nothing, a full one everything
                assert not seen.any(), (text, x)
            if got == 2:
                assert seen.all(), (text, x)


def nodes(t):
    yield t
    for a in t.args:
        yield from nodes(a)


def int_only(t) -> bool:
    """No float node and every int inside int32 over the test's points (the launch checks' rule)."""
    if any(n.type is Type.FLOAT for n in nodes(t)):
        return False
    span = {"b": (0, 3), "h": (0, 3), "q_idx": (-20, 40), "kv_idx": (-20, 40), "q_len": (1, 50), "kv_len": (0, 50)}
    fits = []
    interval(t, span, visit=lambda node, r: fits.append(node.type is not Type.INT or (INT32[0] <= r[0] and
                                                                                       r[1] <= INT32[1])))
    return all(fits)


@needs_gxx
@settings(max_examples=3, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(st.lists(expressions(Type.BOOL, score=False, aux=False).filter(int_only), min_size=25, max_size=25),
       st.integers(0, 2**32 - 1))
def test_random_int_masks_match_numeric_and_intervals(tmp_path, trees, seed):
    check_masks(trees, [str(t)[:200] for t in trees], tmp_path, np.random.default_rng(seed), 100, 80)


def test_mixed_spellings_type_every_where_and_compare():
    """where's branches and a comparison's operands convert an int to float where the tree's type says so."""
    t = apply("where", apply("lt", Var("q_idx"), Const(2.5)), Var("kv_idx"), Var("score"))
    assert cuda(t) == "(((float)(q_idx) < 2.5f) ? (float)(kv_idx) : score)"
    assert isinstance(t, Apply)


def test_expression_parameters_are_a_pointer_and_strides_per_tensor():
    mods = Modifications(score_mod=tree("score_mod", "score + bias[h, q_idx - kv_idx + 10]"),
                         mask_mod=tree("mask_mod", "doc[b, q_idx] == doc[b, kv_idx] & ok[kv_idx] != 0"))
    assert [(p.name, p.type) for p in expression_parameters(mods)] == [
        ("aux_bias", "const float* __restrict__"), ("aux_bias_stride0", "int"), ("aux_bias_stride1", "int"),
        ("aux_doc", "const int* __restrict__"), ("aux_doc_stride0", "int"), ("aux_doc_stride1", "int"),
        ("aux_ok", "const int* __restrict__"), ("aux_ok_stride0", "int")]
    assert list(itertools.islice(expression_fields(mods)["expr_aux_fields"], 1)) == [
        "const float* __restrict__ t_bias; int t_bias_s0; int t_bias_s1;"]


# ---- routing ------------------------------------------------------------------------------------------

def test_the_tuned_path_builds_the_hopper_kernel_with_the_expressions():
    from tiledsl.codegen.render import render
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.families import Family, lower, missing_template
    from tiledsl.spec import DType, Mask
    window = Modifications(mask_mod=tree("mask_mod", "kv_idx == 0 | q_idx - kv_idx < 256"))
    for q_len in (1, 4096):   # a decode-length call keeps the prefill kernel (decode spells no expression)
        spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, q_len=q_len, mods=window)
        assert spec.family is Family.HOPPER and not missing_template(spec)
    text = render(lower(spec))
    assert "mask_mod = kv_idx == 0 | q_idx - kv_idx < 256" in text and "tiles.next(tile, tile_end)" in text
    other = Modifications(mask_mod=tree("mask_mod", "kv_idx == 0 | q_idx - kv_idx < 255"))
    spec2, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, q_len=4096, mods=other)
    assert spec2.kernel_name != spec.kernel_name and render(lower(spec2)) != text   # the tree is the kernel's key
    bias = Modifications(score_mod=tree("score_mod", "score + bias[h, q_idx - kv_idx + 10]"))
    spec3, _ = tuned_spec("sm_90a", DType.BF16, 64, Mask.NONE, q_len=4096, mods=bias)
    text = render(lower(spec3))
    assert "expression_scores<C>(acc_s, expr_item" in text and "aux_bias_stride1" in text
    assert "tiles.next" not in text   # a score_mod alone visits the mask's tiles


def test_the_backward_and_varlen_take_expressions():
    from tiledsl.dispatch.backward import modified_backward_refusal
    from tiledsl.families import missing_template
    from tiledsl.serving.varlen import varlen_spec
    from tiledsl.spec import DType, Mask
    mods = Modifications(score_mod=tree("score_mod", "score * 0.5"))
    assert modified_backward_refusal("sm_90a", 128, 128, mods) == ""
    spec = varlen_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, 128, None, None, mods)
    assert missing_template(spec) == ""


# ---- the kernel's walk of mask_mod's tiles ----------------------------------------------------------------

WALK_MAIN = r"""
struct int2 { int x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
static const float NEG_INF = -INFINITY;
inline int acc_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
inline int acc_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
struct C { static constexpr int BC = TILE_KV, BR = TILE_Q, M_TILES = 1, S_TILES = TILE_KV / 8;
           static constexpr bool EXPR_CLAMP = false; static constexpr float SCALE = 1.f, INV_SCALE = 1.f; };
int main() {
    int q_len, kv_len;
    while (scanf("%d %d", &q_len, &kv_len) == 2) {
        for (int q0 = 0; q0 < q_len; q0 += C::BR) {
            int begin = 0, end = (kv_len + C::BC - 1) / C::BC;
            const MaskModTiles tiles = narrow_to_mask_mod<C>(begin, end, 0, 0, q0, std::min(C::BR, q_len - q0), q_len,
                                                             kv_len);
            printf("%d:", q0 / C::BR);
            for (int tile = begin; tile < end; tile = tiles.next(tile, end)) printf(" %d", tile);
            printf("\n");
        }
        printf("end\n");
    }
}
"""


@needs_gxx
@pytest.mark.parametrize("text", ["kv_idx == 0 | q_idx - kv_idx < 256", "kv_idx <= q_idx | kv_idx < 300",
                                  "(q_idx - kv_idx) // 128 % 3 == 0", "kv_idx > q_idx + kv_len"])
def test_the_kernels_walk_visits_explains_visible_tiles(text, tmp_path):
    """narrow_to_mask_mod and MaskModTiles::next (templates/expressions.cuh, the producer's and the consumers' walk)
    visit exactly the tiles schedule/tiles.classify (explain's counts) finds not empty, in order."""
    from tiledsl.schedule.tiles import EMPTY, Tiling, classify
    from tiledsl.spec import DType, Mask, Problem
    t = tree("mask_mod", text)
    mods = Modifications(mask_mod=t)
    macro = environment().from_string('{% import "macros.j2" as m %}{{ m.expression_functions(plan) }}')
    source = "\n".join([PRELUDE, "#define TILE_KV 128\n#define TILE_Q 128",
                        (TEMPLATE_DIR / "expression_ops.cuh").read_text(),
                        macro.render(plan=SimpleNamespace(**expression_fields(mods))), WALK_MAIN.split("int main")[0],
                        (TEMPLATE_DIR / "expressions.cuh").read_text(), "int main" + WALK_MAIN.split("int main")[1]])
    shapes = [(1000, 1000), (2048, 2048), (300, 1700), (1, 129)]
    rows = run_host(source, [f"{q} {kv}" for q, kv in shapes], tmp_path)
    walks = iter(rows)
    for q_len, kv_len in shapes:
        classes = classify(Problem(64, 64, DType.BF16, Mask.NONE, mods=mods), Tiling(q_len, kv_len, 128, 128), 1, 1)
        for i in range(classes.shape[2]):
            visited = [int(x) for x in next(walks)[1:]]
            assert visited == [j for j in range(classes.shape[3]) if classes[0, 0, i, j] != EMPTY], (text, q_len, i)
        assert next(walks) == ["end"]
