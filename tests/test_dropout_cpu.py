"""Dropout without a GPU: templates/philox.cuh and dropout.cuh compiled for the host (tests/dropout_host.cpp)
against mods/philox.py (Random123's known answers, random counters, and the keep mask of a tile of P as one
warp's accumulators hold it), the kernels' constants and routing, the API's keywords, seeds and refusals
through the host stubs, and p = 0's plain kernels."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tiledsl.mods.philox import drop_threshold, keep_mask, philox4x32

ROOT = Path(__file__).resolve().parent.parent
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@functools.lru_cache(maxsize=None)
def host_binary(tile_kv: int, p: float) -> Path:
    out = Path(tempfile.mkdtemp()) / f"dropout_{tile_kv}"
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-Wno-unknown-pragmas", f"-DTILE_KV={tile_kv}",
                    f"-DTHRESHOLD={drop_threshold(p)}u", "-o", str(out), str(ROOT / "tests" / "dropout_host.cpp")],
                   check=True)
    return out


def run(binary: Path, words) -> list[list[int]]:
    text = subprocess.run([str(binary)], input=" ".join(map(str, words)), capture_output=True, text=True,
                          check=True).stdout
    return [[int(x) for x in line.split()] for line in text.splitlines()]


@needs_gxx
def test_the_cuda_philox_gives_random123s_known_answers_and_the_numpy_words():
    binary = host_binary(64, 0.1)
    ones = 0xFFFFFFFF
    known = [((0, 0, 0, 0), (0, 0), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
             ((ones,) * 4, (ones, ones), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd])]
    for counter, key, words in known:
        assert run(binary, ["words", 1, *key, *counter]) == [words]
    rng = np.random.default_rng()
    counters = rng.integers(0, 1 << 32, size=(200, 4), dtype=np.uint64)
    key = [int(x) for x in rng.integers(0, 1 << 32, size=2, dtype=np.uint64)]
    got = np.array(run(binary, ["words", len(counters), *key, *counters.ravel().tolist()]), dtype=np.uint64)
    want = np.stack(philox4x32(tuple(counters.T), key), axis=1).astype(np.uint64)
    np.testing.assert_array_equal(got, want)


@needs_gxx
@pytest.mark.parametrize("tile_kv,p", [(128, 0.1), (80, 0.5), (176, 0.3)])
def test_a_warps_dropout_keeps_what_the_numpy_mask_keeps(tile_kv, p):
    """One warp's 16 rows x tile_kv keys of P (all ones) after dropout_scores: kept exactly where keep_mask is."""
    rng = np.random.default_rng()
    seed, offset = int(rng.integers(0, 1 << 63)) * 2 + 1, int(rng.integers(0, 1 << 40))
    batch, heads, head = int(rng.integers(0, 4)), 5, int(rng.integers(0, 5))
    row0, col0 = int(rng.integers(0, 1000)) * 16, int(rng.integers(0, 50)) * tile_kv
    kept = run(host_binary(tile_kv, p), ["tile", seed & 0xFFFFFFFF, seed >> 32, offset, batch, heads, head, row0, col0])
    rows, cols = np.arange(row0, row0 + 16)[:, None], np.arange(col0, col0 + tile_kv)[None, :]
    want = keep_mask(p, seed, offset, heads, batch, head, rows, cols)
    got = np.zeros_like(want)
    for r, c in kept:
        got[r - row0, c - col0] = True
    np.testing.assert_array_equal(got, want)
    assert 0 < got.mean() < 1


