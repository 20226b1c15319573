"""templates/mask_mods.cuh (the hopper forward's document and prefix masks) run on the host: each warp is 32
threads whose shuffles, ballots and reductions meet at a barrier (tests/mask_mods_host.cpp), so the device
code runs as written. For fresh random documents (empty ones, one, many one-token ones, padding, queries
before the keys) and prefixes, every query row must see exactly the keys the float64 reference's mask lets
through, the item's kv tiles must hold them all (tight where nothing is padding), and a (warp, kv tile) must
skip the per-element test exactly when every element of its rows (those before q_len) is visible."""
from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tiledsl.mods.numeric import document_ids_from_bounds

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"none": 0, "ids": 1, "bounds": 2}
MASKS = {"none": 0, "causal": 1}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@functools.lru_cache(maxsize=None)
def binary(documents: str, mask: str, prefix: int, tile_q: int, tile_kv: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix="mask_mods_")) / "host"
    defines = dict(TILE_Q=tile_q, TILE_KV=tile_kv, MASK_KIND=MASKS[mask], DOCUMENT_KIND=KINDS[documents],
                   PREFIX_KEYS=prefix)
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-Wall", "-Werror", "-Wno-unused-function",
                    "-Wno-unknown-pragmas", f"-I{ROOT / 'templates'}", *(f"-D{k}={v}" for k, v in defines.items()),
                    str(ROOT / "tests" / "mask_mods_host.cpp"), "-o", str(out)], check=True)
    return out


def run(documents, mask, prefix, seq_kv, q_len, ids=None, bounds=None, tile_q=128, tile_kv=128):
    """{q0: (span, (tile begin, end), {row: keys}, tested flags per (warp, tile))} from the host run."""
    words = [seq_kv, q_len] + (list(ids) if documents == "ids" else []) + \
        ([len(bounds), *bounds] if documents == "bounds" else [])
    text = subprocess.run([str(binary(documents, mask, prefix, tile_q, tile_kv))], input=" ".join(map(str, words)),
                          capture_output=True, text=True, check=True).stdout
    tiles, current = {}, None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head == "tile":
            v = [int(x) for x in rest.replace("span", "").replace("tiles", "").split()]
            current = tiles[v[0]] = ((v[1], v[2]), (v[3], v[4]), {}, [])
        elif head == "row":
            row, _, keys = rest.partition(":")
            current[2][int(row)] = [int(x) for x in keys.split()]
        elif head == "tested":
            current[3].extend(int(x) for x in rest.split())
    return tiles


def reference_visible(mask, prefix, seq_kv, q_len, doc_ids):
    """(q_len, seq_kv) bool: the float64 reference's rule (mods/numeric.py) for one sequence."""
    i = np.arange(q_len)[:, None]
    j = np.arange(seq_kv)[None, :]
    pos = i + seq_kv - q_len
    seen = np.ones((q_len, seq_kv), dtype=bool)
    if mask == "causal":
        seen &= j <= pos
    if doc_ids is not None:
        q_doc = np.where(pos >= 0, doc_ids[np.clip(pos, 0, seq_kv - 1)], -2)
        seen &= (q_doc == doc_ids[None, :]) & (doc_ids[None, :] >= 0)
    if prefix:
        seen &= (j <= pos) | (j < prefix)
    return seen


def check(documents, mask, prefix, seq_kv, q_len, ids=None, bounds=None, tile_q=128, tile_kv=128):
    doc_ids = None
    if documents == "ids":
        doc_ids = np.asarray(ids)
    elif documents == "bounds":
        doc_ids = document_ids_from_bounds(np.asarray([bounds]), seq_kv)[0]
    want = reference_visible(mask, prefix, seq_kv, q_len, doc_ids)
    tiles = run(documents, mask, prefix, seq_kv, q_len, ids, bounds, tile_q, tile_kv)
    assert sorted(tiles) == list(range(0, q_len, tile_q))
    for q0, (span, (begin, end), rows, tested) in tiles.items():
        rows_valid = min(tile_q, q_len - q0)
        for r in range(q0, q0 + rows_valid):
            assert rows[r] == list(np.nonzero(want[r])[0]), f"row {r}: keys {rows[r]}"
        block = want[q0:q0 + rows_valid]
        keys = np.nonzero(block.any(axis=0))[0]
        if len(keys):
            assert begin * tile_kv <= keys[0] and keys[-1] < end * tile_kv
            if doc_ids is None or (doc_ids >= 0).all() and q_len <= seq_kv:
                assert (begin, end) == (keys[0] // tile_kv, -(-(keys[-1] + 1) // tile_kv)), (q0, begin, end, keys)
        flags = np.array(tested, dtype=bool).reshape(tile_q // 16, max(end - begin, 0))
        for w in range(tile_q // 16):
            for t in range(begin, end):
                part = want[q0 + 16 * w:q0 + 16 * w + 16, t * tile_kv:(t + 1) * tile_kv]
                full = part.shape[1] == tile_kv and part.all()   # rows past q_len are never stored
                if full and part.shape[0] < 16 and doc_ids is not None:
                    continue   # the documents' rows past q_len are in none: tested, or not
                assert flags[w, t - begin] == (not full), (q0, w, t)


def packed_ids(rng, seq_kv, lengths, pad_end=0):
    """Ids of consecutive documents of the given lengths (an id may be skipped), padding (-1) at the end."""
    out, doc = [], 0
    for n in lengths:
        out += [doc] * n
        doc += int(rng.integers(1, 3))
    out = (out + [-1] * seq_kv)[:seq_kv]
    pad_end = min(pad_end, seq_kv)
    if pad_end:
        out[seq_kv - pad_end:] = [-1] * pad_end
    return out


def random_lengths(rng, seq_kv, mean):
    lengths = []
    while sum(lengths) < seq_kv:
        lengths.append(int(rng.integers(1, 2 * mean)))
    return lengths


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("seq_kv, q_len, mean", [(1000, 1000, 150), (1000, 1000, 1), (4097, 4097, 700),
                                                 (300, 777, 40), (777, 300, 90), (17, 17, 5), (1, 1, 1)])
def test_document_ids_rows_see_their_documents(mask, seq_kv, q_len, mean):
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
    check("ids", mask, 0, n, 200, ids=packed_ids(rng, n, [256, 100, 244]), tile_q=192)   # three consumers
    check("ids", mask, 0, 256, 256, ids=[0] * 64 + [1] * 64 + [2] * 128, tile_q=64, tile_kv=64)   # aligned


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
def test_prefix_rows(prefix, seq_kv, q_len):
    check("none", "none", prefix, seq_kv, q_len)


def test_prefix_with_documents():
    rng = np.random.default_rng()
    ids = packed_ids(rng, 900, random_lengths(rng, 900, 200))
    check("ids", "none", 250, 900, 900, ids=ids)
    check("bounds", "none", 250, 900, 700, bounds=[0, 100, 100, 600, 900])
