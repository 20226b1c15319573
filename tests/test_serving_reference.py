"""The serving references (paged KV, varlen) against reference.naive_attention on gathered /
padded inputs to 1e-12, and the input checks (serving_checks): each bad tensor named with its
first bad index. Small head dims keep it fast."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.errors import RuntimeInputError
from tiledsl.reference.forward import naive_attention
from tiledsl.runtime.serving_checks import check_paged, check_varlen
from tiledsl.reference.serving import paged_attention, varlen_attention
from tiledsl.spec import Mask

MASKS = [(Mask.NONE, 0, 0), (Mask.CAUSAL, 0, 0), (Mask.WINDOW, 5, 2)]


def close(a, b):
    assert a.shape == b.shape
    assert np.array_equal(np.isneginf(a), np.isneginf(b))
    finite = np.isfinite(a)
    assert np.abs(np.where(finite, a, 0) - np.where(finite, b, 0)).max(initial=0) < 1e-12


@pytest.mark.parametrize("page", [1, 16, 64, 256])
@pytest.mark.parametrize("mask, left, right", MASKS, ids=lambda m: getattr(m, "value", str(m)))
def test_paged_matches_naive_on_gathered_keys(page, mask, left, right):
    rng = np.random.default_rng(page)
    batch, nq, heads, kv_heads, d, dv = 6, 3, 4, 2, 8, 16
    lens = np.array([0, 1, page - 1, page, page + 1, 3 * page + 1], dtype=np.int32)
    max_pages = int(-(-lens.max() // page))
    num_pages = batch * max_pages
    k_cache = rng.standard_normal((num_pages, page, kv_heads, d))
    v_cache = rng.standard_normal((num_pages, page, kv_heads, dv))
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    table[3, 0] = table[4, 0]          # sequences 3 and 4 share their first page (a common prefix)
    table[1, 1:] = -1                  # entries past a sequence's pages are never read
    q = rng.standard_normal((batch, nq, heads, d))
    o, lse = paged_attention(q, k_cache, v_cache, table, lens, mask, left, right)
    # the padded batch, built page by page: whole pages concatenated, then cut to kv_len
    width = max_pages * page
    k = np.zeros((batch, kv_heads, width, d))
    v = np.zeros((batch, kv_heads, width, dv))
    for b in range(batch):
        for i in range(-(-int(lens[b]) // page)):
            k[b, :, i * page:(i + 1) * page] = k_cache[table[b, i]].transpose(1, 0, 2)
            v[b, :, i * page:(i + 1) * page] = v_cache[table[b, i]].transpose(1, 0, 2)
    o_ref, lse_ref = naive_attention(q.transpose(0, 2, 1, 3), k, v, mask, left, right, kv_lens=lens)
    close(o, o_ref.transpose(0, 2, 1, 3))
    close(lse, lse_ref.transpose(0, 2, 1))
    assert np.isneginf(lse[0]).all() and (o[0] == 0).all()   # kv_len 0: O = 0, lse = -inf


@pytest.mark.parametrize("mask, left, right", MASKS, ids=lambda m: getattr(m, "value", str(m)))
def test_varlen_matches_naive_per_sequence(mask, left, right):
    rng = np.random.default_rng(7)
    heads, kv_heads, d = 2, 1, 8
    long = 4097 if mask is Mask.CAUSAL else 100   # one long sequence is enough (it dominates the time)
    q_lens = [1, 17, 1000, long, 5]
    k_lens = [1, 40, 1000, long, 0]    # bottom-right: 17 queries over 40 keys; 5 queries, no keys
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], heads, d))
    k = rng.standard_normal((cu_k[-1], kv_heads, d))
    v = rng.standard_normal((cu_k[-1], kv_heads, d))
    o, lse = varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), mask, left, right)
    for b in range(len(q_lens)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        as_batch = lambda x: x.transpose(1, 0, 2)[None]   # noqa: E731  (tokens, heads, d) -> (1, heads, tokens, d)
        o_ref, lse_ref = naive_attention(as_batch(q[rows]), as_batch(k[keys]), as_batch(v[keys]), mask, left, right)
        close(o[rows], o_ref[0].transpose(1, 0, 2))
        close(lse[rows], lse_ref[0].T)


# ---- input checks ------------------------------------------------------------------------------

def paged_inputs():
    table = np.array([[0, 1, -1], [2, 3, 4]], dtype=np.int32)
    return table, np.array([20, 33], dtype=np.int32)


def test_good_paged_inputs_pass():
    table, lens = paged_inputs()
    check_paged(table, lens, num_pages=5, page_size=16)


@pytest.mark.parametrize("change, message", [
    (lambda t, l: (t.astype(np.int64), l), "block_table must be int32, got int64"),
    (lambda t, l: (t[0], l), "block_table must be (batch, max pages per sequence)"),
    (lambda t, l: (t, l.astype(np.int64)), "kv_lens must be int32, got int64"),
    (lambda t, l: (t, l[:1]), "kv_lens must be (2,), got shape (1,)"),
    (lambda t, l: (t, np.array([20, -1], np.int32)), "kv_lens[1] = -1 is negative"),
    (lambda t, l: (t, np.array([20, 49], np.int32)), "kv_lens[1] = 49 is over the cache: block_table gives each "
                                                      "sequence 3 pages x 16 = 48 keys"),
    (lambda t, l: (t, np.array([33, 33], np.int32)), "block_table[0, 2] = -1 is out of range: the cache has 5 pages"),
    (lambda t, l: (np.array([[0, 5, 0], [2, 3, 4]], np.int32), l), "block_table[0, 1] = 5 is out of range"),
    (lambda t, l: (np.array([[0, 1, 0], [2, 7, 9]], np.int32), l), "block_table[1, 1] = 7 is out of range"),
])
def test_bad_paged_inputs_name_the_tensor_and_index(change, message):
    table, lens = change(*paged_inputs())
    with pytest.raises(RuntimeInputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_paged(table, lens, num_pages=5, page_size=16)


def test_a_bad_block_table_is_refused_before_any_read():
    table, lens = paged_inputs()
    table[1, 2] = 1 << 30
    cache = np.zeros((5, 16, 1, 8))
    with pytest.raises(RuntimeInputError, match=r"block_table\[1, 2\] = 1073741824"):
        paged_attention(np.zeros((2, 1, 1, 8)), cache, cache, table, lens)


def cu(*values):
    return np.array(values, dtype=np.int32)


@pytest.mark.parametrize("args, message", [
    ((cu(0, 3, 5).astype(np.int64), cu(0, 4, 9), 5, 9), "cu_seqlens_q must be int32, got int64"),
    ((cu(1, 3, 5), cu(0, 4, 9), 5, 9), r"cu_seqlens_q\[0\] = 1; it must start at 0"),
    ((cu(0, 3, 5), cu(0, 4, 2, 9), 5, 9), r"cu_seqlens_k is not non-decreasing: cu_seqlens_k\[2\] = 2 < "
                                         r"cu_seqlens_k\[1\] = 4"),
    ((cu(0, 3, 5), cu(0, 4, 9), 6, 9), r"cu_seqlens_q\[2\] = 5, but the packed tensor holds 6 tokens"),
    ((cu(0, 3, 5), cu(0, 9), 5, 9), "cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    ((cu(0, 3, 5), cu(0, 4, 9), 5, 9, 2), r"max_seqlen for cu_seqlens_q is 2, but sequence 0 has 3 tokens"),
    ((cu(0, 3, 5), cu(0, 4, 9), 5, 9, 3, 4), r"max_seqlen for cu_seqlens_k is 4, but sequence 1 has 5 tokens "
                                             r"\(cu_seqlens_k\[2\] - cu_seqlens_k\[1\]\)"),
])
def test_bad_cu_seqlens_name_the_tensor_and_index(args, message):
    with pytest.raises(RuntimeInputError, match=message):
        check_varlen(*args)


def test_good_cu_seqlens_give_the_lengths():
    q, k = check_varlen(cu(0, 3, 3, 5), cu(0, 4, 4, 9), 5, 9, 3, 5)
    assert q.tolist() == [3, 0, 2] and k.tolist() == [4, 0, 5]