@needs_gxx
@pytest.mark.parametrize("queries,p", [(64, 0.1), (32, 0.5), (128, 0.3)])
def test_the_backwards_transposed_keep_bits_are_the_forwards(queries, p):
    """One warp's S^T (16 keys x `queries` queries) after mark_dropped: kept (positive) exactly where the forward's
    keep_mask is, for the same (query, key)."""
    rng = np.random.default_rng()
    seed, offset = int(rng.integers(0, 1 << 63)), int(rng.integers(0, 1 << 40))
    batch, heads, head = int(rng.integers(0, 4)), 3, int(rng.integers(0, 3))
    key0, query0 = int(rng.integers(0, 500)) * 16, int(rng.integers(0, 50)) * queries
    kept = run(host_binary(queries, p), ["transposed", seed & 0xFFFFFFFF, seed >> 32, offset, batch, heads, head,
                                         key0, query0])
    rows, cols = np.arange(query0, query0 + queries)[:, None], np.arange(key0, key0 + 16)[None, :]
    want = keep_mask(p, seed, offset, heads, batch, head, rows, cols)
    got = np.zeros_like(want)
    for q, k in kept:
        got[q - query0, k - key0] = True
    np.testing.assert_array_equal(got, want)
    assert 0 < got.mean() < 1


# ---- the kernels' constants, the spec and the routing --------------------------------------------------------
def test_the_bundled_spec_builds_a_dropout_forward_and_backward():
    from tiledsl.families import lower
    from tiledsl.frontend.parse import load_spec
    from tiledsl.lower.backward import lower_backward
    s = load_spec(str(ROOT / "specs" / "mods" / "dropout_d128.tile"))
    forward, backward = lower(s), lower_backward(s)
    assert forward.dropout and backward.dropout
    assert "_drop0p1_" in forward.kernel_name and "_drop0p1_" in backward.kernel_name
    assert all("_drop0p1_" in name for name in backward.kernel_names.values())
    for plan in (forward, backward):
        constants = {c.name: c.value for c in plan.constants}
        assert constants["DROP_THRESHOLD"] == drop_threshold(0.1) == 429496729
        assert constants["KEEP_SCALE"] == pytest.approx(1 / 0.9, rel=1e-15)
        names = [p.name for line in plan.parameters for p in line]
        assert names[-2:] == ["dropout_seed", "dropout_offset"]
    assert [op.kind for op in forward.loop_body].index("dropout") == \
        [op.kind for op in forward.loop_body].index("softmax") + 1
    steps = [op.kind for op in backward.loop_body]
    assert steps[steps.index("recompute_p") + 1] == "dropout"


def test_dropout_is_refused_where_no_kernel_spells_it():
    from tiledsl.families import takes_mods
    from tiledsl.layout.backward_ws import ws_mods_refusal
    from tiledsl.mods.model import Modifications
    from tiledsl.spec import Family, SeqLayout
    mods = Modifications(dropout=0.1)
    assert takes_mods(Family.HOPPER, mods) and ws_mods_refusal(mods) == ""
    assert not takes_mods(Family.HOPPER, mods, SeqLayout.VARLEN) and not takes_mods(Family.DECODE, mods)


class Shaped:   # spec_for reads shapes and dtypes only
    def __init__(self, shape, dtype="torch.bfloat16"):
        self.shape, self.dtype = shape, dtype


def test_spec_for_prints_dropout_and_p_0_is_the_plain_spec():
    import tiledsl
    q = Shaped((2, 8, 1000, 128))
    text = tiledsl.spec_for(q, q, q, causal=True, dropout_p=0.25)
    assert re.search(r"^\s*dropout\s+= 0\.25$", text, re.M), text
    assert tiledsl.spec_for(q, q, q, causal=True, dropout_p=0.0) == tiledsl.spec_for(q, q, q, causal=True)
    from tiledsl.frontend.parse import parse_text
    (spec,) = parse_text(text, "<spec_for>")
    assert spec.problem.mods.dropout == 0.25


@pytest.mark.parametrize("bad", [-0.1, 1, 1.5, True, "0.1", float("nan")])
def test_dropout_p_outside_0_1_is_refused(bad):
    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = Shaped((2, 8, 1000, 128))
    with pytest.raises(RuntimeInputError, match=r"dropout_p is the probability of dropping a weight, a number in "
                                                 r"\[0, 1\)"):
        tiledsl.spec_for(q, q, q, dropout_p=bad)


