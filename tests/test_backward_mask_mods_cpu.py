"""templates/backward_mask_mods.cuh (documents and prefix(n) in the warp-specialized backward) run on the host
(tests/backward_mask_mods_host.cpp, over tests/mask_mods_host.cpp's warp of threads): for fresh random documents
(empty ones, one-token ones, padding, queries before the keys, q_len != kv_len) and prefixes, every key must be
visible to exactly the queries the float64 reference's mask lets through; a kv tile's walked q tiles must hold
them all and skip none of them (tight where nothing is padding); a (key warp, q tile) pair must skip the
per-element test exactly when every element is visible; and the kv tiles that walk a q tile must be contiguous
from the first one ordered dQ waits for (its semaphore's turn counts from there)."""
from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tiledsl.mods.numeric import document_ids_from_bounds

from .test_mask_mods_cpu import KINDS, MASKS, packed_ids, random_lengths, reference_visible

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@functools.lru_cache(maxsize=None)
def binary(documents: str, mask: str, prefix: int, tile_q: int, tile_kv: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix="backward_mask_mods_")) / "host"
    defines = dict(TILE_Q=tile_q, TILE_KV=tile_kv, MASK_KIND=MASKS[mask], DOCUMENT_KIND=KINDS[documents],
                   PREFIX_KEYS=prefix)
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-Wno-unused-function",
                    "-Wno-unknown-pragmas", f"-I{ROOT / 'templates'}", f"-I{ROOT / 'tests'}",
                    *(f"-D{k}={v}" for k, v in defines.items()),
                    str(ROOT / "tests" / "backward_mask_mods_host.cpp"), "-o", str(out)], check=True)
    return out


def run(documents, mask, prefix, seq_kv, q_len, ids=None, bounds=None, tile_q=64, tile_kv=128):
    """({k0: ((q tile begin, end), {key: queries}, tested flags per (key warp, q tile))}, {q0: first kv tile})."""
    words = [seq_kv, q_len] + (list(ids) if documents == "ids" else []) + \
        ([len(bounds), *bounds] if documents == "bounds" else [])
    text = subprocess.run([str(binary(documents, mask, prefix, tile_q, tile_kv))], input=" ".join(map(str, words)),
                          capture_output=True, text=True, check=True).stdout
    tiles, firsts, current = {}, {}, None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head == "kv":
            v = [int(x) for x in rest.replace("span", "").replace("tiles", "").split()]
            current = tiles[v[0]] = ((v[3], v[4]), {}, [])
        elif head == "key":
            key, _, queries = rest.partition(":")
            current[1][int(key)] = [int(x) for x in queries.split()]
        elif head == "tested":
            current[2].extend(int(x) for x in rest.split())
        elif head == "first":
            q0, first = map(int, rest.split())
            firsts[q0] = first
    return tiles, firsts


