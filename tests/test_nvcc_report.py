"""tiledsl/codegen/nvcc.py without nvcc: the one ptxas-report parser (on a captured report and a synthetic
one with spills), the one arch flag set, and the CLI and the tuner reading reports through it."""
from __future__ import annotations

from pathlib import Path

from tiledsl.codegen import nvcc
from tiledsl.tune import search as tune
from tiledsl.cli.main import main
from tiledsl.codegen.nvcc import arch_flags, parse_ptxas
from tiledsl.schedule.cost import Resources
from tiledsl.frontend.parse import parse_file

ROOT = Path(__file__).resolve().parent.parent
CAPTURED = (ROOT / "tests" / "data" / "ptxas_bundled_sm90a.txt").read_text()
DECODE, FA2 = "decode_d128_bf16_nq1_q16_kv128_w4kv_s1_splitauto", "fa2_d64_bf16_q128_kv128_w4q_s2"

SPILLING = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
ptxas info    : Function properties for kern_a
    272 bytes stack frame, 272 bytes spill stores, 256 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_captured_report_gives_each_kernel_its_own_lines():
    found = parse_ptxas(CAPTURED)
    assert set(found) == {DECODE, FA2}
    assert (found[DECODE].registers, found[DECODE].static_shared_bytes, found[DECODE].stack_bytes) == (210, 128, 0)
    assert (found[FA2].registers, found[FA2].static_shared_bytes) == (255, 0)
    assert found[FA2].source == "ptxas" and found[FA2].report == CAPTURED


def test_spills_and_stack_frame_are_read():
    kern = parse_ptxas(SPILLING)["kern_a"]
    assert (kern.registers, kern.spill_stores, kern.spill_loads, kern.stack_bytes) == (255, 272, 256, 272)


def test_functions_without_a_register_line_are_left_out():
    assert parse_ptxas("ptxas info    : Compiling entry function 'x' for 'sm_90a'\n") == {}
    assert parse_ptxas("nvcc fatal : something\n") == {}


def test_one_arch_flag_set():
    assert arch_flags() == ("-gencode=arch=compute_90a,code=sm_90a",)
    assert arch_flags("sm_100a") == ("-gencode=arch=compute_100a,code=sm_100a",)


def test_cli_resources_line_reads_the_report_through_nvcc(tmp_path, monkeypatch, capsys):
    def fake_compile_to(source, name, kind, out_dir, arch=nvcc.DEFAULT_ARCH):
        target = Path(out_dir) / f"{name}.{kind}"
        target.write_bytes(b"")
        return target, CAPTURED
    monkeypatch.setattr(nvcc, "compile_to", fake_compile_to)
    assert main(["compile", str(ROOT / "specs" / "decode_d128.tile"), "-o", str(tmp_path), "--emit", "resources"]) == 0
    assert "registers 210, spills 0 B, stack 0 B" in capsys.readouterr().out
    assert (tmp_path / f"{DECODE}.resources.txt").read_text() == CAPTURED


def test_tuner_gets_ptxas_numbers_from_nvcc_resources(tmp_path, monkeypatch):
    spec = parse_file(ROOT / "specs" / "fa2_d64.tile")[0]
    calls = []

    def fake_resources(source, name, arch=nvcc.DEFAULT_ARCH):
        calls.append((name, arch))
        return Resources(200, 8, 4, source="ptxas")
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvcc, "resources", fake_resources)
    assert tune.ptxas_report(spec, "sm_90a") == (200, 8, 4)
    assert tune.ptxas_report(spec, "sm_90a") == (200, 8, 4)   # the second answer comes from the cache
    assert calls == [(spec.kernel_name, "sm_90a")]


ADVISED = """ptxas info    : (C7517) warpgroup.wait is injected in around line 3966 by compiler to allow use of registers \
defined by GMMA in function 'kern_b'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_b' for 'sm_90a'
ptxas info    : Function properties for kern_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compiling entry function 'kern_c' for 'sm_90a'
ptxas info    : Function properties for kern_c
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_advisories_are_read_for_the_function_they_name():
    found = parse_ptxas(ADVISED)
    (advisory,) = found["kern_b"].advisories
    assert advisory.startswith("C7517 warpgroup.wait is injected in around line 3966")
    assert found["kern_c"].advisories == () and found["kern_b"].registers == 168


def test_resources_line_shows_ptxas_advisories(tmp_path, monkeypatch, capsys):
    spec_name = "hopper_d128_bf16_q128_kv128_p1r24_c2r240_intra_s2tma"

    def fake_compile_to(source, name, kind, out_dir, arch=nvcc.DEFAULT_ARCH):
        target = Path(out_dir) / f"{name}.{kind}"
        target.write_bytes(b"")
        return target, ADVISED.replace("kern_b", name)
    monkeypatch.setattr(nvcc, "compile_to", fake_compile_to)
    assert main(["compile", str(ROOT / "specs" / "hopper_d128.tile"), "-o", str(tmp_path), "--emit", "resources"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{spec_name}: registers 168, spills 0 B")
    assert out[1] == ("    ptxas C7517 warpgroup.wait is injected in around line 3966 by compiler to allow use of "
                      "registers defined by GMMA")


def test_emit_may_be_repeated_and_keeps_every_kind(tmp_path, monkeypatch, capsys):
    kinds = []

    def fake_compile_to(source, name, kind, out_dir, arch=nvcc.DEFAULT_ARCH):
        kinds.append(kind)
        target = Path(out_dir) / f"{name}.{kind}"
        target.write_bytes(b"")
        return target, CAPTURED
    monkeypatch.setattr(nvcc, "compile_to", fake_compile_to)
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: "nvcc")
    assert main(["compile", str(ROOT / "specs" / "fa2_d64.tile"), "-o", str(tmp_path), "--emit", "ptx",
                 "--emit", "cubin"]) == 0
    out = capsys.readouterr().out
    assert kinds == ["ptx", "cubin"] and "ptx: " in out and "cubin: " in out
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".ptx"]