# ---- the API through the host stubs --------------------------------------------------------------------------
@pytest.fixture
def device(tmp_path):
    from tests.host_stubs import stub_device
    with stub_device(tmp_path, {}) as dev:
        yield dev


def launch_rng(launch) -> list[int]:
    return launch[-1][-2:]   # dropout_seed, dropout_offset: the kernels' last two parameters


def test_the_seed_comes_from_torchs_generator_and_each_call_advances_it(device):
    import torch
    import tiledsl
    q = device.tensor((2, 4, 300, 128))
    torch.manual_seed(1234)
    tiledsl.attention(q, q, q, causal=True, dropout_p=0.1)
    name = device.last()[0]
    assert name.startswith("hopper") and "_drop0p1_" in name
    assert launch_rng(device.last()) == [1234, 0]
    tiledsl.attention(q, q, q, causal=True, dropout_p=0.1)   # a warm call: the same launch, the next offset
    assert device.last()[0] == name and launch_rng(device.last()) == [1234, 4]
    torch.manual_seed(1234)                                   # reseeding reproduces the masks
    tiledsl.attention(q, q, q, causal=True, dropout_p=0.1)
    assert launch_rng(device.last()) == [1234, 0]
    tiledsl.attention(q, q, q, causal=True, dropout_p=0.1, dropout_seed=(1 << 64) - 1)
    assert launch_rng(device.last()) == [(1 << 64) - 1, 0]
    assert torch.cuda.default_generators[0].get_offset() == 4   # an explicit seed leaves the generator alone


def test_p_0_runs_the_plain_kernel(device):
    import tiledsl
    q = device.tensor((2, 4, 300, 128))
    tiledsl.attention(q, q, q, causal=True)
    plain = device.last()[0]
    tiledsl.attention(q, q, q, causal=True, dropout_p=0.0)
    assert device.last()[0] == plain and "drop" not in plain


def test_the_backward_redraws_the_forwards_mask(device):
    """Through autograd the backward's main kernel gets the (seed, offset) the forward drew, and its name has
    dropout in it."""
    import torch
    import tiledsl
    torch.manual_seed(77)
    torch.cuda.default_generators[0].set_offset(40)
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    o = tiledsl.attention(q, k, v, causal=True, dropout_p=0.2)
    assert launch_rng(device.last()) == [77, 40]
    tiledsl.attention(q, k, v, causal=True, dropout_p=0.2)   # a later forward moves the generator on
    grads = device.backward(o, device.tensor(o.shape))
    assert all(g is not None for g in grads[:3])
    mains = [device.last(back) for back in range(1, 4) if device.last(back)[0].endswith("_main")]
    assert len(mains) == 1 and "_drop0p2_" in mains[0][0] and launch_rng(mains[0]) == [77, 40]


def test_the_backward_needs_the_forwards_rng(device):
    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q, o, do = (device.tensor((2, 4, 300, 128)) for _ in range(3))
    lse = device.tensor((2, 4, 300), "float32")
    with pytest.raises(RuntimeInputError, match=r"dropout_p needs dropout_rng, the forward's \(seed, offset\)"):
        tiledsl.attention_backward(q, q, q, o, lse, do, causal=True, dropout_p=0.1)
    with pytest.raises(RuntimeInputError, match="dropout_rng is the forward's dropout"):
        tiledsl.attention_backward(q, q, q, o, lse, do, causal=True, dropout_rng=(1, 2))
    with pytest.raises(RuntimeInputError, match="must be an int in 0..2\\^64-1"):
        tiledsl.attention_backward(q, q, q, o, lse, do, causal=True, dropout_p=0.1, dropout_rng=(-1, 0))
    tiledsl.attention_backward(q, q, q, o, lse, do, causal=True, dropout_p=0.1, dropout_rng=(9, 12))
    main = next(device.last(back) for back in range(1, 4) if device.last(back)[0].endswith("_main"))
    assert launch_rng(main) == [9, 12]


