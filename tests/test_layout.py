"""The layout pass (tiledsl/layout/): `check` accepts a config exactly when lowering builds it,
and the shared memory the layout counts is what the rendered kernel declares and launches with;
accepted configs compile with nvcc for sm_90a; check, explain and compile agree on a refusal."""
from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tiledsl.frontend import rules, space
from tiledsl.codegen import nvcc
from tiledsl.cli.main import main
from tiledsl.errors import SpecError
from tiledsl.families import layout_of
from tiledsl.families import lower
from tiledsl.frontend.parse import parse_text
from tiledsl.codegen.render import render

ROOT = Path(__file__).resolve().parent.parent
HEAD_DIMS = st.integers(1, 32).map(lambda n: 8 * n)          # 8..256 in steps of 8
# half the examples on the head dims kernels use, so that enough of them are legal
LIKELY_DIMS = st.one_of(HEAD_DIMS, st.sampled_from([64, 96, 128, 256]))
TILES = st.sampled_from([16, 32, 48, 64, 64, 96, 128, 128, 192, 256])
WARPS = st.sampled_from([1, 2, 4, 8, 16])
STAGES = st.integers(1, 4)
MASKS = st.sampled_from(["none", "causal", "window(left = 64, right = 0)"])
DTYPES = st.sampled_from(["bf16", "fp16", "bf16", "fp16", "fp32"])   # fp32: no template computes in it
# The settings every family meets (check must refuse for a family exactly what its lowering refuses): a
# paged cache, packed sequences, an FP8 cache, its conversion path, a warp axis, a copy, an MMA instruction.
SERVING = st.sampled_from([[], [], [], ["kv_cache = paged(page = 16)"], ["kv_cache = paged(page = 1)"],
                           ["kv_cache = paged(page = 64)"], ["layout = varlen"]])
FP8 = st.sampled_from([[], [], [], ["kv_dtype = e4m3"], ["kv_dtype = e4m3", "kv_scale = per_tensor"]])
OTHER_STATEMENTS = st.sampled_from([[], [], [], [], ["warps 4 along kv"], ["warps 4 along q"], ["mma wgmma"],
                                    ["mma mma.sync"], ["pipeline 2 stages via tma"], ["split kv = 4"],
                                    ["overlap intra"], ["dequant fragments"]])


def _text(head_dim, head_dim_v, dtype, mask, schedule: list[str], queries=None, extra=()) -> str:
    lines = [f"head_dim = {head_dim}", f"head_dim_v = {head_dim_v}", f"dtype = {dtype}", f"mask = {mask}"]
    if queries is not None:
        lines.append(f"queries = {queries}")
    lines += list(extra)
    return ("attention k {\n" + "".join(f"    {line}\n" for line in lines) + "    schedule {\n"
            + "".join(f"        {line}\n" for line in schedule) + "    }\n}\n")


def _warps_for(draw, tile: int) -> int:
    """Warp counts that give each warp whole 16-row (or 16-key) slices: check's own rule, so the
    examples reach the layout's rules."""
    return draw(st.sampled_from([w for w in (1, 2, 4, 8, 16) if tile % (16 * w) == 0]))


