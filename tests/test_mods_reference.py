"""The float64 reference of every score and mask modification against textbook attention written apart
(tests/mods_naive.py): forward for every family's graph, backward against finite differences, the tile
classes against the elementwise mask, and the refusals of aux tensors that don't fit."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from tiledsl.errors import RuntimeInputError
from tiledsl.frontend.parse import load_spec
from tiledsl.mods.expr import Type, source
from tiledsl.mods.model import geometric_slopes
from tiledsl.mods.numeric import evaluate, grid
from tiledsl.mods.philox import keep_mask
from tiledsl.reference.backward import reference_backward
from tiledsl.reference.forward import reference_attention
from tiledsl.schedule.tiles import EMPTY, FULL, Tiling, classify, counts

from . import mods_naive as naive
from .mods_support import expressions

SCHEDULES = {
    "fa2": "schedule {\n        tile q = 32, kv = 16\n        warps 2\n    }",
    "fa1": "schedule {\n        order kv, q\n        tile q = 16, kv = 32\n        warps 2 along kv\n    }",
    "hopper": "schedule {\n        warpgroups producer 1, consumer 1\n        tile q = 64, kv = 16\n"
              "        overlap intra\n    }",
    "decode": "schedule {\n        tile kv = 32\n        warps 2\n        split kv = 3\n    }",
}


def spec_for(lines, family="fa2", head_dim=16, backward=False, queries=None):
    body = "".join(f"    {line}\n" for line in lines)
    if queries:
        body += f"    queries = {queries}\n"
    bwd = "    backward {\n        tile q = 16, kv = 16\n        warps 1\n    }\n" if backward else ""
    return load_spec(f"attention t {{\n    head_dim = {head_dim}\n{body}    {SCHEDULES[family]}\n{bwd}}}\n")


def case(name, rng, batch, heads, nq, nk, lens=None, blocks=(16, 32)):
    """(DSL lines, aux tensors, the naive implementation's keywords) of one modification; `lens`: the
    batch entries' kv_len (all nk when None); `blocks`: the block-sparse case's (q, kv) block sizes."""
    i_kv = nk - 1
    lens = np.full(batch, nk) if lens is None else lens
    if name == "softcap":
        return ["softcap = 2.5"], {}, dict(softcap=2.5)
    if name == "alibi geometric":
        slopes = np.tile(geometric_slopes(heads), (batch, 1))
        return ["alibi = geometric", "mask = causal"], {}, dict(slopes=slopes, mask="causal")
    if name == "alibi slopes":
        slopes = rng.uniform(0.01, 0.5, heads)
        return ["alibi = slopes"], {"alibi_slopes": slopes}, dict(slopes=np.tile(slopes, (batch, 1)))
    if name == "sinks":
        sinks = rng.normal(0, 1.5, heads)
        return ["sinks = per_head", "mask = window(left = 5, right = 2)"], {"sinks": sinks}, \
            dict(sinks=sinks, mask="window", window=(5, 2))
    if name == "document ids":
        ids = np.sort(rng.integers(0, 4, (batch, nk)), axis=1)
        ids[:, -3:] = -1   # padding: in no document
        return ["mask = causal & document"], {"document_ids": ids}, dict(mask="causal", documents=ids)
    if name == "document bounds with empty documents":
        a, c = nk // 3, nk // 2
        bounds = np.array([[0, 0, a, a, a + 2, nk - 2, nk - 2], [1, 3, 3, c, nk, nk, nk]])[:batch]
        return ["mask = document(bounds)"], {"document_bounds": bounds}, \
            dict(documents=naive.ids_from_bounds(bounds, nk))
    if name == "prefix-lm":
        return ["mask = prefix(7)"], {}, dict(prefix=7)
    if name == "window and softcap":
        return ["mask = window(left = 40, right = 7)", "softcap = 3"], {}, dict(mask="window", window=(40, 7),
                                                                              softcap=3.0)
    if name == "blocks":
        table = rng.integers(0, 2, (1, heads, -(-nq // blocks[0]), -(-nk // blocks[1])))
        return [f"mask = causal & blocks(q = {blocks[0]}, kv = {blocks[1]})"], {"block_mask": table}, \
            dict(mask="causal", blocks=(table, *blocks))
    if name == "dropout":
        keep = keep_mask(0.3, 99, 5, heads, *np.ix_(range(batch), range(heads), range(nq), range(nk))) / 0.7
        return ["dropout = 0.3", "mask = causal"], {"dropout_rng": (99, 5)}, dict(mask="causal", keep=keep)
    if name == "relative bias table":
        bias = rng.normal(0, 1, (heads, nq + nk - 1))
        return [f"score_mod = score + bias[h, q_idx - kv_idx + {i_kv}]"], {"bias": bias}, \
            dict(score_fn=lambda s, b, h, i, j: s + bias[h][i - j + i_kv])
    if name == "sliding window with a global token":
        return ["mask_mod = kv_idx <= q_idx & q_idx - kv_idx <= 6 | kv_idx == 0"], {}, \
            dict(mask_fn=lambda b, h, i, j: ((j <= i) & (i - j <= 6)) | (j == 0))
    if name == "prefix-lm expression":
        # prefixes under half the keys: the first q tile's last kv tile stays empty at every tiling tested
        # (a prefix past it left no empty tile, and the tile-class test asks for one)
        lengths = rng.integers(1, nk // 2, batch)
        return ["mask_mod = kv_idx <= q_idx + kv_len - q_len | kv_idx < plen[b]"], {"plen": lengths}, \
            dict(mask_fn=lambda b, h, i, j: (j <= i + lens[b] - nq) | (j < lengths[b]))
    if name == "t5 buckets":
        table = rng.normal(0, 1, (heads, 12))
        return ["score_mod = where(score > 1, score * 0.5 + 0.5, score) + t5[h, int(log(abs(q_idx - kv_idx) + 1) * "
                "2)]"], {"t5": table}, \
            dict(score_fn=lambda s, b, h, i, j: np.where(s > 1, s * 0.5 + 0.5, s)
                 + table[h][np.trunc(np.log(np.abs(i - j) + 1) * 2).astype(int)])
    if name == "everything":
        sinks, ids = rng.normal(0, 1, heads), np.sort(rng.integers(0, 3, (batch, nk)), axis=1)
        return ["softcap = 4", "alibi = geometric", "sinks = per_head", "mask = causal & document",
                "mask_mod = kv_idx != 3"], {"sinks": sinks, "document_ids": ids}, \
            dict(softcap=4.0, slopes=np.tile(geometric_slopes(heads), (batch, 1)), sinks=sinks, mask="causal",
                 documents=ids, mask_fn=lambda b, h, i, j: j != 3)
    raise KeyError(name)


CASES = ["softcap", "window and softcap", "alibi geometric", "alibi slopes", "sinks", "document ids",
         "document bounds with empty documents",
         "prefix-lm", "blocks", "dropout", "relative bias table", "sliding window with a global token",
         "prefix-lm expression", "t5 buckets", "everything"]


def inputs(rng, batch, heads, kv_heads, nq, nk, d=16):
    return (rng.standard_normal((batch, heads, nq, d)), rng.standard_normal((batch, kv_heads, nk, d)),
            rng.standard_normal((batch, kv_heads, nk, d)))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("family", ["fa2", "fa1", "hopper"])
def test_forward_matches_textbook_attention(name, family):
    rng = np.random.default_rng()
    batch, heads, nq, nk = 2, 4, 45, 45 if family == "fa1" else 53
    lens = np.array([nk, nk - 6])
    # the hopper kernels take blocks their tiles divide (layout.hopper.require_tiles_nest)
    lines, aux, kw = case(name, rng, batch, heads, nq, nk, lens, (64, 32) if family == "hopper" else (16, 32))
    head_dim = 64 if family == "hopper" else 16
    q, k, v = inputs(rng, batch, heads, 2, nq, nk, head_dim)
    o, lse = reference_attention(spec_for(lines, family, head_dim), q, k, v, kv_lens=lens, aux=aux)
    o_ref, lse_ref = naive.attention(q, k, v, kv_lens=lens, **kw)
    assert np.allclose(o, o_ref, atol=1e-12, rtol=0)
    assert np.array_equal(np.isinf(lse), np.isinf(lse_ref)) and np.allclose(lse[np.isfinite(lse)],
                                                                             lse_ref[np.isfinite(lse_ref)], atol=1e-12)


@pytest.mark.parametrize("name", ["softcap", "sinks", "document ids", "relative bias table", "everything", "dropout"])
def test_split_kv_decode_joins_the_sink_once(name):
    rng = np.random.default_rng()
    batch, heads, nq, nk = 2, 4, 3, 90
    lines, aux, kw = case(name, rng, batch, heads, nq, nk)
    q, k, v = inputs(rng, batch, heads, 4, nq, nk)
    o, lse = reference_attention(spec_for(lines, "decode", queries=nq), q, k, v, aux=aux)
    o_ref, lse_ref = naive.attention(q, k, v, **kw)
    assert np.allclose(o, o_ref, atol=1e-12, rtol=0) and np.allclose(lse, lse_ref, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_backward_matches_finite_differences(name):
    rng = np.random.default_rng()
    batch, heads, nq, nk = 2, 2, 9, 11
    lines, aux, kw = case(name, rng, batch, heads, nq, nk)
    q, k, v = inputs(rng, batch, heads, 1, nq, nk, 16)
    do = rng.standard_normal((batch, heads, nq, 16))
    spec = spec_for(lines, head_dim=16, backward=True)
    grads = reference_backward(spec, q, k, v, do, aux=aux)
    params = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])

    def loss():
        return float((naive.attention(q, k, v, **kw)[0] * do).sum())
    expected = naive.finite_difference_grads(loss, params)
    assert len(grads) == len(params)
    for got, want in zip(grads, expected):
        assert np.allclose(got, want, atol=1e-6, rtol=1e-6), np.abs(got - want).max()


def test_the_sink_gradient_is_the_sum_of_minus_p_sink_times_d():
    rng = np.random.default_rng()
    lines, aux, kw = case("sinks", rng, 2, 4, 20, 20)
    q, k, v = inputs(rng, 2, 4, 4, 20, 20)
    do = rng.standard_normal(q.shape)
    spec = spec_for(lines, backward=True)
    o, lse = reference_attention(spec, q, k, v, aux=aux)
    *_, dsink = reference_backward(spec, q, k, v, do, o, lse, aux=aux)
    p_sink = np.exp(aux["sinks"][None, :, None] - lse)
    assert np.allclose(dsink, -(p_sink * (do * o).sum(-1)).sum(axis=(0, 2)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["window and softcap", "document ids", "document bounds with empty documents",
                                  "prefix-lm", "blocks",
                                  "sliding window with a global token", "prefix-lm expression", "everything"])
@pytest.mark.parametrize("tiles", [(16, 16), (32, 64), (64, 16)])
def test_tile_classes_are_sound_and_find_full_and_empty_tiles(name, tiles):
    rng = np.random.default_rng()
    batch, heads, nq, nk = 2, 4, 150, 170
    lens = np.array([nk, nk - 30])
    lines, aux, kw = case(name, rng, batch, heads, nq, nk, lens)
    spec = spec_for(lines)
    from tiledsl.mods.checks import prepare_aux
    prepared = prepare_aux(spec.problem.mods, aux, batch, heads, nq, nk, lens)
    classes = classify(spec.problem, Tiling(nq, nk, *tiles), batch, heads, lens, prepared)
    for b in range(batch):
        for h in range(heads):
            masks = {key: kw[key] for key in ("mask", "window", "documents", "prefix", "blocks", "mask_fn")
                     if key in kw}
            seen = naive.visible(b, h, nq, nk, lens[b], **masks)
            for i in range(classes.shape[2]):
                for j in range(classes.shape[3]):
                    tile = seen[i * tiles[0]:(i + 1) * tiles[0], j * tiles[1]:(j + 1) * tiles[1]]
                    if classes[b, h, i, j] == EMPTY:
                        assert not tile.any()
                    if classes[b, h, i, j] == FULL:
                        assert tile.all()
    found = counts(classes)
    assert found["empty"] > 0 and found["partial"] > 0


def test_index_only_masks_are_classified_exactly_without_data():
    spec = spec_for(["mask_mod = kv_idx <= q_idx & q_idx - kv_idx < 200 | kv_idx < 16"])
    classes = classify(spec.problem, Tiling(512, 512, 64, 64), 1, 1)
    i, j = np.arange(512)[:, None], np.arange(512)[None, :]
    seen = ((j <= i) & (i - j < 200)) | (j < 16)
    tiles = seen.reshape(8, 64, 8, 64).transpose(0, 2, 1, 3).reshape(8, 8, -1)
    truth = np.where(tiles.all(-1), FULL, np.where(tiles.any(-1), 1, EMPTY))
    assert (classes[0, 0] == truth).all()
    assert counts(classes) == {"empty": 31, "partial": 20, "full": 13}


@pytest.mark.parametrize("lines, aux, message", [
    (["score_mod = score + bias[h, q_idx - kv_idx]"], {"bias": np.zeros((4, 60))},
     r"index 1 \(q_idx - kv_idx\) can reach -52\.\.44 .* outside bias's 0\.\.59"),
    (["score_mod = score + bias[h, q_idx - kv_idx + 52]"], {"bias": np.zeros((4, 60))},
     r"index 1 \(q_idx - kv_idx \+ 52\) can reach 0\.\.96 .* outside bias's 0\.\.59"),
    (["score_mod = score + bias[h, kv_idx]"], {"bias": np.zeros((4, 53, 2))}, "with 2 indices .* 3 dimensions"),
    (["score_mod = score + bias[h, kv_idx]"], {}, "aux tensor 'bias' is missing"),
    (["softcap = 3"], {"bias": np.zeros(3)}, "aux tensor 'bias' is not read by this spec"),
    (["mask_mod = doc[b, kv_idx] == 0"], {"doc": np.zeros((2, 53))}, "reads doc as int or bool .* the tensor is float"),
    (["score_mod = score + bias[h, kv_idx]"], {"bias": np.zeros((4, 53), dtype=np.int32)},
     "reads bias as float .* the tensor is int"),
    (["mask_mod = kv_idx * 100000000 > q_idx"], {}, r"kv_idx \* 100000000 can reach 0\.\.5200000000 .* outside int32"),
    (["sinks = per_head"], {"sinks": np.zeros(3)}, r"sinks must be \(heads,\), got shape \(3,\)"),
    (["alibi = slopes"], {"alibi_slopes": np.zeros((3, 4))}, r"alibi_slopes must be \(heads,\) or \(batch, heads\)"),
    (["mask = document"], {"document_ids": np.zeros((2, 52), dtype=int)}, r"document_ids must be \(batch, kv_len\)"),
    (["mask = document(bounds)"], {"document_bounds": np.array([[0, 5, 3], [0, 1, 2]])},
     r"document_bounds\[0, 2\] = 3 is below document_bounds\[0, 1\] = 5"),
    (["mask = document(bounds)"], {"document_bounds": np.array([[0, 5, 60], [0, 1, 2]])},
     r"document_bounds\[0, -1\] = 60 is past the 53 keys"),
    (["mask = blocks(16)"], {"block_mask": np.ones((2, 4, 3, 3))},
     r"block_mask must be \(batch or 1, heads or 1, 3, 4\)"),
    (["dropout = 0.5"], {"dropout_rng": (1,)}, r"dropout_rng must be \(seed, offset\)"),
])
def test_aux_tensors_that_dont_fit_are_refused_before_anything_reads_them(lines, aux, message):
    rng = np.random.default_rng()
    q, k, v = inputs(rng, 2, 4, 4, 45, 53)
    with pytest.raises(RuntimeInputError, match=message):
        reference_attention(spec_for(lines), q, k, v, aux=aux)


def test_a_spec_without_modifications_takes_no_aux():
    rng = np.random.default_rng()
    with pytest.raises(RuntimeInputError, match="modifies nothing"):
        reference_attention(spec_for(["mask = causal"]), *inputs(rng, 1, 2, 2, 8, 8), aux={"bias": np.zeros(2)})


def test_varlen_and_paged_references_apply_the_modifications_per_sequence():
    from tiledsl.reference import serving
    rng = np.random.default_rng()
    heads, d, lengths = 4, 16, [33, 0, 70, 5]
    sinks, bias = rng.normal(0, 1, heads), rng.normal(0, 1, (len(lengths), heads))
    spec = spec_for(["softcap = 3", "sinks = per_head", "score_mod = score + bias[b, h]", "mask = causal"])
    aux = {"sinks": sinks, "bias": bias}
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((cu[-1], heads, d)) for _ in range(3))
    o, lse = serving.varlen_attention(q, k, v, cu, cu, mask="causal", mods=spec.problem.mods, aux=aux)
    for b, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
        if stop == start:
            continue
        one = [x[start:stop].transpose(1, 0, 2)[None] for x in (q, k, v)]
        want, want_lse = naive.attention(*one, softcap=3.0, sinks=sinks, mask="causal",
                                         score_fn=lambda s, _, h, i, j, b=b: s + bias[b][h])
        assert np.allclose(o[start:stop], want[0].transpose(1, 0, 2), atol=1e-12)
        assert np.allclose(lse[start:stop], want_lse[0].T, atol=1e-12)
    page, kv_lens = 16, np.array([40, 3, 70, 17], dtype=np.int32)
    pages = rng.permutation(40).astype(np.int32)
    table = pages[:20].reshape(4, 5)
    k_cache, v_cache = (rng.standard_normal((40, page, 2, d)) for _ in range(2))
    qp = rng.standard_normal((4, 3, heads, d))
    o, lse = serving.paged_attention(qp, k_cache, v_cache, table, kv_lens, mask="causal", mods=spec.problem.mods,
                                     aux=aux)
    for b in range(4):
        keys = [serving.gather_pages(c, table[b], kv_lens[b]).transpose(1, 0, 2)[None] for c in (k_cache, v_cache)]
        want, _ = naive.attention(qp[b].transpose(1, 0, 2)[None], *keys, softcap=3.0, sinks=sinks, mask="causal",
                                  score_fn=lambda s, _, h, i, j, b=b: s + bias[b][h])
        assert np.allclose(o[b], want[0].transpose(1, 0, 2), atol=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 90), st.integers(1, 90), st.sampled_from([(16, 16), (32, 16), (16, 48)]),
       st.integers(0, 2**32 - 1))
def test_tile_classes_of_any_mask_mod_are_sound(data, nq, nk, tiles, seed):
    """Random index conditions (and int tables read by them): a full tile has every element visible, an
    empty one none, against the elementwise evaluation of the same tree."""
    expr = data.draw(expressions(Type.BOOL, score=False, depth=3))
    rng = np.random.default_rng(seed)
    lines = [f"mask_mod = {source(expr)}"]
    spec = spec_for(lines)
    batch, heads, lens = 2, 2, np.array([nk, max(nk - 7, 0)])
    aux = {"t1": rng.integers(-3, 3, 400), "t2": rng.integers(-3, 3, (400, 400))}
    try:
        from tiledsl.mods.checks import prepare_aux
        prepared = prepare_aux(spec.problem.mods, {n: aux[n] for n in ("t1", "t2") if f"{n}[" in lines[0]},
                               batch, heads, nq, nk, lens)
    except RuntimeInputError:
        assume(False)   # an index that can leave the tables, or an int past int32: refused before launch
    classes = classify(spec.problem, Tiling(nq, nk, *tiles), batch, heads, lens, prepared)
    g = grid(batch, heads, np.arange(nq), np.arange(nk), lens, nq)
    seen = np.broadcast_to(evaluate(expr, g.env(), prepared), (batch, heads, nq, nk))
    seen = seen & (np.arange(nk)[None, None, None, :] < lens[:, None, None, None])
    for i in range(classes.shape[2]):
        for j in range(classes.shape[3]):
            tile = seen[:, :, i * tiles[0]:(i + 1) * tiles[0], j * tiles[1]:(j + 1) * tiles[1]]
            assert not tile[classes[:, :, i, j] == EMPTY].any(), (source(expr), i, j)
            assert tile[classes[:, :, i, j] == FULL].all(), (source(expr), i, j)