def test_dropout_under_graph_capture_is_refused(device, monkeypatch):
    import tiledsl
    from tiledsl.dispatch import dropout
    from tiledsl.errors import RuntimeInputError
    q = device.tensor((2, 4, 300, 128))
    monkeypatch.setattr(dropout, "capturing", lambda like: True)   # (the stubs answer False for every stream)
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match="dropout under CUDA-graph capture would replay one keep mask"):
        tiledsl.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(RuntimeInputError, match="dropout under CUDA-graph capture"):
        tiledsl.attention(q, q, q, dropout_p=0.1, dropout_seed=3)
    assert len(device.launches) == launches


def test_a_held_counter_seeds_arrays_without_a_generator(monkeypatch):
    from tiledsl.dispatch import dropout
    monkeypatch.setattr(dropout, "capturing", lambda like: False)
    first = dropout.draw_rng("attention", object())
    second = dropout.draw_rng("attention", object())
    assert first[0] == second[0] == dropout.HELD_SEED and second[1] == first[1] + dropout.OFFSET_STEP
    assert dropout.draw_rng("attention", object(), 42) == (42, 0)


def test_dropout_is_refused_in_fp8_paged_and_varlen(device):
    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q8 = device.tensor((1, 4, 256, 128), "float8_e4m3fn")
    with pytest.raises(RuntimeInputError, match=r"FP8 \(float8_e4m3fn\) attention has no kernel with score or mask "
                                                r"modifications \(dropout\)"):
        tiledsl.attention(q8, q8, q8, dropout_p=0.1)
    q = device.tensor((1, 4, 256, 128))
    with pytest.raises(RuntimeInputError, match="paged_attention: dropout is a training-time modification"):
        tiledsl.paged_attention(q, q, q, None, None, dropout_p=0.1)
    with pytest.raises(RuntimeInputError, match="varlen_attention: dropout is a training-time modification"):
        tiledsl.varlen_attention(q, q, q, None, None, dropout_p=0.1)
    with pytest.raises(RuntimeInputError, match="dropout_seed seeds dropout; pass dropout_p > 0 with it"):
        tiledsl.attention(q, q, q, dropout_seed=3)


# ---- nvcc ------------------------------------------------------------------------------------------------------
def api_specs(d: int, causal: bool, p: float = 0.1):
    """(forward spec, backward spec) tiledsl.attention picks for bf16 with dropout p on sm_90a."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.spec import DType, Mask
    mods, _ = modifications("attention", dropout_p=p)
    mask = Mask.CAUSAL if causal else Mask.NONE
    forward, _ = tuned_spec("sm_90a", DType.BF16, d, mask, d, None, None, 4096, mods)
    return forward, chosen_backward_spec("sm_90a", DType.BF16, d, mask, d, None, mods=mods)


def spills(plan, tmp_path) -> dict:
    from tiledsl.codegen import nvcc
    from tiledsl.codegen.render import render
    _, report = nvcc.compile_to(render(plan), plan.kernel_name, "cubin", Path(tmp_path))
    found = nvcc.parse_ptxas(report)
    names = getattr(plan, "kernel_names", {"": plan.kernel_name}).values()
    return {name: (found[name].spill_stores, found[name].spill_loads, found[name].stack_bytes) for name in names}


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("d", [128, 256])
def test_the_api_dropout_forwards_compile_without_spills(d, causal, tmp_path):
    """d64's tuned schedule (three 160-register consumers) spills a few bytes with dropout: reported, not tested."""
    from tiledsl.families import lower
    forward, _ = api_specs(d, causal)
    assert set(spills(lower(forward), tmp_path).values()) == {(0, 0, 0)}


@needs_nvcc
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_api_dropout_backwards_compile_without_spills(d, causal, tmp_path):
    from tiledsl.lower.backward import lower_backward
    _, backward = api_specs(d, causal)
    plan = lower_backward(backward)
    assert plan.dropout and set(spills(plan, tmp_path).values()) == {(0, 0, 0)}