@st.composite
def fa2_texts(draw, mma):
    if mma == "wgmma":   # mostly whole 64-column panels and 64 rows per warpgroup: check's own rules
        d = draw(st.one_of(st.sampled_from([64, 128, 192, 256]), LIKELY_DIMS))
        warps = draw(st.sampled_from([4, 8, 16]))
        tile_q = draw(st.sampled_from([warps // 4 * 64, warps // 4 * 64, 128]))
    else:
        d = draw(LIKELY_DIMS)
    dv = draw(st.one_of(st.just(d), st.just(d), HEAD_DIMS))
    if mma != "wgmma":
        tile_q = draw(TILES)
        warps = _warps_for(draw, tile_q)
    return _text(d, dv, draw(DTYPES), draw(MASKS), _with(draw, [
        "order q, kv", f"tile q = {tile_q}, kv = {draw(TILES)}", f"warps {warps} along q",
        f"pipeline {draw(STAGES)} stages via cp.async", f"mma {mma}"]), extra=draw(SERVING) + draw(FP8))


def _with(draw, schedule: list[str]) -> list[str]:
    """`schedule` with one statement of another family's in place of its own sometimes."""
    other = draw(OTHER_STATEMENTS)
    keys = {line.split()[0] for line in other}
    return [line for line in schedule if line.split()[0] not in keys] + other


@st.composite
def fa1_texts(draw):
    d = draw(LIKELY_DIMS)
    tile_q, tile_kv, axis = draw(TILES), draw(TILES), draw(st.sampled_from(["q", "kv"]))
    warps = _warps_for(draw, tile_q if axis == "q" else tile_kv)
    return _text(d, draw(st.one_of(st.just(d), st.just(d), HEAD_DIMS)), draw(DTYPES), draw(MASKS), _with(draw, [
        "order kv, q", f"tile q = {tile_q}, kv = {tile_kv}", f"warps {warps} along {axis}",
        f"pipeline {draw(STAGES)} stages via cp.async"]), extra=draw(SERVING) + draw(FP8))


@st.composite
def decode_texts(draw):
    d = draw(LIKELY_DIMS)
    split, tile_kv = draw(st.sampled_from(["1", "4", "auto"])), draw(TILES)
    fp8 = draw(FP8)
    convert = [f"dequant {draw(st.sampled_from(['shared', 'fragments']))}"] if fp8 and draw(st.booleans()) else []
    return _text(d, draw(st.one_of(st.just(d), st.just(d), HEAD_DIMS)), draw(DTYPES),
                 draw(st.sampled_from(["none", "causal"])), _with(draw, [
        f"tile q = {draw(st.sampled_from([16, 16, 32]))}, kv = {tile_kv}", f"warps {_warps_for(draw, tile_kv)} along kv",
        f"pipeline {draw(STAGES)} stages via cp.async", f"split kv = {split}"] + convert),
        queries=draw(st.integers(1, 16)), extra=draw(SERVING) + fp8)


@st.composite
def hopper_texts(draw):
    consumers = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([64, 128, 256, 96]))
    dv = draw(st.sampled_from([d, d, 64]))
    overlap = draw(st.sampled_from([[], ["overlap intra"], ["overlap pingpong"], ["overlap pingpong, intra"]]))
    return _text(d, dv, draw(DTYPES), draw(MASKS), _with(draw, [
        f"tile q = {draw(st.sampled_from([64 * consumers, 64 * consumers, 128]))}, "
        f"kv = {draw(st.sampled_from([64, 80, 128, 176, 256]))}",
        f"warpgroups producer 1, consumer {consumers}", f"pipeline {draw(st.sampled_from([2, 3, 4]))} stages"]
        + overlap), extra=draw(SERVING) + draw(FP8))


def _rules_only(spec, hints=True):
    """rules.validate without the layout and without the family's features (families.feature_refusal): the
    rules between written values only, so that every setting a family does not take reaches lowering,
    which must refuse it as check does."""
    written = {key for key, _ in spec.spans}
    for rule in rules.RULES:
        if rule is rules._rule_family_features:
            continue
        broken = rule(spec, written)
        if broken:
            raise SpecError(broken[1])


def _verdicts(text: str):
    """(spec before the layout rules or None, check's verdict, lowering's verdict, plan)."""
    with mock.patch.object(space, "validate", _rules_only):
        try:
            (spec,) = parse_text(text, "k.tile")
        except SpecError:
            return None, None, None, None   # refused before any size is known: not this test's business
    try:
        parse_text(text, "k.tile")
        accepted = True
    except SpecError:
        accepted = False
    try:
        plan, lowered = lower(spec), True
    except SpecError:
        plan, lowered = None, False
    return spec, accepted, lowered, plan


def _same_answer(text: str) -> None:
    spec, accepted, lowered, plan = _verdicts(text)
    if spec is None:
        return
    assert accepted == lowered, text
    if plan is not None:
        declared = re.search(r"static constexpr u32 SMEM_BYTES = (\d+);", render(plan))
        assert int(declared.group(1)) == plan.launch.smem_bytes == layout_of(spec).smem_bytes, text


PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(fa2_texts("mma.sync"))
def test_fa2_mma_sync_check_accepts_exactly_what_lowers(text):
    _same_answer(text)


@PROPERTY
@given(fa2_texts("wgmma"))
def test_fa2_wgmma_check_accepts_exactly_what_lowers(text):
    _same_answer(text)


@PROPERTY
@given(fa1_texts())
def test_fa1_check_accepts_exactly_what_lowers(text):
    _same_answer(text)


@PROPERTY
@given(decode_texts())
def test_decode_check_accepts_exactly_what_lowers(text):
    _same_answer(text)


@PROPERTY
@given(hopper_texts())
def test_hopper_check_accepts_exactly_what_lowers(text):
    _same_answer(text)


def test_buffers_fit_and_do_not_overlap_unless_reused():
    text = _text(96, 96, "bf16", "none", ["order q, kv", "tile q = 128, kv = 64", "warps 8 along q",
                                           "pipeline 3 stages via cp.async"])
    lay = layout_of(parse_text(text, "k.tile")[0])
    counted = sorted((b for b in lay.buffers if not b.reuses), key=lambda b: b.offset)
    for a, b in zip(counted, counted[1:]):
        assert a.offset + a.bytes <= b.offset and b.offset % b.align == 0
    assert counted[-1].offset + counted[-1].bytes <= lay.smem_bytes <= lay.smem_limit
    assert lay.buffer("K").bytes == lay.buffer("K").stages * lay.buffer("K").stage_bytes == 3 * 64 * 208


# ---- the head_dim 96 config the issue names: one answer from check, explain and compile ----------

HD96 = """attention hd96 {
    head_dim = 96
    dtype    = bf16
    schedule {
        order    q, kv
        tile     q = 128, kv = 128
        warps    8 along q
        pipeline 4 stages via cp.async
    }
}
"""


@pytest.mark.parametrize("command", [["check"], ["explain"], ["compile", "--emit", "cuda,cubin"]])
def test_hd96_four_stages_is_refused_alike_by_every_command(command, tmp_path, capsys):
    path = tmp_path / "hd96.tile"
    path.write_text(HD96)
    extra = ["-o", str(tmp_path / "out")] if command[0] == "compile" else []
    assert main([*command, str(path), *extra]) == 2
    err = capsys.readouterr().err
    # 128 rows of 96 + 8 pad columns (208 B) for Q and 4 stages of K and V: 9 x 26624 bytes
    assert f"{path}:8:9: error: shared memory: 239616 bytes needed (Q 26624 + K 4x26624 + V 4x26624) > 232448" in err
    assert "at most 3 stages fit" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.tile")), ids=lambda p: p.name)
def test_explain_exits_0_on_every_bundled_spec_and_space(path, capsys):
    assert main(["explain", str(path), "--seqlen", "1024"]) == 0
    out = capsys.readouterr().out
    totals = set(re.findall(r"total\s+(\d+) B\s+\d+% of", out))
    declared = set(re.findall(r"threads, (\d+) B shared memory", out))
    assert declared <= totals   # the generated kernel's shared memory is the budget's, never a second number


def test_explain_wait_text_is_the_number_the_kernel_waits_with():
    text = _text(64, 64, "bf16", "none", ["order q, kv", "tile q = 128, kv = 64", "warps 4 along q",
                                          "pipeline 2 stages via cp.async"])
    from tiledsl.cli.report import explain
    spec = parse_text(text, "k.tile")[0]
    out, plan = explain(spec), lower(spec)
    waits = {op.kind: op.pending for op in plan.loop_body if op.kind.startswith("wait")}
    assert waits == {"wait_k": 1, "wait_v": 2}
    assert "K_j has landed in shared memory (cp.async.wait_group 1;" in out
    assert "V_j has landed in shared memory (cp.async.wait_group 2;" in out
    kv_loop = render(plan).split("kv_loop")[-1]
    assert "cp_async_wait<1>();" in kv_loop and "cp_async_wait<2>();" in kv_loop


# ---- accepted configs compile with nvcc for sm_90a ------------------------------------------------

def _grid() -> list[str]:
    """A spread of configs of every family, the largest shared memory of each family included."""
    texts = []
    for d in (64, 96, 128, 256):
        for tq, tk, w, stages in ((64, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 1)):
            base = ["order q, kv", f"tile q = {tq}, kv = {tk}", f"warps {w} along q", f"pipeline {stages} stages via cp.async"]
            texts.append(_text(d, d, "bf16", "causal", base))
            texts.append(_text(d, d, "bf16", "none", base + ["mma wgmma"]))
            texts.append(_text(d, d, "fp16", "none", ["order kv, q", f"tile q = {tq}, kv = {tk}",
                                                      f"warps 4 along {'kv' if w == 8 else 'q'}",
                                                      f"pipeline {stages} stages via cp.async"]))
            texts.append(_text(d, d, "bf16", "none", [f"tile q = 16, kv = {tk}", "warps 4 along kv",
                                                      f"pipeline {stages} stages via cp.async", "split kv = auto"],
                               queries=1))
    return texts


def _sample_accepted(count: int = 16) -> list:
    plans = []
    for text in _grid():
        try:
            plans.append(lower(parse_text(text, "k.tile")[0]))
        except SpecError:
            continue
    by_family: dict[str, list] = {}
    for plan in plans:
        by_family.setdefault(plan.template, []).append(plan)
    chosen = [max(group, key=lambda p: p.launch.smem_bytes) for group in by_family.values()]
    rest = [p for p in plans if p not in chosen]
    chosen += random.Random(11).sample(rest, min(count - len(chosen), len(rest)))
    return list({p.kernel_name: p for p in chosen}.values())


def test_a_sample_of_accepted_configs_compiles_for_sm_90a():
    if nvcc.nvcc_path() is None:
        if os.environ.get("TILEDSL_REQUIRE_NVCC") == "1":
            raise RuntimeError("TILEDSL_REQUIRE_NVCC=1 but nvcc is not on PATH")
        pytest.skip("nvcc not on PATH")
    plans = _sample_accepted()
    assert len(plans) >= 12 and len({p.template for p in plans}) == 4

    def build(plan):
        try:
            return nvcc.resources(render(plan), plan.kernel_name), None
        except RuntimeError as err:   # static_assert or ptxas error
            return None, f"{plan.kernel_name}: {err}"
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(build, plans))
    failures = [why for _, why in results if why]
    assert not failures, "\n".join(failures)
    for plan, (res, _) in zip(plans, results):
        assert plan.launch.smem_bytes + res.static_shared_bytes <= 232448
