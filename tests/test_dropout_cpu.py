"""Dropout without a GPU: templates/philox.cuh and dropout.cuh compiled for the host (tests/dropout_host.cpp)
against mods/philox.py (Random123's known answers, random counters, and the keep mask of a tile of P as one
warp's accumulators hold it), the kernels' constants and routing, the API's keywords, seeds and refusals
through the host stubs, and p = 0's plain kernels."""
from __future__ import annotations

import functools
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
    """One warp's S^T (16 keys x `queries` queries) after dropout_keep_transposed: kept exactly where the forward's
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
