"""`tiledsl explain`: loop nests, source lines, budgets, traffic vs closed forms, DOT, the CLI."""
from __future__ import annotations

import math
import re

import pytest

from tiledsl.cli.main import main
from tiledsl.errors import SpecError
from tiledsl.cli.report import explain, to_dot
from tiledsl.schedule.passes import run_passes
from tiledsl.spec import AUTO, Axis, KernelSpec, LoopOrder, Problem, Schedule

FA2_TEXT = """# FA2
attention fa2_d64 {
    head_dim = 64
    dtype    = bf16
    mask     = none
    schedule {
        order    q, kv
        tile     q = 128, kv = 64
        warps    8 along q
        pipeline 2 stages via cp.async
    }
}
"""
FA1_TEXT = FA2_TEXT.replace("fa2_d64", "fa1_d64").replace("order    q, kv", "order    kv, q").replace(
    "q = 128, kv = 64", "q = 64, kv = 128").replace("warps    8", "warps    4")
BIG_TEXT = """attention too_big {
    head_dim = 256
    dtype    = bf16
    schedule {
        order    q, kv
        tile     q = 256, kv = 256
        warps    4 along q
        pipeline 3 stages via cp.async
    }
}
"""
DECODE_TEXT = """attention dec {
    head_dim = 128
    queries  = 1
    schedule {
        tile     q = 16, kv = 64
        warps    4 along kv
        split    kv = auto
    }
}
"""


def load(write_spec, text, name):
    from tiledsl.frontend.parse import load_specs
    return load_specs(write_spec(text, name))[0]


def elements(report: str, label: str) -> int:
    return int(re.search(rf"{label}\s.*\((\d+) elements", report).group(1))


def test_fa1_and_fa2_print_different_loop_nests_with_source_lines(write_spec):
    fa2 = explain(load(write_spec, FA2_TEXT, "fa2_d64.tile"), seqlen_q=1024)
    fa1 = explain(load(write_spec, FA1_TEXT, "fa1_d64.tile"), seqlen_q=1024)
    nest2 = fa2.split("loop nest:")[1].split("ops in emission order:")[0]
    nest1 = fa1.split("loop nest:")[1].split("ops in emission order:")[0]
    assert nest2.index("for i in q tiles") < nest2.index("for j in kv tiles")
    assert nest1.index("for j in kv tiles") < nest1.index("for i in q tiles")
    assert "O_i, m_i, l_i <- HBM" in nest1 and "HBM <- O_i, m_i, l_i" in nest1
    assert "O_i, m_i, l_i <- HBM" not in nest2 and "O = O / l; lse = m + log l" in nest2
    # each line names the DSL line it came from: tile on line 8, pipeline on 10, order on 7
    assert re.search(r"Q_i = Q\[.*\[fa2_d64\.tile:8\]", nest2)
    assert re.search(r"K_j = K\[.*\[fa2_d64\.tile:10\]", nest2)
    assert re.search(r"for i in q tiles.*\[fa2_d64\.tile:7\]", nest2)
    for section in ("ops in emission order:", "on-chip budget:", "HBM traffic", "FLOPs:", "ratio standard"):
        assert section in fa2 and section in fa1


@pytest.mark.parametrize("n", [512, 1000, 4096])
def test_explain_traffic_matches_closed_forms(write_spec, n):
    batch, heads, d = 2, 3, 64
    fa2 = explain(load(write_spec, FA2_TEXT, "fa2_d64.tile"), batch=batch, heads=heads, seqlen_q=n)
    fa1 = explain(load(write_spec, FA1_TEXT, "fa1_d64.tile"), batch=batch, heads=heads, seqlen_q=n)
    br, bc = 128, 128
    fa2_form = 2 * n * d + math.ceil(n / br) * 2 * n * d + n            # = 2Nd + 2N^2 d/Br + N when Br | N
    fa1_form = 2 * n * d + math.ceil(n / bc) * (3 * n * d + 4 * n)
    assert elements(fa2, "total") == batch * heads * fa2_form
    assert elements(fa1, "total") == batch * heads * fa1_form
    assert elements(fa2, "standard") == batch * heads * (4 * n * n + 4 * n * d)


