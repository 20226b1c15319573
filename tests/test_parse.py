"""The grammar and the syntax tree: round trips of every form, values as written, spans, and
syntax errors in words with a caret under the right text."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiledsl.frontend import syntax as ast
from tiledsl.errors import SpecError
from tiledsl.frontend.parse import parse_ast, parse_text
from tiledsl.spec import AUTO, Axis, CopyVia, DType, LoopOrder, Mask, Problem, Schedule

# Not imported from conftest: tests/ may or may not be a package.
SPEC_FILES = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.tile"))

# Every key, and every value form, in one block (a space: it has choices).
ALL_FORMS = """\
# every form the grammar knows
attention all_forms {   # a trailing comment
    head_dim   = 128

    head_dim_v = 64
    dtype      = fp16
    mask       = window(left = 256, right = 0)
    scale      = 0.125
    queries    = 16
    schedule {
        # a comment line inside a block
        order      in {(q, kv), (kv, q)}
        tile       q in {64, 128}, kv = 64
        warps      in {4, 8} along in {q, kv}
        pipeline   in {1, 2, 3} stage via in {cp.async, tma}
        warpgroups producer 1 regs in {24, 32}, consumer 2
        overlap    pingpong, intra
        split      kv in {1, 4, auto}
    }
}
attention second { head_dim = 64
}
"""


def kernel(settings: str = "", schedule: str = "", head_dim: str = "head_dim = 64"):
    """The one KernelSpec of a block with `settings` and (if given) a schedule block."""
    block = f"attention k {{\n    {head_dim}\n"
    block += "".join(f"    {line}\n" for line in settings.splitlines())
    if schedule:
        block += "    schedule {\n" + "".join(f"        {line}\n" for line in schedule.splitlines()) + "    }\n"
    (spec,) = parse_text(block + "}\n", "k.tile")
    return spec


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_bundled_specs_round_trip(path):
    tree = parse_ast(path.read_text(), str(path))
    assert parse_ast(tree.source()) == tree


def test_every_form_round_trips():
    tree = parse_ast(ALL_FORMS, "all.tile")
    assert parse_ast(tree.source()) == tree
    assert [a.name.text for a in tree.attentions] == ["all_forms", "second"]


def test_every_form_parses_to_its_nodes():
    attention = parse_ast(ALL_FORMS).attentions[0]
    settings = {item.key.text: item for item in attention.items if isinstance(item, ast.Setting)}
    assert list(settings) == ["head_dim", "head_dim_v", "dtype", "mask", "scale", "queries"]
    assert settings["scale"].value == ast.Number(0.125, "0.125")
    assert settings["mask"].value == ast.Call(ast.Word("window"), (
        ast.Arg(ast.Word("left"), ast.Number(256, "256")), ast.Arg(ast.Word("right"), ast.Number(0, "0"))))
    (schedule,) = [item for item in attention.items if isinstance(item, ast.ScheduleBlock)]
    order, tile, warps, pipeline, warpgroups, overlap, split = schedule.statements
    q, kv = ast.Word("q"), ast.Word("kv")
    assert order.value == ast.Choice((ast.Pair(q, kv), ast.Pair(kv, q)))
    assert tile.dims == (ast.Dim(q, ast.Choice((ast.Number(64, ""), ast.Number(128, "")))), ast.Dim(kv, ast.Number(64, "")))
    assert warps.axis == ast.Choice((q, kv))
    assert pipeline.copy == ast.Choice((ast.Word("cp.async"), ast.Word("tma")))
    assert warpgroups.roles[1] == ast.Role(ast.Word("consumer"), ast.Number(2, ""), None)
    assert overlap.flags == (ast.Word("pingpong"), ast.Word("intra"))
    assert split.dim.value.options[-1] == ast.Word("auto")


def test_defaults_are_spec_defaults():
    spec = kernel()
    assert spec.problem == Problem(head_dim_qk=64, head_dim_v=64)
    assert spec.schedule == Schedule()


@pytest.mark.parametrize("settings, schedule, check", [
    ("", "", lambda s: s.problem.head_dim_v == 64),
    ("head_dim_v = 32", "", lambda s: (s.problem.head_dim_qk, s.problem.head_dim_v) == (64, 32)),
    ("dtype = fp16", "", lambda s: s.problem.dtype is DType.FP16),
    ("dtype = bf16", "", lambda s: s.problem.dtype is DType.BF16),
    ("mask = none", "", lambda s: s.problem.mask is Mask.NONE),
    ("mask = causal", "", lambda s: s.problem.mask is Mask.CAUSAL),
    ("mask = window(left = 256, right = 0)", "",
     lambda s: (s.problem.mask, s.problem.window_left, s.problem.window_right) == (Mask.WINDOW, 256, 0)),
    ("mask = window(right = 8)", "", lambda s: (s.problem.window_left, s.problem.window_right) == (0, 8)),
    ("scale = 0.125", "", lambda s: s.problem.softmax_scale == 0.125 and s.problem.scale == 0.125),
    ("scale = 2", "", lambda s: s.problem.softmax_scale == 2.0),
    ("scale = 1e-2", "", lambda s: s.problem.softmax_scale == 0.01),
    ("", "", lambda s: s.problem.scale == 64 ** -0.5),
    ("queries = 1", "", lambda s: s.problem.queries_per_seq == 1 and s.family.value == "decode"),
    ("queries = 16", "split kv = 8", lambda s: s.schedule.split_kv == 8),
    ("queries = 4", "split kv = auto", lambda s: s.schedule.split_kv == AUTO),
    ("", "order q, kv", lambda s: s.schedule.order is LoopOrder.Q_OUTER and s.family.value == "fa2"),
    ("", "order kv, q", lambda s: s.schedule.order is LoopOrder.KV_OUTER and s.family.value == "fa1"),
    ("", "tile q = 64, kv = 32", lambda s: (s.schedule.tile_q, s.schedule.tile_kv) == (64, 32)),
    ("", "tile kv = 128", lambda s: (s.schedule.tile_q, s.schedule.tile_kv) == (128, 128)),
    ("", "tile kv = 32\nwarps 2 along q", lambda s: (s.schedule.warps, s.schedule.warp_axis) == (2, Axis.Q)),
    ("", "warps 8", lambda s: (s.schedule.warps, s.schedule.warp_axis) == (8, Axis.Q)),
    ("", "order kv, q\nwarps 4 along kv", lambda s: s.schedule.warp_axis is Axis.KV),
    ("", "pipeline 3 stages", lambda s: (s.schedule.stages, s.schedule.copy) == (3, CopyVia.CP_ASYNC)),
    ("", "pipeline 1 stage via cp.async", lambda s: s.schedule.stages == 1),
    ("", "tile q = 192\nwarpgroups producer 1 regs 32, consumer 3 regs 160\npipeline 2 stages via tma",
     lambda s: (s.schedule.producer_warpgroups, s.schedule.producer_regs, s.schedule.consumer_warpgroups,
                s.schedule.consumer_regs, s.schedule.copy) == (1, 32, 3, 160, CopyVia.TMA)),
    ("", "warpgroups producer 1, consumer 2\noverlap intra", lambda s: s.schedule.intra_overlap and not s.schedule.pingpong),
    ("", "warpgroups consumer 2\noverlap pingpong", lambda s: s.schedule.pingpong and s.family.value == "hopper"),
])
def test_each_key_and_value(settings, schedule, check):
    assert check(kernel(settings, schedule))


def test_family_dependent_defaults():
    decode = kernel("queries = 1")
    assert (decode.schedule.warp_axis, decode.schedule.tile_q) == (Axis.KV, 16)
    hopper = kernel(schedule="warpgroups producer 1, consumer 3\ntile q = 192")
    s = hopper.schedule
    assert (s.copy, s.warps, s.producer_regs, s.consumer_regs) == (CopyVia.TMA, 16, 24, 160)
    assert kernel(schedule="warpgroups consumer 2").schedule.consumer_regs == 240


def test_spans_point_at_each_written_key():
    text = "attention k {\n  head_dim = 64\n  dtype = bf16\n  schedule {\n    tile q = 64\n    warps 4\n  }\n}\n"
    (spec,) = parse_text(text, "k.tile")
    assert [key for key, _ in spec.spans] == ["head_dim", "dtype", "tile", "warps"]
    tile = spec.span_of("tile")
    assert (tile.file, tile.line, tile.column, tile.end_line, tile.end_column) == ("k.tile", 5, 5, 5, 16)
    assert spec.span_of("mask") == spec.span and (spec.span.line, spec.span.end_line) == (1, 8)
    assert (spec.source_file, spec.source_text) == ("k.tile", text)


def test_crlf_tabs_and_no_final_newline():
    text = "attention k {\r\n\thead_dim = 64\r\n\tschedule {\r\n\t\ttile q = 64\r\n\t}\r\n}"
    (spec,) = parse_text(text)
    assert spec.schedule.tile_q == 64


def test_empty_and_comment_only_files_hold_no_kernels():
    assert parse_text("") == [] and parse_text("# nothing here\n\n") == []


def syntax_error(text: str, error_parts) -> dict:
    with pytest.raises(SpecError) as info:
        parse_text(text, "bad.tile")
    return error_parts(info.value.render())


@pytest.mark.parametrize("text, line, column, message, underlined", [
    ("attention k {\n  head_dim 128\n}\n", 2, 12, "expected '=' after 'head_dim', found '128'", "128"),
    ("attention k {\n  head_dim =\n}\n", 2, 13, "expected a name or a number after '=', found the end of the line", None),
    ("attention k {\n  head_dim = 64\n  schedule {\n    tile q = 64 kv = 32\n  }\n}\n", 4, 17,
     "expected ',' or a new line after '64', found 'kv'", "kv"),
    ("attention k {\n  head_dim = 64\n  schedule {\n    warps 4 q\n  }\n}\n", 4, 13,
     "expected 'along' or a new line after '4', found 'q'", "q"),
    ("attention k {\n  head_dim = 64\n  schedule {\n    tile q 64\n  }\n}\n", 4, 12,
     "expected '=' or 'in {...}' after 'q', found '64'", "64"),
    ("attention k {\n  head_dim = 6@4\n}\n", 2, 15, "expected a new line after '6', found '@'", "@"),
    ("attention {\n}\n", 1, 11, "expected a name after 'attention', found '{'", "{"),
    ("attention k {\n  head_dim = 64\n  schedule { order q, kv }\n}\n", 3, 26,
     "expected a new line after 'kv', found '}'", "}"),
    ("attention k {\n  head_dim = 64\n", 2, 16, "found the end of the file", None),
    ("attention k {\n  head_dim = 64\n  tile q = 64\n}\n", 3, 3,
     "'tile' is a schedule statement; put it inside `schedule { ... }`", "tile"),
    ("attention k {\n  head_dim = 64\n  schedul {\n  }\n}\n", 3, 3,
     "unknown key 'schedul'; did you mean 'schedule'?", "schedul"),
    ("atention k {\n}\n", 1, 1, "expected `attention NAME {`", "atention"),
    ("attention k {\n  head_dim = 64\n  schedule {\n    split kv in {1, 2\n  }\n}\n", 4, 22,
     "expected ',' or '}' after '2', found the end of the line", None),
])
def test_syntax_errors_say_what_was_expected(text, line, column, message, underlined, error_parts):
    error = syntax_error(text, error_parts)
    assert (error["file"], error["line"], error["column"]) == ("bad.tile", line, column)
    assert message in error["message"]
    if underlined is not None:
        assert error["underlined"] == underlined


def test_syntax_error_hints_show_the_statement():
    error = syntax_error("attention k {\n  head_dim = 64\n  schedule {\n    tile q = 64 kv = 32\n  }\n}\n",
                         lambda rendered: rendered)
    assert "hint: write it like: tile q = 128, kv = 64" in error
    assert "a '}' is missing" in syntax_error("attention k {\n  head_dim = 64\n", lambda r: r)