def check(documents, mask, prefix, seq_kv, q_len, ids=None, bounds=None, tile_q=64, tile_kv=128):
    doc_ids = None
    if documents == "ids":
        doc_ids = np.asarray(ids)
    elif documents == "bounds":
        doc_ids = document_ids_from_bounds(np.asarray([bounds]), seq_kv)[0]
    want = reference_visible(mask, prefix, seq_kv, q_len, doc_ids)   # (q_len, seq_kv)
    tiles, firsts = run(documents, mask, prefix, seq_kv, q_len, ids, bounds, tile_q, tile_kv)
    assert sorted(tiles) == list(range(0, seq_kv, tile_kv))
    q_tiles = -(-q_len // tile_q)
    walks = np.zeros((seq_kv and -(-seq_kv // tile_kv), q_tiles), dtype=bool)
    for k0, ((begin, end), keys, tested) in tiles.items():
        j = k0 // tile_kv
        walks[j, begin:end] = True
        for key in range(k0, min(k0 + tile_kv, seq_kv)):
            assert keys[key] == list(np.nonzero(want[:, key])[0]), f"key {key}: queries {keys[key]}"
        block = want[:, k0:k0 + tile_kv]
        for t in range(q_tiles):   # no visible pair outside the walked q tiles; no walked tile without one
            seen = block[t * tile_q:(t + 1) * tile_q].any()
            if not begin <= t < end:
                assert not seen, (k0, t, begin, end)
            elif doc_ids is None or (doc_ids >= 0).all():
                assert seen or q_len > seq_kv, f"kv tile {j} walks q tile {t}, which sees none of its keys"
        flags = np.array(tested, dtype=bool).reshape(tile_kv // 16, max(end - begin, 0))
        for w in range(tile_kv // 16):
            for t in range(begin, end):
                part = want[t * tile_q:(t + 1) * tile_q, k0 + 16 * w:k0 + 16 * w + 16]
                full = part.shape == (tile_q, 16) and part.all()
                if part.shape[0] < tile_q and not flags[w, t - begin]:
                    assert part.all(), (k0, w, t)   # a last q tile past q_len: untested only when all visible
                    continue
                if part.shape[0] == tile_q and not (full and k0 + tile_kv > seq_kv):   # the last kv tile: all tested
                    assert flags[w, t - begin] == (not full), (k0, w, t, flags[w, t - begin])
    for t in range(q_tiles):   # ordered dQ: the kv tiles that walk a q tile are contiguous from its first
        walkers = np.nonzero(walks[:, t])[0]
        if len(walkers):
            assert list(walkers) == list(range(walkers[0], walkers[-1] + 1)), (t, walkers)
            assert firsts[t * tile_q] == walkers[0], (t, firsts[t * tile_q], walkers)


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("seq_kv, q_len, mean", [(1000, 1000, 150), (1000, 1000, 1), (2049, 2049, 500),
                                                 (300, 777, 40), (777, 300, 90), (17, 17, 5), (1, 1, 1)])
def test_document_ids_keys_are_seen_by_their_documents(mask, seq_kv, q_len, mean):
    rng = np.random.default_rng()
    ids = packed_ids(rng, seq_kv, random_lengths(rng, seq_kv, mean), pad_end=int(rng.integers(0, 3)))
    check("ids", mask, 0, seq_kv, q_len, ids=ids)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_document_ids_edge_cases(mask):
    rng = np.random.default_rng()
    n = 600
    check("ids", mask, 0, n, n, ids=[0] * n)                                   # one document
    check("ids", mask, 0, n, n, ids=list(range(n)))                            # every token its own document
    check("ids", mask, 0, n, n, ids=[-1] * n)                                  # all padding
    check("ids", mask, 0, n, n, ids=[-1] * 130 + [3] * 300 + [-5] * 40 + [4] * 130)   # padding between
    check("ids", mask, 0, n, n, ids=[7] * 128 + [2] * 128 + [9] * 344)         # ids need not increase
    check("ids", mask, 0, n, 200, ids=packed_ids(rng, n, [256, 100, 244]), tile_q=128)   # tile q 128 (d64)
    check("ids", mask, 0, 256, 256, ids=[0] * 64 + [1] * 64 + [2] * 128, tile_kv=64)   # d256's kv tile 64


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_document_bounds_with_empty_documents(mask):
    rng = np.random.default_rng()
    n = 1000
    cuts = np.sort(rng.integers(0, n, 12))
    check("bounds", mask, 0, n, n, bounds=[0, 0, *cuts, cuts[-1], n])
    check("bounds", mask, 0, n, n, bounds=[5, 5, 300, 300, 700])       # keys before and after every document
    check("bounds", mask, 0, n, 300, bounds=[0, n])
    check("bounds", mask, 0, n, n, bounds=[0])                         # no document at all
    check("bounds", mask, 0, n, n, bounds=list(range(0, n + 1)))       # one-token documents


@pytest.mark.parametrize("prefix", [1, 100, 128, 700, 5000])
@pytest.mark.parametrize("seq_kv, q_len", [(1000, 1000), (300, 1000), (1000, 17), (1, 1)])
def test_prefix_keys(prefix, seq_kv, q_len):
    check("none", "none", prefix, seq_kv, q_len)


def test_prefix_with_documents():
    rng = np.random.default_rng()
    ids = packed_ids(rng, 900, random_lengths(rng, 900, 200))
    check("ids", "none", 250, 900, 900, ids=ids)
    check("bounds", "none", 250, 900, 700, bounds=[0, 100, 100, 600, 900])