def test_budget_section_lists_buffers_and_limits(write_spec):
    text = explain(load(write_spec, FA2_TEXT, "fa2_d64.tile"))
    assert re.search(r"Q\s+16384 B\s+Br\*d\*2 = 128\*64\*2", text)
    assert re.search(r"K\s+16384 B\s+2x Bc\*d\*2", text)
    assert re.search(r"total\s+49152 B\s+21% of 232448", text)
    assert "registers per thread (estimate, limit 255; 256 threads per block)" in text


def test_illegal_schedule_is_refused_with_bytes_at_the_tile_line(write_spec):
    with pytest.raises(SpecError) as err:   # refused where it is loaded: check runs the same layout rules
        explain(load(write_spec, BIG_TEXT, "big.tile"))
    e = err.value
    assert e.span.line == 6 and e.span.file.endswith("big.tile")
    assert "shared memory: 917504 bytes needed" in e.message and "> 232448 available on sm_90" in e.message


def test_cli_refuses_illegal_schedule_with_exit_2(write_spec, capsys):
    path = write_spec(BIG_TEXT, "big.tile")
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "big.tile:6:" in err and "917504 bytes needed" in err and "232448 available" in err


def test_explain_prints_one_schedule_and_the_kernels_steps_follow_its_emission_order(write_spec):
    # The generated-kernel section is the same schedule as the loop nest and op table: every CUDA
    # step names the graph op it lowers, in the op table's order, and the steps are the plan's.
    from tiledsl.families import lower
    for text_, name in ((DECODE_TEXT, "dec.tile"), (FA2_TEXT, "fa2.tile"), (FA1_TEXT, "fa1_d64.tile")):
        spec = load(write_spec, text_, name)
        plan = lower(spec)
        text = explain(spec, batch=2, heads=4)
        table = text.split("ops in emission order:")[1].split("on-chip budget:")[0]
        emitted = [line.split()[1] for line in table.splitlines() if re.match(r"\s+\d+\. ", line)]
        section = text[text.index("generated kernel ("):]
        assert plan.kernel_name in section and f"{plan.launch.smem_bytes} B shared memory" in section
        steps = re.findall(r"^ {8}(\S+)\s+-> (\S+)", section, re.M)
        assert steps == [(op.node, op.kind) for _, body in plan.loop_bodies for op in body]
        for loop, body in plan.loop_bodies:
            positions = [emitted.index(op.node) for op in body]
            assert positions == sorted(positions) and all(emitted.index(loop) < p for p in positions)
        assert all(note in section for note in plan.notes)
        assert "merges its warps once" not in text and "differ" not in section
    from pathlib import Path
    from tiledsl.frontend.parse import load_spec
    spec = load_spec(str(Path(__file__).resolve().parent.parent / "specs" / "hopper_d128_causal.tile"))
    hopper = explain(spec)
    section = hopper[hopper.index("generated kernel ("):]
    assert lower(spec).kernel_name in section and "mma_qk" in section and "turn_wait" in section


def test_decode_auto_split_prints_the_count_and_why(write_spec):
    spec = load(write_spec, DECODE_TEXT, "dec.tile")
    text = explain(spec, batch=2, heads=4, seqlen_kv=65536)
    m = re.search(r"split kv = auto: (\d+) splits \(chosen for this shape\): (.*)", text)
    from tiledsl.families import lower
    from tiledsl.lower.decode import decode_blocks_per_sm
    slots = 132 * decode_blocks_per_sm(lower(spec))                      # resident blocks, as the runtime
    assert m and int(m.group(1)) == slots // 8 and "one wave" in m.group(2)   # 8 blocks (2 x 4 kv heads)
    assert "the last split's block to finish" in text and "O_part[s" in text   # merged in the same launch
    full = explain(spec, batch=64, heads=32, seqlen_kv=4096)          # 2048 blocks fill 132 SMs
    assert "split kv = auto: 1 splits (chosen for this shape)" in full and "already fill" in full


