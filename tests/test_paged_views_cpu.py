"""The paged kernels' shared input checks and views (tiledsl/runtime/paged_views.py), on the CPU: NumPy
arrays stand in for GPU tensors (the test's `view` reads their shape and strides), so the stride
re-ordering, the shapes and every refusal are checked without a GPU. The calls are built immediately
(runtime/launch.CallBuilder), with the host check of the indices asked for (validate=True)."""
from __future__ import annotations

import numpy as np
import pytest

from tiledsl.runtime import index_checks, launch, paged_views
from tiledsl.errors import RuntimeInputError
from tiledsl.spec import DType, Problem
from tiledsl.runtime.tensors import TensorView

PROBLEM = Problem(64, 64, DType.BF16, kv_page_size=16, queries_per_seq=4)


@pytest.fixture(autouse=True)
def host_views(monkeypatch):
    def view(x, name, slot=-1):
        dtype = {np.int32: "int32", np.int64: "int64", np.float32: DType.FP32, np.float16: DType.BF16}[x.dtype.type]   # fp16 plays bf16
        return TensorView(name, 4096, x.shape, tuple(s // x.itemsize for s in x.strides), dtype, 0, x, slot)
    monkeypatch.setattr(paged_views, "view", view)
    monkeypatch.setattr(launch, "view", view)
    monkeypatch.setattr(index_checks, "capturing", lambda q: False)


def builder(q, k, v, table, lens, out=None, lse=None):
    return launch.CallBuilder("kern", (q, k, v, table, lens, out, lse),
                              ("q", "k_cache", "v_cache", "block_table", "kv_lens", "out", "lse"), q, immediate=True)


def views(q, k, v, table, lens):
    return paged_views.paged_views(builder(q, k, v, table, lens), PROBLEM, validate=True)


def inputs(batch=2, q_len=4, heads=8, kv_heads=2, pages=10, page=16, d=64, max_pages=4):
    rng = np.random.default_rng(0)
    q = np.zeros((batch, q_len, heads, d), np.float16)
    k, v = (np.zeros((pages, page, kv_heads, d), np.float16) for _ in range(2))
    table = rng.permutation(pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    lens = np.array([page * max_pages, 17][:batch], np.int32)
    return q, k, v, table, lens


def test_views_swap_the_middle_axes_and_shapes_come_from_the_lengths():
    q, k, v, table, lens = inputs()
    (qv, kv, vv, tv, lv), shapes = views(q, k, v, table, lens)
    # the launch is sized for the table's capacity (4 pages of 16): the kernel reads each kv_len itself
    assert (shapes.batch, shapes.heads, shapes.kv_heads, shapes.q_len, shapes.kv_len) == (2, 8, 2, 4, 64)
    assert qv.shape == (2, 8, 4, 64) and qv.strides == (4 * 8 * 64, 64, 8 * 64, 1)   # (batch, head, query)
    assert kv.shape == k.shape and kv.strides == (16 * 2 * 64, 64, 2 * 64, 1)         # (page, kv head, slot)
    assert tv.shape == table.shape and lv.shape == (2,)


@pytest.mark.parametrize("change, words", [
    (lambda a: {**a, "k": a["k"][:, :8]}, "built for pages of 16 keys"),
    (lambda a: {**a, "q": a["q"][..., :32]}, "built for head dims 64"),
    (lambda a: {**a, "v": a["v"][:, :, :1]}, "disagree"),
    (lambda a: {**a, "q": a["q"][:, :, :7]}, "not a multiple of 2 kv heads"),
    (lambda a: {**a, "table": a["table"].astype(np.int64)}, "block_table must be int32"),
    (lambda a: {**a, "lens": a["lens"][:1]}, "kv_lens must be a contiguous int32 array of shape (2,)"),
    (lambda a: {**a, "lens": np.array([65, 1], np.int32)}, "kv_lens"),             # over the table's 4 pages
    (lambda a: {**a, "table": np.full((2, 4), 10, np.int32)}, "block_table"),      # page 10 of 10
    (lambda a: {**a, "q": a["q"][0]}, "must be 4-d"),
])
def test_bad_inputs_are_refused_naming_the_tensor(change, words):
    q, k, v, table, lens = inputs()
    a = change({"q": q, "k": k, "v": v, "table": table, "lens": lens})
    with pytest.raises(RuntimeInputError, match=None) as err:
        views(a["q"], a["k"], a["v"], a["table"], a["lens"])
    assert words in str(err.value)


def test_outputs_are_checked_and_viewed_in_the_kernel_order():
    q, k, v, table, lens = inputs()
    _, shapes = views(q, k, v, table, lens)
    out, lse = np.zeros((2, 4, 8, 64), np.float16), np.zeros((2, 8, 4), np.float32)
    ov, lv = paged_views.paged_outputs(builder(q, k, v, table, lens, out, lse), PROBLEM, shapes, 5)
    assert ov.shape == (2, 8, 4, 64) and ov.strides == (4 * 8 * 64, 64, 8 * 64, 1) and lv.shape == (2, 8, 4)
    with pytest.raises(RuntimeInputError, match="lse must be a contiguous fp32"):
        paged_views.paged_outputs(builder(q, k, v, table, lens, out, lse.transpose(0, 2, 1)), PROBLEM, shapes, 5)
    with pytest.raises(RuntimeInputError, match="out must be"):
        paged_views.paged_outputs(builder(q, k, v, table, lens, out[:, :2], lse), PROBLEM, shapes, 5)


def test_api_views_refuse_by_name_and_build_the_mask():
    q, k, v, _, _ = inputs()
    qv, kv, vv, mask, window = paged_views.api_views("paged_attention", q, k, v, False, [100, 0])
    assert mask.value == "window" and window == (100, 0) and kv.shape == k.shape
    assert paged_views.api_views("paged_prefill", q, k, v, True, None)[3].value == "causal"
    with pytest.raises(ValueError, match="paged_attention: pass causal=True or window"):
        paged_views.api_views("paged_attention", q, k, v, True, (1, 0))
    with pytest.raises(RuntimeInputError, match=r"paged_prefill: the page size \(k_cache.shape\[1\]\) must be a power "
                                                 r"of two in 1..256, got 12"):
        paged_views.api_views("paged_prefill", q, k[:, :12], v[:, :12], False, None)
    with pytest.raises(RuntimeInputError, match="paged_attention: q must be fp16 or bf16"):
        paged_views.api_views("paged_attention", q.astype(np.float32), k, v, False, None)
