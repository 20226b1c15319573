"""The score and mask modifications in the DSL: each built-in and the expression language parse to the
Modifications they mean, print back as text that parses to the same tree, stay out of the config,
hash and kernel name while unset, and every mistake is one error at the text at fault."""
from __future__ import annotations

import pytest
from hypothesis import given, settings

from tiledsl.errors import SpecError
from tiledsl.frontend.parse import parse_ast, parse_text
from tiledsl.mods.expr import Aux, Const, Type, Var, apply, source
from tiledsl.mods.model import AlibiSlopes, Documents, Modifications
from tiledsl.spec import Mask

from .mods_support import expressions

BASE = "attention k {\n    head_dim = 64\n"


def spec_of(*lines: str, backward: bool = False):
    text = BASE + "".join(f"    {line}\n" for line in lines) + ("    backward {\n    }\n" if backward else "") + "}\n"
    (spec,) = parse_text(text, "k.tile")
    return spec


def error_of(*lines: str, backward: bool = False, error_parts=None):
    text = BASE + "".join(f"    {line}\n" for line in lines) + ("    backward {\n    }\n" if backward else "") + "}\n"
    with pytest.raises(SpecError) as info:
        parse_text(text, "bad.tile")
    return error_parts(info.value.render())


def test_every_builtin_sets_its_field():
    spec = spec_of("softcap = 30", "alibi = slopes", "sinks = per_head", "dropout = 0.1",
                   "mask = window(left = 64, right = 0) & document(bounds) & blocks(q = 128, kv = 64)")
    p = spec.problem
    assert p.mask is Mask.WINDOW and (p.window_left, p.window_right) == (64, 0)
    assert p.mods == Modifications(softcap=30.0, alibi=AlibiSlopes.GIVEN, sinks=True, dropout=0.1,
                                   document=Documents.BOUNDS, blocks=(128, 64))
    assert [a.name for a in p.mods.aux_tensors()] == ["alibi_slopes", "sinks", "document_bounds", "block_mask"]
    assert spec_of("mask = prefix(256)").problem.mods == Modifications(prefix=256)
    assert spec_of("mask = prefix(length = 16)").problem.mods.prefix == 16
    assert spec_of("mask = causal & document").problem.mods.document is Documents.IDS
    assert spec_of("mask = blocks(64)").problem.mods.blocks == (64, 64)
    assert spec_of("alibi = geometric").problem.mods.user_aux() == ()


def test_expressions_become_typed_trees_with_their_aux_tensors():
    spec = spec_of("score_mod = score + bias[h, q_idx - kv_idx + 4095]",
                   "mask_mod = doc[b, kv_idx] == doc[b, q_idx] | kv_idx == 0")
    mods = spec.problem.mods
    i, j = Var("q_idx"), Var("kv_idx")
    assert mods.score_mod == apply("add", Var("score"), Aux("bias", (Var("h"), apply(
        "add", apply("sub", i, j), Const(4095))), Type.FLOAT))
    assert mods.mask_mod.type is Type.BOOL
    assert [(a.name, a.rank, a.dtype) for a in mods.aux_tensors()] == [("bias", 2, Type.FLOAT), ("doc", 2, Type.INT)]


def test_unset_modifications_keep_config_hash_and_name():
    plain = spec_of("mask = causal")
    assert "mods" not in plain.config()["problem"] and "softcap" not in plain.kernel_name
    capped = spec_of("mask = causal", "softcap = 30")
    assert capped.config()["problem"]["mods"] == {"softcap": 30.0}
    assert capped.config_hash != plain.config_hash
    assert "_causal_softcap30_" in capped.kernel_name
    a = spec_of("score_mod = score + bias[h, kv_idx]").kernel_name
    b = spec_of("score_mod = score - bias[h, kv_idx]").kernel_name
    assert a != b and "_smod" in a


def test_equal_text_is_an_equal_spec_and_1_is_not_1_point_0():
    assert spec_of("score_mod = score * 2") == spec_of("score_mod   =   score*2")
    assert spec_of("score_mod = score * 2") != spec_of("score_mod = score * 2.0")


@pytest.mark.parametrize("text", [
    "score_mod = score + bias[h, min(max(q_idx - kv_idx, -64), 64) + 64] * 0.5 - -1",
    "mask_mod = kv_idx <= q_idx & ~(q_idx - kv_idx > 256) | kv_idx == 0",
    "score_mod = where(score > 0, tanh(score / 30) * 30, score) / (1 + exp(-(score - 1)))",
    "mask_mod = q_idx // 64 == kv_idx // 64 & (q_idx % 3 != 1)",
    "mask = window(left = 8) & prefix(3) & blocks(q = 16, kv = 32)",
])
def test_expression_text_round_trips(text):
    tree = parse_ast(BASE + f"    {text}\n}}\n")
    assert parse_ast(tree.source()) == tree


@settings(max_examples=300, deadline=None)
@given(expressions(Type.FLOAT))
def test_any_score_tree_prints_as_text_that_parses_back_to_it(expr):
    (spec,) = parse_text(BASE + f"    score_mod = {source(expr)}\n}}\n")
    assert spec.problem.mods.score_mod == expr


@settings(max_examples=300, deadline=None)
@given(expressions(Type.BOOL, score=False))
def test_any_mask_tree_prints_as_text_that_parses_back_to_it(expr):
    (spec,) = parse_text(BASE + f"    mask_mod = {source(expr)}\n}}\n")
    assert spec.problem.mods.mask_mod == expr


