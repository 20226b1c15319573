"""templates/backward_mask_mods.cuh (documents and prefix(n) in the warp-specialized backward) run on the host
(tests/backward_mask_mods_host.cpp, over tests/mask_mods_host.cpp's warp of threads): for fresh random documents
(empty ones, one-token ones, padding, queries before the keys, q_len != kv_len) and prefixes, every key must be
visible to exactly the queries the float64 reference's mask lets through; a kv tile's walked q tiles must hold
them all and skip none of them (tight where nothing is padding); a (key warp, q tile) pair must skip the
per-element test exactly when every element is visible; and the kv tiles that walk a q tile must be contiguous
from the first one ordered dQ waits for (its semaphore's turn counts from there)."""
from __future__ import annotations

import functools
import re
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


# ---- the plan, the launches (tests/host_stubs.py's fake device), the refusals -----------------------------------

def _spec(mask: str, d: int = 128, dq: str = "tma_reduce", mods=()):
    from .test_backward_mods_cpu import spec
    return spec(list(mods), d, mask, dq)


def test_the_plan_reads_the_keys_spans_and_leaves_unmodified_kernels_alone():
    from tiledsl.codegen.render import render
    from tiledsl.lower.backward import lower_backward
    plan = lower_backward(_spec("causal & document"))
    assert (plan.mask_mods, plan.documents, plan.prefix) == (True, "ids", False)
    assert plan.kernel_names["documents"].endswith("_documents")
    names = [p.name for line in plan.parameters for p in line]
    assert names[-3:] == ["document_ids", "document_stride", "key_spans"]
    src = render(plan)
    # producer and consumers walk the q tiles computed once before the role split, from the documents kernel's span
    split = src.index("if (warpgroup == 0) {")
    for line in ("const int2 key_span = key_spans[blockIdx.x - kv_head];", "narrow_queries<C>(q_lo, q_hi, k0, diag, "
                 "key_span);", "const int steps = tiles * kv_group;"):
        assert 0 < src.index(line) < split, line
    assert "mask_scores_mods<SliceC>(" in src and "mask_scores<SliceC>(" not in src
    plain = render(lower_backward(_spec("causal")))
    assert "backward_mask_mods" not in plain and "key_span" not in plain and "_documents" not in plain
    prefix = lower_backward(_spec("prefix(300)"))
    assert (prefix.documents, prefix.prefix) == ("", True) and "documents" not in prefix.kernel_names
    assert "PREFIX = 300" in render(prefix)


@pytest.mark.parametrize("mask", ["causal & document", "document(bounds)", "prefix(100) & document"])
@pytest.mark.parametrize("dq", ["tma_reduce", "ordered", "atomic"])
def test_the_protocol_model_runs_the_document_kernels_to_the_end(mask, dq):
    """Barrier balance: the producer, the writer and the consumers of a document kernel walk the same q steps
    (test_backward_ws_protocol_cpu's model of the template, with the kernel's own barrier counts)."""
    from tiledsl.lower.backward import lower_backward

    from .test_backward_ws_protocol_cpu import STEPS, constants, run_block
    plan = lower_backward(_spec(mask, 128, dq))
    c = constants(plan)
    for steps in STEPS:
        for kv_end in (False, True):
            phases = run_block(plan, steps, kv_end)
            if steps:
                assert sum(phases[f"q_full{s}"] for s in range(c["STAGES"])) == steps
                assert sum(phases[f"q_empty{s}"] for s in range(c["STAGES"])) == steps


def test_explain_shows_the_mask_and_its_narrowing(capsys):
    from tiledsl.cli.main import main
    main(["explain", str(ROOT / "specs" / "mods" / "document_backward_d128.tile")])
    out = capsys.readouterr().out
    assert "mask modifications (each block's q tiles): documents: only the queries at positions in the keys' " \
        "documents" in out, out
    assert "consumers' mask step: mask keys outside the sequence / diagonal / window, each key's document" in out


@pytest.fixture
def device(tmp_path):
    from tests.host_stubs import stub_device
    with stub_device(tmp_path, {}) as dev:
        yield dev


def test_attention_backward_launches_the_documents_kernel_first(device):
    import tiledsl
    q, k, v, o, do = (device.tensor((2, 4, 300, 128)) for _ in range(5))
    k, v = (device.tensor((2, 2, 300, 128)) for _ in range(2))
    lse = device.tensor((2, 4, 300), "float32")
    ids = device.tensor((2, 300), "int32", host=np.zeros((2, 300), np.int32))
    tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, document_ids=ids, deterministic=True)
    (pre, *_), (docs, grid, threads, _, _, values), (main, *_, main_values), (convert, *_) = (
        device.last(n) for n in (4, 3, 2, 1))
    assert pre.endswith("_preprocess") and docs.endswith("_documents") and main.endswith("_main")
    assert "_doc_" in main and "ordered" in main
    assert grid == (5, 2, 1) and threads == 32   # max(kv tiles, q tiles of 64) x batch
    assert values[:2] == [ids.data_ptr(), 300]   # the ids and their batch stride
    assert values[-7:] == [300, 300, 3, 5, 4, 2, 4]   # q_len, kv_len, kv tiles, q tiles, kv pairs, kv heads, heads
    assert main_values[-3:-1] == [ids.data_ptr(), 300] and main_values[-1] == values[3]   # the same key spans
    with pytest.raises(tiledsl.errors.RuntimeInputError, match="document_ids has shape"):
        tiledsl.attention_backward(q, k, v, o, lse, do, document_ids=device.tensor((2, 299), "int32"))
    with pytest.raises(tiledsl.errors.RuntimeInputError, match="resumes document"):
        bad = np.zeros((2, 300), np.int32)
        bad[0, 100:200] = 1
        tiledsl.attention_backward(q, k, v, o, lse, do, document_ids=device.tensor((2, 300), "int32", host=bad))


