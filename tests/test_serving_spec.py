"""Serving layouts in the DSL (`kv_cache = paged(page = N)`, `layout = varlen`): checker rules and
spans, config/hash/name only when set, the families' refusal, the page_lookup op and its traffic."""
from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest

from tiledsl import parse_text
from tiledsl.cli.main import main
from tiledsl.errors import SpecError
from tiledsl.families import lower, missing_template
from tiledsl.frontend import space
from tiledsl.schedule.ops import OpKind
from tiledsl.schedule.passes import run_passes
from tiledsl.reference.forward import naive_attention, reference_attention
from tiledsl.reference.serving import gather_pages
from tiledsl.spec import Family, SeqLayout
from tiledsl.schedule.traffic import hbm_traffic, traffic_by_tensor

DECODE = "attention dec {\n    head_dim = 64\n    queries = 1\n%s}\n"
PREFILL = "attention pre {\n    head_dim = 64\n%s}\n"


def one(text: str):
    (spec,) = parse_text(text, "s.tile")
    return spec


def test_paged_and_varlen_settings_reach_the_spec_and_name():
    paged = one(DECODE % "    kv_cache = paged(page = 16)\n")
    assert paged.problem.kv_page_size == 16 and paged.family is Family.DECODE
    assert "_paged16_" in paged.kernel_name and paged.config()["problem"]["kv_page_size"] == 16
    varlen = one(PREFILL % "    layout = varlen\n    schedule {\n        warpgroups producer 1, consumer 2\n    }\n")
    assert varlen.problem.seq_layout is SeqLayout.VARLEN and "_varlen_" in varlen.kernel_name
    assert varlen.config()["problem"]["seq_layout"] == "varlen"


def test_defaults_leave_name_config_and_hash_as_before():
    plain = one(PREFILL % "")
    written = one(PREFILL % "    kv_cache = contiguous\n    layout = batched\n")
    assert written == plain and written.config_hash == plain.config_hash
    assert "kv_page_size" not in plain.config()["problem"] and "seq_layout" not in plain.config()["problem"]
    assert plain.kernel_name == "fa2_d64_bf16_q128_kv64_w4q_s2"
    paged = replace(plain, problem=replace(plain.problem, kv_page_size=16))
    assert paged.config_hash != plain.config_hash and paged.kernel_name != plain.kernel_name


@pytest.mark.parametrize("setting, line_part, message", [
    ("kv_cache = paged(page = 24)", "24", "kv_cache page size must be a power of two in 1..256, got 24"),
    ("kv_cache = paged(page = 512)", "512", "power of two in 1..256"),
    ("kv_cache = paged(page = 0)", "0", "power of two in 1..256"),
    ("kv_cache = paged", "paged", "a paged kv_cache needs its page size"),
    ("kv_cache = paged(size = 16)", "size", "unknown paged argument 'size'"),
    ("kv_cache = paged(page = 16, page = 32)", "page = 32", "paged(...) takes one argument"),
    ("kv_cache = contiguous(page = 16)", "contiguous(page = 16)", "takes no arguments"),
    ("kv_cache = pagd(page = 16)", "pagd", "did you mean 'paged'"),
    ("kv_cache = 16", "16", "kv_cache takes a name"),
    ("layout = varlenn", "varlenn", "did you mean 'varlen'"),
    ("layout = 3", "3", "layout takes a name"),
])
def test_bad_serving_settings_point_at_the_text(setting, line_part, message, error_parts):
    with pytest.raises(SpecError) as info:
        parse_text(PREFILL % f"    {setting}\n", "bad.tile")
    err = error_parts(info.value.render())
    assert info.value.hint and err["line"] == 3 and message in err["message"]
    assert err["underlined"] == line_part


def test_varlen_decode_is_refused_at_layout(error_parts):
    with pytest.raises(SpecError) as info:
        parse_text(DECODE % "    layout = varlen\n", "bad.tile")
    err = error_parts(info.value.render())
    assert err["line"] == 4 and "queries" in err["message"] and err["underlined"] == "layout = varlen"


@pytest.mark.parametrize("setting, family, what", [
    ("kv_cache = paged(page = 16)\n    schedule {\n        warps 8\n        mma wgmma\n    }", "fa2", "paged KV on wgmma (mma.sync reads it)"),
    ("layout = varlen", "fa2", "layout = varlen"),
    ("kv_cache = paged(page = 64)\n    schedule {\n        order kv, q\n        warps 4 along kv\n    }", "fa1", "paged KV"),
    ("kv_cache = paged(page = 16)\n    schedule {\n        warpgroups producer 1, consumer 2\n    }", "hopper", "paged KV"),
])
def test_every_family_refuses_serving_layouts_at_check_and_lowering(setting, family, what, error_parts):
    """Check refuses what no template reads (families.feature_refusal), and so does lowering, alike."""
    text = PREFILL % f"    {setting}\n"
    with pytest.raises(SpecError) as info:
        one(text)
    err = error_parts(info.value.render())
    assert err["message"] == f"{what} has no CUDA template yet for the {family} family" and err["line"] == 3
    with mock.patch.object(space, "validate", lambda spec, hints=True: None):   # the spec as written
        spec = one(text)
    with pytest.raises(SpecError) as lowered:
        lower(spec)
    assert lowered.value.render() == info.value.render() and missing_template(spec) == err["message"]


