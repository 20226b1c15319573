"""`tiledsl explain` of FP8 attention (dtype = e4m3): the quantization section (descale granularity and shapes, P
scaled and rounded to e4m3 before P V, V's transpose on chip) and the HBM bytes per tensor beside bf16's, in the
text, the summary and --json, checked against closed forms of the traffic."""
from __future__ import annotations

import json

import pytest

from tiledsl.cli.main import main
from tiledsl.cli.report import explain
from tiledsl.frontend.parse import parse_text
from tiledsl.schedule.traffic import element_bytes

SPEC = """attention fp8 {{
    head_dim = {d}
    dtype = e4m3
    {extra}
    schedule {{
        tile q = 128, kv = {kv}
        warpgroups producer 1 regs 32, consumer 2 regs 232
        pipeline 2 stages via tma
    }}
}}
"""


def fp8(d=128, kv=128, extra=""):
    return parse_text(SPEC.format(d=d, kv=kv, extra=extra))[0]


def test_o_is_counted_in_its_output_type_and_qkv_in_bytes():
    for extra, out in (("", 2), ("out_dtype = fp16", 2)):
        p = fp8(extra=extra).problem
        assert [element_bytes(t, p) for t in ("Q", "K", "V", "O", "lse")] == [1, 1, 1, out, 4]
    bf16 = parse_text(SPEC.replace("dtype = e4m3", "dtype = bf16").replace("regs 32, consumer 2 regs 232",
                                                                              "regs 24, consumer 2 regs 240")
                      .format(d=128, kv=128, extra=""))[0].problem
    assert [element_bytes(t, bf16) for t in ("Q", "K", "V", "O")] == [2, 2, 2, 2]


def _row(text: str, mode: str, tensor: str) -> str:
    """The quantization section's row of (mode, tensor)."""
    section = text.split("FP8 (e4m3) quantization:")[1]
    return next(line for line in section.splitlines() if line.split()[:2] == [mode, tensor])