def test_a_training_step_with_document_ids_runs_the_document_backward(device):
    import tiledsl
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    ids = device.tensor((2, 300), "int32", host=np.repeat(np.arange(3, dtype=np.int32), 100)[None].repeat(2, 0))
    o = tiledsl.attention(q, k, v, causal=True, document_ids=ids)
    assert device.last()[0].startswith("hopper") and "_doc_" in device.last()[0]
    grads = device.backward(o, device.tensor(o.shape))
    assert len(grads) == 11 and grads[6:10] == (None,) * 4   # no gradient for the ids (nor bounds, block mask, aux)
    assert device.last(3)[0].endswith("_documents") and "_doc_" in device.last(2)[0]


def test_what_stays_refused():
    """The warp-specialized backward takes documents, prefix(n), block masks and dropout (with the score
    modifications); a mask_mod beside the documents, prefix or a block mask, and dropout beside an expression, stay
    refused, by name."""
    from tiledsl.dispatch.modified import modifications
    from tiledsl.layout.backward_ws import ws_mods_refusal
    from tiledsl.mods.model import Documents, Modifications
    assert ws_mods_refusal(Modifications(prefix=5, document=Documents.BOUNDS, softcap=30.0, sinks=True)) == ""
    assert ws_mods_refusal(Modifications(blocks=(128, 128), document=Documents.IDS)) == ""
    assert ws_mods_refusal(Modifications(dropout=0.1, document=Documents.IDS, softcap=30.0)) == ""
    assert ws_mods_refusal(modifications("attention", mask_mod="kv_idx <= q_idx")[0]) == ""
    assert "without prefix" in ws_mods_refusal(modifications("attention", mask_mod="kv_idx <= q_idx", prefix=4)[0])
    assert "dropout" in ws_mods_refusal(modifications("attention", mask_mod="kv_idx <= q_idx", dropout_p=0.1)[0])


def test_the_bundled_document_backward_spec_builds_both_passes():
    from tiledsl.families import lower
    from tiledsl.frontend.parse import load_spec
    from tiledsl.lower.backward import lower_backward
    s = load_spec(str(ROOT / "specs" / "mods" / "document_backward_d128.tile"))
    assert s.problem.mods.document.value == "ids" and s.backward.warp_specialized
    forward, backward = lower(s), lower_backward(s)
    assert forward.documents == backward.documents == "ids" and backward.kernel_names["documents"]
    assert [op.kind for op in backward.loop_body].count("mask") == 1


# ---- prefix= on the Python API ---------------------------------------------------------------------------------
def test_the_prefix_keyword_trains_through_the_prefix_kernels(device):
    """attention(prefix=N) runs the prefix-LM forward and, through autograd, its warp-specialized backward."""
    import tiledsl
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    o = tiledsl.attention(q, k, v, prefix=100)
    assert device.last()[0].startswith("hopper") and "_prefix100_" in device.last()[0]
    grads = device.backward(o, device.tensor(o.shape))
    assert len(grads) == 11 and all(g is not None for g in grads[:3])
    names = [device.last(back)[0] for back in range(1, 4)]   # the backward's preprocess, main and dQ launches
    assert any(name.endswith("_main") and "_prefix100_" in name for name in names), names


def test_the_prefix_keyword_is_its_own_mask_and_an_int():
    import tiledsl
    from tiledsl.errors import RuntimeInputError
    from tiledsl.mods.model import PREFIX_ALONE

    class Shaped:   # spec_for reads shapes and dtypes only
        def __init__(self, shape):
            self.shape, self.dtype = shape, "torch.bfloat16"
    q = Shaped((1, 4, 300, 128))
    assert re.search(r"mask += prefix\(100\)", tiledsl.spec_for(q, q, q, prefix=100))
    for bad in (0, -3, True, 2.5, "100"):
        with pytest.raises(RuntimeInputError, match="prefix is the number of leading keys every query sees"):
            tiledsl.spec_for(q, q, q, prefix=bad)
    for mask in (dict(causal=True), dict(window=(64, 0))):
        with pytest.raises(RuntimeInputError, match=PREFIX_ALONE.replace("(", r"\(").replace(")", r"\)")):
            tiledsl.spec_for(q, q, q, prefix=100, **mask)
