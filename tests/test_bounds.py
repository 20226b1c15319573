"""No value a kernel cannot hold: every integer and float the DSL and the Python API hand a kernel is
bounded at the spec line (or the argument) by what its C constant holds, so no kernel is built from a
truncated value; a constant outside its C type is a bug the plan refuses to build."""
from __future__ import annotations

import math
import re
import time

import pytest

import tiledsl
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.families import lower
from tiledsl.codegen.render import render
from tiledsl.frontend.parse import parse_text
from tiledsl.lower.plan import Constant
from tiledsl.spec import MAX_SPLIT_KV, MAX_TILE, MAX_WINDOW, SCALE_RANGE


def _spec(settings: str, schedule: str = "") -> str:
    return f"attention k {{\n    head_dim = 64\n{settings}    schedule {{\n{schedule}    }}\n}}\n"


@pytest.mark.parametrize("text, where, message", [
    (_spec("    mask = window(left = 4294967296)\n"), "3:26", "window left must be an integer in 0..1,073,741,824"),
    (_spec("    mask = window(left = 9223372036854775808)\n"), "3:26", "window left must be an integer in 0.."),
    (_spec(f"    mask = window(right = {MAX_WINDOW + 1})\n"), "3:27", "window right must be an integer in 0.."),
    (_spec("    queries = 1\n", "        split kv = 1000000000\n"), "5:20", f"split kv must be an integer in 1..{MAX_SPLIT_KV}"),
    (_spec("", "        tile q = 100000\n"), "4:18", f"a positive multiple of 16 up to {MAX_TILE}"),
    (_spec("    scale = 1e-300\n"), "3:13", "scale must lie in 1e-30..1e+30"),
    (_spec("    scale = 1e300\n"), "3:13", "scale must lie in"),
    (_spec("    scale = " + "9" * 100 + "\n"), "3:13", "scale must lie in"),
])
def test_values_past_their_c_type_are_refused_at_the_value(text, where, message):
    with pytest.raises(SpecError) as err:
        parse_text(text, "k.tile")
    assert err.value.render().startswith(f"k.tile:{where}: error: "), err.value.render()
    assert message in err.value.message


def test_the_largest_window_and_split_are_held_exactly():
    (spec,) = parse_text(_spec(f"    mask = window(left = {MAX_WINDOW}, right = {MAX_WINDOW})\n"))
    source = render(lower(spec))
    assert f"static constexpr int WINDOW_LEFT = {MAX_WINDOW};" in source
    assert f"static constexpr int WINDOW_RIGHT = {MAX_WINDOW};" in source
    (decode,) = parse_text(_spec("    queries = 1\n", f"        split kv = {MAX_SPLIT_KV}\n"))
    assert f"split{MAX_SPLIT_KV}" in decode.kernel_name
    low, high = SCALE_RANGE
    for scale in (low, high):
        (scaled,) = parse_text(_spec(f"    scale = {scale!r}\n"))
        assert re.search(r"static constexpr float SCALE = [0-9.e+-]+f;", render(lower(scaled)))


def test_explain_of_the_largest_split_finishes_fast():
    from tiledsl.cli.report import explain
    (spec,) = parse_text(_spec("    queries = 1\n", f"        split kv = {MAX_SPLIT_KV}\n"))
    start = time.monotonic()
    text = explain(spec, seqlen_kv=1 << 18)
    assert f"split kv = {MAX_SPLIT_KV}" in text and time.monotonic() - start < 10


@pytest.mark.parametrize("kind, value", [("int", 2**31), ("int", -2**31 - 1), ("u32", -1), ("u32", 2**32),
                                         ("float", math.nan), ("float", math.inf), ("float", 1e-300)])
def test_a_constant_outside_its_c_type_is_never_built(kind, value):
    with pytest.raises(ValueError, match="C "):
        Constant("X", kind, value)


def test_constants_at_the_edges_of_their_c_types_are_built():
    for kind, value in (("int", 2**31 - 1), ("int", -2**31), ("u32", 2**32 - 1), ("float", 0.0), ("float", 3e38)):
        assert Constant("X", kind, value).value == value


# ---- the Python API: every argument checked before a spec is built (no GPU, no arrays touched) -----------

class Untouchable:
    """An input the checks must not reach: any attribute access fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the argument checks read the tensor ({name}) before refusing")


X = Untouchable()
BAD_ARGUMENTS = [
    ({"scale": math.nan}, "scale must be None"), ({"scale": 0.0}, "scale must be None"),
    ({"scale": -1.0}, "scale must be None"), ({"scale": math.inf}, "scale must be None"),
    ({"scale": "0.1"}, "scale must be None"), ({"scale": True}, "scale must be None"),
    ({"scale": 1e-300}, "scale must be None"),
    ({"window": (-5, 0)}, "window left must be an integer in 0.."),
    ({"window": (0, 2**31)}, "window right must be an integer in 0.."),
    ({"window": (1.5, 0)}, "window left must be an integer"), ({"window": (True, 0)}, "window left must be"),
    ({"window": 128}, "window must be (left, right)"), ({"window": (1, 2, 3)}, "window must be (left, right)"),
    ({"causal": "yes"}, "causal must be True or False"), ({"causal": None}, "causal must be True or False"),
    ({"causal": True, "window": (4, 0)}, "not both"),
]


def _calls():
    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.serving.prefill import paged_prefill
    return {
        "attention": lambda **kw: tiledsl.attention(X, X, X, **kw),
        "paged_attention": lambda **kw: tiledsl.paged_attention(X, X, X, X, X, **kw),
        "paged_prefill": lambda **kw: paged_prefill(X, X, X, X, X, **kw),
        "varlen_attention": lambda **kw: tiledsl.varlen_attention(X, X, X, X, X, **kw),
        "attention_backward": lambda **kw: attention_backward(X, X, X, X, X, X, **kw),
    }


@pytest.mark.parametrize("api", ["attention", "paged_attention", "paged_prefill", "varlen_attention",
                                 "attention_backward"])
@pytest.mark.parametrize("kwargs, message", BAD_ARGUMENTS, ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_every_api_refuses_a_bad_argument_by_name(api, kwargs, message):
    with pytest.raises(RuntimeInputError) as err:
        _calls()[api](**kwargs)
    assert str(err.value).startswith(f"{api}: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("api, switch", [("attention", "return_lse"), ("attention", "deterministic"),
                                         ("paged_attention", "return_lse"), ("paged_prefill", "return_lse"),
                                         ("varlen_attention", "return_lse"),
                                         ("attention_backward", "deterministic")])
def test_switches_are_true_or_false(api, switch):
    with pytest.raises(RuntimeInputError, match=f"{api}: {switch} must be True or False, got 1"):
        _calls()[api](**{switch: 1})


def test_good_arguments_come_back_as_plain_values():
    import numpy as np
    from tiledsl.runtime.arguments import mask_arguments
    from tiledsl.spec import Mask
    assert mask_arguments("f", np.bool_(True), None, np.float32(0.5)) == (Mask.CAUSAL, None, 0.5)
    assert mask_arguments("f", False, [np.int64(MAX_WINDOW), 0], None) == (Mask.WINDOW, (MAX_WINDOW, 0), None)
    assert mask_arguments("f", False, None, 1) == (Mask.NONE, None, 1.0)