def test_cli_prints_every_spec_and_writes_dot(write_spec, tmp_path, capsys):
    a, b = write_spec(FA2_TEXT, "fa2_d64.tile"), write_spec(FA1_TEXT, "fa1_d64.tile")
    dot = tmp_path / "g.dot"
    assert main(["explain", str(a), str(b), "--seqlen", "2048", "--batch", "2", "--heads", "8",
                 "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "fa2_d64: fa2_d64_bf16" in out and "fa1_d64: fa1_d64_bf16" in out
    assert "batch 2 x heads 8, seqlen q 2048, kv 2048" in out
    assert not dot.exists()   # two graphs: one digraph per file (`dot -Tpng` reads one), named by kernel
    files = sorted(tmp_path.glob("g.*.dot"))
    assert [f.name for f in files] == sorted(f"g.{n}.dot" for n in ("fa1_d64_bf16_q64_kv128_w4q_s2",
                                                                    "fa2_d64_bf16_q128_kv64_w8q_s2")), files
    for f in files:
        text = f.read_text()
        assert text.count("digraph ") == 1 and text.count("{") == text.count("}")
    text = (tmp_path / "g.fa2_d64_bf16_q128_kv64_w8q_s2.dot").read_text()
    assert 'subgraph "cluster_loop_kv"' in text and '"load_q" -> "mma_qk"' in text


def test_dot_is_deterministic_and_marks_sync_and_carried_edges():
    spec = KernelSpec("h", Problem(128, 128), Schedule(tile_q=128, tile_kv=128, producer_warpgroups=1,
                                                       producer_regs=24, consumer_warpgroups=2, consumer_regs=240))
    g = run_passes(spec)
    text = to_dot(g)
    assert text == to_dot(run_passes(spec))
    assert '"arrive_k_full" -> "wait_k_full" [label="k_full", style=dashed]' in text
    assert "style=dotted" in text and "fillcolor=lightblue" in text
    for name in g.names():
        assert (f'"cluster_{name}"' if g.op(name).kind.value == "loop" else f'"{name}"') in text


def test_explain_without_spans_uses_the_kernel_name():
    spec = KernelSpec("bare", Problem(64, 64), Schedule(order=LoopOrder.KV_OUTER, tile_q=64, tile_kv=64,
                                                        warps=4, warp_axis=Axis.KV))
    text = explain(spec, seqlen_q=256)
    assert "[bare]" in text and "merge the 4 warps'" in text and "warp partials" in text
    decode = KernelSpec("d", Problem(64, 64, queries_per_seq=1), Schedule(tile_q=16, tile_kv=64, warp_axis=Axis.KV,
                                                                          split_kv=AUTO))
    assert "seqlen q 1, kv 4096" in explain(decode)


def test_cli_explains_the_legal_configs_of_a_space_and_reports_the_refused(write_spec, capsys):
    space = FA2_TEXT.replace("head_dim = 64", "head_dim = 128").replace("kv = 64", "kv in {64, 128}").replace(
        "warps    8", "warps    4")
    assert main(["explain", str(write_spec(space, "space.tile")), "--seqlen", "512"]) == 0   # one config is legal
    captured = capsys.readouterr()
    assert "fa2_d64: fa2_d128_bf16_q128_kv64_w4q_s2" in captured.out   # the block is still named fa2_d64
    assert "space 'fa2_d64': 2 configs, 1 legal, 1 rejected" in captured.out
    assert "rejected: 1 x registers: ~296 per thread" in captured.out
