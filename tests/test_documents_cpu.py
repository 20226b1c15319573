"""Document masks and prefix-LM in the hopper forward without a GPU: the specs build (families.BUILT_MODS),
the layout holds the producer's document-span slot, the rendered kernel pastes mask_mods.cuh and walks the
documents' kv range, and the launch path (tests/host_stubs.py: everything but the GPU is the real code)
passes document_ids / document_bounds, refuses int64 ids and wrong shapes by name, and checks the ids' runs on
the host where index tensors are checked there (not with validate=False). The device code's arithmetic runs
on the host in tests/test_mask_mods_cpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import tiledsl
from tests.host_stubs import stub_device
from tiledsl.codegen.render import render
from tiledsl.errors import RuntimeInputError
from tiledsl.families import layout_of, lower, missing_template
from tiledsl.frontend.parse import load_specs
from tiledsl.mods.model import Documents, Modifications
from tiledsl.spec import DType, KernelSpec, Mask, Problem
from tiledsl.dispatch.tuned import TUNED


@pytest.fixture
def device(tmp_path):
    with stub_device(tmp_path) as dev:
        yield dev


def spec(mask="causal", d=128, **mods) -> KernelSpec:
    return KernelSpec("docs", Problem(d, d, DType.BF16, Mask(mask), mods=Modifications(**mods)),
                      TUNED[("sm_90", "bf16", d, mask)])


def test_bundled_document_and_prefix_specs_build():
    for name in ("document_d128.tile", "prefix_lm_d64.tile"):
        for s in load_specs(f"specs/mods/{name}"):
            assert missing_template(s) == "", s.name
            assert "mask_mods.cuh" in render(lower(s)) or "prefix_tile_end" in render(lower(s))


def test_layout_holds_the_span_slot_only_with_documents():
    with_docs = layout_of(spec(document=Documents.IDS))
    assert with_docs.buffer("document span").bytes == 8
    assert "document span" not in [b.name for b in layout_of(spec(prefix=64, mask="none")).buffers]
    assert with_docs.smem_bytes == layout_of(spec()).smem_bytes + 8


@pytest.mark.parametrize("documents", [Documents.IDS, Documents.BOUNDS])
def test_rendered_kernel_searches_the_documents(documents):
    source = render(lower(spec(document=documents)))
    assert "store_document_span(shared.document_span(), span)" in source
    assert "narrow_to_documents<C>(w.tile_begin, w.tile_end, span)" in source
    assert "tile_needs_mask_mods<C>(q0 + warp_row" in source
    search = "document_span(document_ids" if documents is Documents.IDS else "document_span_bounds(document_bounds"
    assert search in source
    plain = render(lower(spec()))
    assert "mask_mods" not in plain and "document" not in plain


def test_prefix_kernel_ends_its_range_at_the_prefix_or_the_diagonal():
    source = render(lower(spec(mask="none", prefix=300)))
    assert "prefix_tile_end<C>(tile_end, q0, diag)" in source and "PREFIX = 300" in source
    assert "document_span" not in source.split("extern \"C\"")[1]


def test_api_passes_the_ids_and_checks_their_runs_on_the_host(device):
    q, k = device.tensor((2, 4, 300, 128)), device.tensor((2, 2, 300, 128))
    runs = np.repeat(np.array([[0, 1, 2], [5, 6, 9]]), 100, axis=1)
    ids = device.index(runs)
    tiledsl.attention(q, k, k, causal=True, document_ids=ids)
    name, *_, values = device.last()
    assert "_doc_" in name and values[-2:] == [ids.data_ptr(), 300]
    resumed = runs.copy()
    resumed[1, 250:] = 5
    with pytest.raises(RuntimeInputError, match=r"document_ids\[1, 250\] = 5 resumes document 5, which ran from "
                                                r"index 0"):
        tiledsl.attention(q, k, k, causal=True, document_ids=device.index(resumed))
    tiledsl.attention(q, k, k, causal=True, document_ids=device.index(resumed), validate=False)   # not read
    with pytest.raises(RuntimeInputError, match="document_ids must be int32, got torch.int64"):
        tiledsl.attention(q, k, k, document_ids=device.tensor((2, 300), "int64"))
    with pytest.raises(RuntimeInputError, match=r"document_ids must be \(batch, kv_len\)"):
        tiledsl.attention(q, k, k, document_ids=device.index(runs[:, :299]))


def test_api_passes_the_bounds_and_their_count(device):
    q = device.tensor((2, 4, 300, 64))
    bounds = device.index([[0, 0, 100, 300], [3, 3, 3, 299]])
    tiledsl.attention(q, q, q, document_bounds=bounds)
    name, *_, values = device.last()
    assert "_docb_" in name and values[-3:] == [bounds.data_ptr(), 4, 4]
    with pytest.raises(RuntimeInputError, match=r"document_bounds\[0, 2\] = 100 is below"):
        tiledsl.attention(q, q, q, document_bounds=device.index([[0, 200, 100, 300], [0, 1, 2, 3]]))