@pytest.mark.parametrize("line, column, message, underlined", [
    ("score_mod = score + q_id", 25, "unknown name 'q_id'; did you mean 'q_idx'?", "q_id"),
    ("score_mod = score + bias", 25, "unknown name 'bias'", "bias"),
    ("mask_mod = score > 0", 16, "mask_mod can't read score", "score"),
    ("mask_mod = kv_idx + 1", 16, "mask_mod is a condition", "kv_idx + 1"),
    ("score_mod = kv_idx <= q_idx", 17, "score_mod gives the new score (a number)", "kv_idx <= q_idx"),
    ("score_mod = score + bias[h, kv_idx] + bias[h]", 43, "'bias' is read with 1 indices here and 2", "bias[h]"),
    ("score_mod = tanh(score, 2)", 17, "tanh takes 1 argument, got 2", "tanh(score, 2)"),
    ("score_mod = tanhh(score)", 17, "unknown function 'tanhh'; did you mean 'tanh'?", "tanhh"),
    ("score_mod = score + bias[h, q_idx / 2]", 33, "an index is an int; q_idx / 2 is a float", "q_idx / 2"),
    ("score_mod = score + (kv_idx <= q_idx)", 26, "`+` takes numbers; got a float and a condition",
     "kv_idx <= q_idx"),
    ("mask_mod = kv_idx // kv_len == 0", 26, "`//` divides by a positive int constant", "kv_len"),
    ("score_mod = score + bias[h, bias2[kv_idx]]", 33, "an index can't read an aux tensor", "bias2[kv_idx]"),
    ("score_mod = score + bias[int(score)]", 30, "an index can't depend on score", "int(score)"),
    ("score_mod = score + tanh", 25, "'tanh' is a function", "tanh"),
    ("score_mod = score[0]", 17, "'score' is not a tensor", "score"),
    ("score_mod = score + sinks[h]", 25, "'sinks' is the tensor of a built-in modification", "sinks"),
    ("score_mod = score + tanh(x = 1)", 30, "tanh(...) takes positional arguments", "x = 1"),
    ("mask = causal | document", 12, "a mask joins its terms with `&`, not `|`", "causal | document"),
    ("mask = causal & window(left = 2)", 21, "mask base term 'window' given twice", "window(left = 2)"),
    ("mask = document & document(bounds)", 23, "'document' given twice", "document(bounds)"),
    ("mask = none & document", 12, "`none` adds nothing", "none"),
    ("mask = docment", 12, "unknown mask 'docment'; did you mean 'document'?", "docment"),
    ("mask = prefix(0)", 19, "prefix must be an integer >= 1, got 0", "0"),
    ("mask = prefix(256) & causal", 26, "prefix(N) is causal with the first N keys visible", "causal"),
    ("mask = blocks(q = 100, kv = 128)", 23, "a block size must be a positive multiple of 16, got 100", "100"),
    ("mask = blocks(q = 128)", 12, "blocks needs both sizes", "blocks(q = 128)"),
    ("mask = document(idz)", 21, "unknown document source 'idz'; did you mean 'ids'?", "idz"),
    ("mask = window(256)", 12, "mask 'window' takes named sizes", "window(256)"),
    ("softcap = -1", 15, "softcap must be a finite number > 0, got -1", "-1"),
    ("softcap = causal", 15, "softcap takes a number", "causal"),
    ("dropout = 1", 15, "dropout is a probability in (0, 1), got 1", "1"),
    ("alibi = geometrik", 13, "unknown alibi 'geometrik'; did you mean 'geometric'?", "geometrik"),
    ("sinks = yes", 13, "unknown sinks 'yes'", "yes"),
])
def test_mistakes_are_one_error_at_the_text_at_fault(line, column, message, underlined, error_parts):
    error = error_of(line, error_parts=error_parts)
    assert (error["file"], error["line"], error["column"]) == ("bad.tile", 3, column), error
    assert message in error["message"]
    assert error["underlined"] == underlined


def test_an_aux_tensor_serves_one_expression(error_parts):
    error = error_of("mask_mod = doc[kv_idx] == doc[q_idx]", "score_mod = score + doc[h]", error_parts=error_parts)
    assert (error["line"], error["column"], error["underlined"]) == (4, 25, "doc")
    assert "read by mask_mod (as ints) and score_mod (as floats)" in error["message"]


@pytest.mark.parametrize("text, underlined, message", [
    ("score_mod = floor(score) + 1", "floor(score)", "`floor` of a value that depends on score has no gradient"),
    ("score_mod = score + ceil(score * 2)", "ceil(score * 2)", "`ceil` of a value that depends on score"),
    ("score_mod = bias[h, kv_idx]", "bias[h, kv_idx]", "score_mod does not read score"),
])
def test_a_spec_with_a_backward_refuses_a_score_mod_without_a_gradient(text, underlined, message, error_parts):
    spec_of(text)   # forward only: fine
    error = error_of(text, backward=True, error_parts=error_parts)
    assert message in error["message"] and error["underlined"] == underlined


def test_where_of_a_score_condition_has_a_gradient():
    spec = spec_of("score_mod = where(score > 5, 5 + (score - 5) * 0.1, score)", backward=True)
    assert spec.problem.mods.score_derivative() is not None


def test_check_prints_the_modifications_and_aux(write_spec, capsys):
    from tiledsl.cli.main import main
    path = write_spec(BASE + "    softcap = 30\n    score_mod = score + bias[h, kv_idx]\n}\n")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "modifies: softcap = 30.0; score_mod = score + bias[h, kv_idx]" in out
    assert "aux:      bias (2-d float32)" in out