@pytest.mark.parametrize("d, kv", [(64, 128), (128, 128), (256, 64)])
def test_the_text_states_descales_p_v_transpose_and_bytes_beside_bf16(d, kv):
    batch, heads, kv_heads, n = 2, 8, 2, 1024
    text = explain(fp8(d, kv), batch=batch, heads=heads, seqlen_q=n, kv_heads=kv_heads)
    assert "descales (per_head): one per (batch, kv head), Q's shared by the kv head's query heads; float32 " \
           f"q_descale ({batch}, {kv_heads}), k_descale ({batch}, {kv_heads}), v_descale ({batch}, {kv_heads})" in text
    assert "P: scaled by 256 into e4m3's range and rounded to e4m3" in text and "before P V" in text
    swizzle = 64 if kv == 64 else 128
    assert (f"V: transposed on chip: 96 producer threads (warps 1..3) write each V tile as V^T (dv rows of Bc key "
            f"bytes, {swizzle} B swizzle; 2 x {d * kv} B)") in text
    # closed forms without a mask (the model counts every query head's K and V tiles): Q and O once, K and V once
    # per q tile
    q_elements, kv_elements = batch * heads * n * d, batch * heads * (n // 128) * n * d
    for mode, tensor, elements, size in (("read", "Q", q_elements, 1), ("read", "K", kv_elements, 1),
                                         ("read", "V", kv_elements, 1), ("write", "O", q_elements, 2)):
        row = _row(text, mode, tensor)
        assert f"({size} B each)" in row
        mega = [float(word) for word, unit in zip(row.split(), row.split()[1:]) if unit == "MB"]
        assert mega == pytest.approx([elements * size / 1e6, elements * 2 / 1e6], abs=0.006), row


def test_per_block_and_packed_descales_are_named_with_their_shapes():
    text = explain(fp8(extra="descale = per_block\n    mask = causal"), batch=3, heads=4, seqlen_q=300, kv_heads=1)
    assert ("descales (per_block): one per Q tile of 128 rows of a (batch, head) and per K / V tile of 128 keys of a "
            "(batch, kv head); float32 q_descale (3, 4, 3), k_descale (3, 1, 3), v_descale (3, 1, 3)") in text
    packed = explain(fp8(extra="layout = varlen\n    descale = per_tensor"), batch=5, heads=4, seqlen_q=200)
    assert "descales (per_tensor): one per tensor; float32 q_descale (1,), k_descale (1,), v_descale (1,)" in packed
    per_sequence = explain(fp8(extra="layout = varlen"), batch=5, heads=4, seqlen_q=200, kv_heads=2)
    assert "one per (sequence, kv head)" in per_sequence and "q_descale (5, 2)" in per_sequence


def test_16bit_kernels_have_no_quantization_section():
    spec = parse_text(SPEC.replace("dtype = e4m3", "dtype = bf16").replace("regs 32, consumer 2 regs 232",
                                                                              "regs 24, consumer 2 regs 240")
                      .format(d=128, kv=128, extra=""))[0]
    assert "quantization" not in explain(spec) and "FP8" not in explain(spec, summary=True)


def test_summary_names_the_quantization_and_both_totals():
    summary = explain(fp8(), heads=16, seqlen_q=4096)
    short = explain(fp8(), heads=16, seqlen_q=4096, summary=True)
    assert "FP8: descales per_head; P x 256 rounded to e4m3 before P V; V transposed on chip; HBM " in short
    total = next(line for line in summary.split("FP8 (e4m3) quantization:")[1].splitlines() if "total" in line)
    bytes_here, bytes_bf16 = (f"{w} {u}" for w, u in zip(total.split(), total.split()[1:]) if u in ("MB", "GB"))
    assert f"HBM {bytes_here} ({bytes_bf16} on bf16 inputs)" in short


def test_json_carries_the_quantization_and_the_bytes(tmp_path, capsys):
    path = tmp_path / "fp8.tile"
    path.write_text(SPEC.format(d=128, kv=128, extra="out_dtype = fp16") + SPEC.replace("attention fp8", "attention "
                    "bf16").replace("dtype = e4m3", "dtype = bf16").replace("regs 32, consumer 2 regs 232",
                                                                            "regs 24, consumer 2 regs 240")
                    .format(d=128, kv=128, extra=""))
    assert main(["explain", str(path), "--json", "--seqlen", "512", "--heads", "4", "--kv-heads", "2"]) == 0
    records = json.loads(capsys.readouterr().out)
    fp8_record, bf16_record = records
    assert fp8_record["dtype"] == "e4m3" and fp8_record["out_dtype"] == "fp16"
    q = fp8_record["quantization"]
    assert q["descale"] == "per_head" and q["descale_shapes"] == {name: [1, 2] for name in
                                                                  ("q_descale", "k_descale", "v_descale")}
    assert q["p_scale"] == 256.0 and q["p_rounded_to"] == "e4m3" and q["v_transpose"]["threads"] == 96
    rows = {(r["tensor"], r["mode"]): r for r in fp8_record["hbm"]["tensors"]}
    assert rows[("Q", "read")]["element_bytes"] == 1 and rows[("O", "write")]["element_bytes"] == 2
    assert all(r["bytes"] == r["elements"] * r["element_bytes"] for r in rows.values())
    assert rows[("K", "read")]["bf16_bytes"] == 2 * rows[("K", "read")]["bytes"]
    assert sum(r["bytes"] for r in rows.values()) == fp8_record["hbm"]["bytes"]
    # the bf16 kernel of the same tiles moves what the FP8 record's bf16 column says
    assert bf16_record["quantization"] is None and "bf16_bytes" not in bf16_record["hbm"]["tensors"][0]
    assert bf16_record["hbm"]["bytes"] == sum(r["bf16_bytes"] for r in rows.values())


def test_json_of_a_spec_check_refuses_is_the_error_at_its_line(tmp_path, capsys):
    path = tmp_path / "bad.tile"
    path.write_text(SPEC.format(d=128, kv=128, extra="layout = varlen\n    descale = per_block"))
    assert main(["explain", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "descale = per_block indexes the tiles" in captured.err and "bad.tile:5" in \
        captured.err


@pytest.mark.parametrize("kv, landing", [(128, 2), (256, 1)])
def test_explain_shows_the_transposers_and_their_barrier(kv, landing):
    """The producer warpgroup's warps 1..3 are a role of their own: they wait for V to land, wait for V^T's slot,
    transpose and arrive on vt_full (96 threads, no TMA bytes), which the consumers' P V and the producer's next V
    copy wait on; V lands in a ring of `landing` slots."""
    text = explain(fp8(kv=kv))
    assert "transposer 3 warp(s) of the producer warpgroup, 96 threads" in text
    vt = next(line for line in text.splitlines() if line.strip().startswith("vt_full"))
    assert vt.split()[:4] == ["vt_full", "mbarrier", "96", "0"]
    assert "arrive_vt_full (transposer) -> wait_v_slot, wait_v_full (consumer/producer)" in vt
    v_full = next(line for line in text.splitlines() if line.strip().startswith("v_full "))
    assert "-> wait_v_landed (transposer)" in v_full and (f"[{landing} per stage]" in v_full) == (landing > 1)
    assert "transposer: V^T_j = V_j^T -> shared" in text
    assert f"vt_full[(j - {landing}) % 2]" in text if landing == 1 else "vt_full[j % 2]" in text
