"""`backward { }` in the DSL: what it parses to, the checker's errors (at the DSL line, with a
hint), search spaces, and that a forward-only spec's name and hash are what they were."""
from __future__ import annotations

import re

import pytest

from tiledsl.errors import SpecError
from tiledsl.cli.report import explain
from tiledsl.frontend.parse import load_spec, parse_ast, parse_text
from tiledsl.spec import BackwardSchedule, DqAccumulate, KernelSpec, LoopOrder, Mma, Problem, Schedule


def kernel(backward: str, schedule: str = "tile q = 128, kv = 64") -> str:
    body = "".join(f"        {line}\n" for line in backward.split(";") if line.strip())
    return (f"attention k {{\n    head_dim = 64\n    mask = causal\n    schedule {{\n        {schedule}\n    }}\n"
            f"    backward {{\n{body}    }}\n}}\n")


def test_defaults_and_every_statement():
    assert load_spec(kernel("")).backward == BackwardSchedule()
    spec = load_spec(kernel("order kv, q; tile q = 32, kv = 64; warps 4; pipeline 1 stages; mma mma.sync; "
                            "dq accumulate ordered"))
    assert spec.backward == BackwardSchedule(LoopOrder.KV_OUTER, 32, 64, 4, 1, Mma.SYNC, DqAccumulate.ORDERED)
    assert spec.schedule == Schedule()   # the forward's own schedule is untouched
    q_outer = load_spec(kernel("order q, kv")).backward
    assert (q_outer.order, q_outer.tile_q, q_outer.tile_kv) == (LoopOrder.Q_OUTER, 128, 64)
    assert load_spec(kernel("tile q = 64, kv = 128; warps 8; mma wgmma")).backward.mma is Mma.WGMMA


def test_round_trip():
    text = kernel("order kv, q; tile q = 64, kv in {64, 128}; dq accumulate in {atomic, ordered}")
    tree = parse_ast(text)
    assert parse_ast(tree.source()) == tree


def test_forward_name_and_hash_unchanged_without_backward():
    forward = KernelSpec("k", Problem(64, 64), Schedule())
    assert forward.kernel_name == "fa2_d64_bf16_q128_kv64_w4q_s2"
    assert "backward" not in forward.config()
    with_backward = KernelSpec("k", Problem(64, 64), Schedule(), backward=BackwardSchedule())
    assert with_backward.kernel_name == forward.kernel_name + "_bwd_kvq_q64_kv128_w8_s2_atomic"
    assert with_backward.config()["backward"]["dq"] == "atomic"
    assert with_backward.config_hash != forward.config_hash
    ordered = KernelSpec("k", Problem(64, 64), Schedule(), backward=BackwardSchedule(dq=DqAccumulate.ORDERED))
    assert len({forward.config_hash, with_backward.config_hash, ordered.config_hash}) == 3


def test_search_space():
    # tile q = 32: kv = 128 over 4 warps (2 mma tiles each) fits the backward kernel's registers with it
    (space,) = parse_text(kernel("tile q = 32, kv in {64, 128}; warps 4; dq accumulate in {atomic, separate, ordered}"))
    legal, rejected = space.expand()
    assert len(legal) == 6 and not rejected
    assert {s.backward.tile_kv for s in legal} == {64, 128} and {s.schedule.tile_kv for s in legal} == {64}
    assert len({s.kernel_name for s in legal}) == 6
    (space,) = parse_text(kernel("order in {(kv, q), (q, kv)}; tile q = 64, kv = 64; warps 4; "
                                 "dq accumulate in {atomic, ordered}"))
    legal, rejected = space.expand()
    assert len(legal) == 3 and [reason for _, reason in rejected] == [
        "q outer keeps dQ on chip (and sums dK, dV with atomics); `dq accumulate ordered` is for order kv, q"]


@pytest.mark.parametrize("backward,schedule,line,message,hint", [
    ("split kv = 2", "tile q = 128, kv = 64", 8, "the backward schedule has no 'split'", "backward statements"),
    ("tiles q = 64", "tile q = 128, kv = 64", 8, "did you mean 'tile'?", "backward statements"),
    ("head_dim = 64", "tile q = 128, kv = 64", 8, "is a problem setting", ""),
    ("dq accumulate atomc", "tile q = 128, kv = 64", 8, "did you mean 'atomic'?", "atomic, separate, ordered"),
    ("order q, kv;dq accumulate separate", "tile q = 128, kv = 64", 9, "q outer keeps dQ on chip", "order kv, q"),
    ("warps 16", "tile q = 128, kv = 64", 8, "a warp needs a multiple of 16", "use warps 8"),
    ("tile q = 64, kv = 128;warps 2;mma wgmma", "tile q = 128, kv = 64", 9, "whole warpgroups", "warps 8"),
    ("tile q = 24", "tile q = 128, kv = 64", 8, "tile q must be a positive multiple of 16", ""),
    ("warps 4 along q", "tile q = 128, kv = 64", 8, "`along` is not for it", ""),
    ("tile q = 64;tile kv = 64", "tile q = 128, kv = 64", 9, "duplicate key 'tile' in backward", ""),
    ("dq accumulate", "tile q = 128, kv = 64", 8, "expected", "dq accumulate atomic"),
    ("", "dq accumulate atomic", 5, "'dq' is a backward statement", "dq accumulate atomic"),
])
def test_errors_point_at_the_line(backward, schedule, line, message, hint):
    with pytest.raises(SpecError) as err:
        parse_text(kernel(backward, schedule), "k.tile")
    assert err.value.span.line == line and message in err.value.message and hint in (err.value.hint or "")


def test_decode_has_no_backward():
    text = "attention d {\n    head_dim = 128\n    queries = 1\n    backward {\n    }\n}\n"
    with pytest.raises(SpecError, match="no backward pass") as err:
        parse_text(text, "d.tile")
    assert err.value.span.line == 4


def test_explain_prints_the_backward():
    spec = load_spec(kernel("dq accumulate separate"))
    text = explain(spec, seqlen_q=256)
    assert "backward loop nest:" in text and "kernel backward_dq" in text and "dS = P * (dP - D_i)" in text
    assert "backward loop nest:" not in explain(load_spec(kernel("").replace("    backward {\n    }\n", "")),
                                                seqlen_q=256)


@pytest.mark.parametrize("backward", ["", "dq accumulate separate", "tile q = 64, kv = 128; warps 8; mma wgmma"])
def test_explain_prints_the_backward_kernels_budget(backward):
    """The main kernel's shared memory is what the lowering launches with; resident blocks >= 1 (the
    wgmma estimate lists registers whose lifetimes never overlap: the peak live set decides)."""
    from tiledsl.lower.backward import lower_backward
    spec = load_spec(kernel(backward))
    text = explain(spec, seqlen_q=256)
    section = text[text.index("backward main kernel:"):]
    total = int(re.search(r"total\s+(\d+) B", section).group(1))
    assert total == lower_backward(spec).launch.smem_bytes
    assert re.search(r"\b([1-9]) block\(s\) resident per SM", section)
    assert ("dQ kernel (`dq accumulate separate`)" in section) == ("separate" in backward)


def test_explain_says_why_no_backward_kernel_is_generated():
    text = explain(load_spec(kernel("dq accumulate ordered")), seqlen_q=256)
    assert "backward loop nest:" in text and "backward kernels: none generated (`dq accumulate ordered` has no template" in text