def test_decode_and_fa2_build_paged_and_fa2_wgmma_paged_is_refused(write_spec, tmp_path, capsys):
    path = write_spec(DECODE % "    kv_cache = paged(page = 16)\n")
    assert lower(one(path.read_text())).kv_pages in ("rows", "pages", "slice") and missing_template(one(path.read_text())) == ""
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 0
    assert "block_table" in (tmp_path / "out" / f"{one(path.read_text()).kernel_name}.cu").read_text()
    prefill = write_spec(PREFILL % "    kv_cache = paged(page = 16)\n")
    assert main(["compile", str(prefill), "-o", str(tmp_path / "out")]) == 0
    assert "block_table" in (tmp_path / "out" / f"{one(prefill.read_text()).kernel_name}.cu").read_text()
    wgmma = write_spec(PREFILL % "    kv_cache = paged(page = 16)\n    schedule {\n        warps 8\n        mma wgmma\n    }\n")
    capsys.readouterr()
    for command in (["check"], ["compile", "-o", str(tmp_path / "out")]):   # refused alike, at the setting
        assert main([*command[:1], str(wgmma), *command[1:]]) == 2
        assert "paged KV on wgmma (mma.sync reads it) has no CUDA template yet for the fa2 family" in \
            capsys.readouterr().err


def test_page_lookup_feeds_both_loads_only_when_paged():
    plain = run_passes(one(DECODE % ""))
    assert not plain.has(OpKind.PAGE_LOOKUP)
    graph = run_passes(one(DECODE % "    kv_cache = paged(page = 16)\n"))
    (lookup,) = graph.names(OpKind.PAGE_LOOKUP)
    assert {v for _, v in graph.dag.out_edges(lookup)} == {"load_k", "load_v"}
    assert graph.op(lookup).loops == graph.op("load_k").loops and graph.op(lookup).sizes == (64 // 16,)
    assert graph.order.index(lookup) < graph.order.index("load_k")


# entries per (batch, head): the pages each kv tile (Bc = 64) touches; a page of 256 keys is read
# again by each of its 4 tiles
@pytest.mark.parametrize("page, seqlen, entries", [(16, 4096, 256), (1, 100, 100), (256, 4096, 64), (64, 1000, 16)])
def test_traffic_counts_block_table_entries(page, seqlen, entries):
    spec = one(DECODE % f"    kv_cache = paged(page = {page})\n")
    traffic = hbm_traffic(run_passes(spec), batch=2, heads=4, seqlen_q=1, seqlen_kv=seqlen)
    by_tensor = traffic_by_tensor(traffic)
    assert by_tensor[("block_table", "read")] == entries * 2 * 4 * 4
    plain = traffic_by_tensor(hbm_traffic(run_passes(one(DECODE % "")), 2, 4, 1, seqlen))
    assert by_tensor[("K", "read")] == plain[("K", "read")] and ("block_table", "read") not in plain


def test_explain_prints_the_lookup_and_its_traffic(write_spec, capsys):
    path = write_spec(DECODE % "    kv_cache = paged(page = 16)\n")
    assert main(["explain", str(path), "--seqlen", "4096", "--heads", "16"]) == 0
    out = capsys.readouterr().out
    assert "pages_j = block_table[b, j*Bc/16 : (j+1)*Bc/16]" in out
    assert "read  block_table     16.38 KB" in out   # 16 heads x 4096/16 entries x 4 B


def test_graph_executor_runs_a_paged_schedule_on_gathered_keys():
    import numpy as np
    spec = one(DECODE % "    kv_cache = paged(page = 16)\n")
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((8, 16, 1, 64))
    table = rng.permutation(8).astype(np.int32)
    k = gather_pages(cache, table, 100)[None].transpose(0, 2, 1, 3)
    q = rng.standard_normal((1, 1, 1, 64))
    o, lse = reference_attention(spec, q, k, k)
    o_ref, lse_ref = naive_attention(q, k, k)
    assert np.abs(o - o_ref).max() < 1e-12 and np.abs(lse - lse_ref).max() < 1e-12
