"""Every way the CLI used to show a traceback, hang or exit with the wrong status (issue 13): each
case is a real `python -m tiledsl.cli` process that must exit 2 with a one-line (or one-screen
SpecError) message naming what was wrong, with no traceback, and huge inputs must be refused fast."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tiledsl
from tiledsl.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
FA2 = str(SPECS / "fa2_d64.tile")
SPACE = str(SPECS / "fa2_space_d64.tile")
HOPPER = str(SPECS / "hopper_d128_causal.tile")
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
KERNEL = "attention {name} {{\n    head_dim = 64\n    schedule {{\n        tile q = 64, kv = {kv}\n    }}\n}}\n"


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tiledsl.cli", *map(str, args)], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def refused(*args: str, expect: str, **kw) -> subprocess.CompletedProcess:
    """The command exits 2 and its stderr holds `expect`."""
    done = cli(*args, **kw)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert expect in done.stderr, done.stderr
    return done


# ---- 1. spec paths ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["check"], ["explain"], ["compile"], ["tune", "--seqlen", "1024", "--dry-run"]])
def test_a_directory_as_the_spec(command, tmp_path):
    done = refused(*command, tmp_path, expect=f"error: {tmp_path}: is a directory")
    assert len(done.stderr.splitlines()) == 1


def test_an_unreadable_spec(tmp_path, monkeypatch, capsys):
    path = tmp_path / "secret.tile"
    path.write_text(KERNEL.format(name="k", kv=64))
    if os.geteuid() != 0:   # root reads anything: there, fake the refusal
        path.chmod(0)
    else:
        def deny(p):
            raise PermissionError(13, "Permission denied", str(p))
        monkeypatch.setattr("tiledsl.cli.common.parse_file", deny)
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {path}: permission denied\n"


# ---- 2. output paths ----------------------------------------------------------------------------

def test_compile_output_that_is_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    refused("compile", FA2, "-o", target, expect=f"error: -o {target}: exists and is not a folder")
    refused("compile", FA2, "-o", target / "sub", expect=f"error: -o {target / 'sub'}: a parent of this path is a file")


def test_compile_output_that_cannot_be_created():
    refused("compile", FA2, "-o", "/proc/tiledsl-out", expect="error: -o /proc/tiledsl-out: cannot create the folder")


def test_explain_dot_into_a_directory(tmp_path):
    refused("explain", FA2, "--dot", tmp_path, expect=f"error: --dot {tmp_path}: is a folder")


# ---- 3. run / bench without their dependencies --------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
@pytest.mark.parametrize("command", ["run", "bench"])
def test_run_and_bench_without_cupy(command):
    done = refused(command, FA2, expect="needs CuPy, which is not installed: pip install 'tiledsl[gpu]'")
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("command", ["run", "bench"])
def test_run_and_bench_of_a_family_without_template(command, monkeypatch, capsys):
    monkeypatch.setattr("tiledsl.families.FAMILIES", ())   # no family built: the check comes before any GPU work
    monkeypatch.setattr("tiledsl.families.WITH_TEMPLATE", ())
    assert main([command, FA2]) == 2
    assert "family has no CUDA template yet" in capsys.readouterr().err


def test_bench_against_sdpa_without_torch_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else (object() if name == "cupy" else real(name, *a)))
    assert main(["bench", FA2, "--against", "sdpa"]) == 2
    assert capsys.readouterr().err == ("error: bench --against sdpa needs PyTorch, which is not installed: "
                                       "pip install 'tiledsl[bench]'\n")
    assert 'bench = ["torch' in (ROOT / "pyproject.toml").read_text()


# ---- 4. shape options ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, expect", [
    (["tune", SPACE, "--seqlen", "0", "--dry-run"], "argument --seqlen: expected an integer in 1..262,144, got 0"),
    (["tune", SPACE, "--seqlen", "1024", "--budget", "-3", "--dry-run"], "argument --budget: expected an integer in 1.."),
    (["explain", FA2, "--seqlen", "1000000000000"], "argument --seqlen: expected an integer in 1..262,144"),
    (["explain", FA2, "--seqlen", "0"], "argument --seqlen: expected an integer in 1..262,144, got 0"),
    (["explain", FA2, "--seqlen", "-5"], "got -5"),
    (["explain", FA2, "--batch", "0"], "argument --batch: expected an integer in 1.."),
    (["explain", FA2, "--heads", "0"], "argument --heads: expected an integer in 1.."),
    (["explain", FA2, "--kv-heads", "3"], "error: --kv-heads 3 must divide --heads 16"),
    (["run", FA2, "--kv-heads", "3"], "error: --kv-heads 3 must divide --heads 8"),
])
def test_shape_options_out_of_range(args, expect):
    start = time.monotonic()
    done = refused(*args, expect=expect)
    assert len(done.stderr.splitlines()) == 1 and time.monotonic() - start < 10


# ---- 5. huge inputs: refused fast, with bounded output --------------------------------------------

def test_a_space_of_a_million_configs(write_spec):
    options = lambda n: ", ".join(str(16 * (i + 1)) for i in range(n))  # noqa: E731
    path = write_spec("attention big {\n    head_dim = 64\n    schedule {\n"
                      f"        tile q in {{{options(64)}}}, kv in {{{options(64)}}}\n"
                      "        pipeline in {1, 2, 3, 4} stages\n        warps in {1, 2, 4, 8, 16} along q\n"
                      "        mma in {mma.sync, wgmma}\n        split kv in {1, 2, 4, 8, 16, 32, 64, 128}\n"
                      "    }\n}\n", "big.tile")
    start = time.monotonic()
    done = refused("check", path, expect="the space 'big' has 1,310,720 configs")
    assert time.monotonic() - start < 5 and len(done.stdout) + len(done.stderr) < 2000


def test_a_file_of_too_many_blocks(tmp_path):
    path = tmp_path / "many.tile"
    path.write_text("".join(KERNEL.format(name=f"k{i}", kv=64) for i in range(101)))
    start = time.monotonic()
    refused("check", path, expect=f"{path}:601:1: error: more than 100 attention blocks")
    assert time.monotonic() - start < 5
    # blocks count however they are written: several closed on one line, a comment naming none
    one_line = "# attention attention\n" + " ".join(f"attention k{i} {{\n    head_dim = 64\n}}" for i in range(101))
    path.write_text(one_line + "\n")
    refused("check", path, expect=f"{path}:202:3: error: more than 100 attention blocks")


def test_configs_count_across_a_file(tmp_path):
    space = "attention {name} {{\n    head_dim = 64\n    schedule {{\n        tile q in {{{q}}}, kv in {{{kv}}}\n" \
            "        pipeline in {{1, 2, 3, 4}} stages\n    }}\n}}\n"
    tiles = ", ".join(str(16 * (i + 1)) for i in range(40))
    path = tmp_path / "spaces.tile"
    path.write_text(space.format(name="a", q=tiles, kv=tiles) + space.format(name="b", q=tiles, kv=tiles))
    start = time.monotonic()
    refused("check", path, expect=f"{path}:8:11: error: the space 'b' has 6,400 configs (40 tile_q x 40 tile_kv x 4 "
            "stages) after the file's 6,400 before it; at most 10,000 are accepted in a file")
    assert time.monotonic() - start < 10


def test_a_ten_megabyte_file(tmp_path):
    path = tmp_path / "huge.tile"
    path.write_text(KERNEL.format(name="k", kv=64) * 50_000)
    start = time.monotonic()
    done = refused("check", path, expect="error: the file is over")
    assert time.monotonic() - start < 5 and len(done.stderr) < 1000


def test_a_huge_token_gives_a_short_message(tmp_path):
    path = tmp_path / "token.tile"
    path.write_text("attention k {\n    head_dim = " + "9" * 900_000 + "\n}\n")
    start = time.monotonic()
    done = refused("check", path, expect="error: a token of 900,000 characters; at most 128 are accepted")
    assert time.monotonic() - start < 5 and len(done.stderr) < 1000


def test_long_lines_are_clipped_around_the_caret(write_spec, capsys):
    path = write_spec("attention k {\n    head_dim = 64 " + "x " * 5000 + "\n}\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000 and "..." in err and "^" in err


# ---- 6. compile of spaces, --name, duplicates, empty files ------------------------------------------

def test_compile_of_a_space_compiles_its_legal_configs(tmp_path):
    done = cli("compile", SPACE, "-o", tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"space 'fa2_space_d64': 72 configs, 45 legal, 27 rejected (`tiledsl check {SPACE}` says why)" in done.stdout
    assert f"45 CUDA files in {tmp_path}: 45 updated, 0 unchanged" in done.stdout and len(done.stdout.splitlines()) == 2
    assert len(list(tmp_path.glob("*.cu"))) == 45
    verbose = cli("compile", SPACE, "-o", tmp_path, "--verbose")
    assert verbose.stdout.count("    rejected  ") == 27   # each refused config with its reason, as check lists them
    assert verbose.stdout.count(f"{tmp_path}/fa2_d64_fp16_") == 45 and "(updated)" not in verbose.stdout


def test_name_that_matches_nothing(tmp_path):
    refused("compile", FA2, "--name", "nope", "-o", tmp_path,
            expect=f"error: --name nope: no attention block of that name in {FA2}; there are: fa2_d64")


@pytest.mark.parametrize("command", ["check", "compile"])
def test_two_blocks_defining_the_same_kernel(command, tmp_path):
    path = tmp_path / "dup.tile"
    path.write_text(KERNEL.format(name="a", kv=64) + KERNEL.format(name="b", kv=128) + KERNEL.format(name="c", kv=64))
    out = tmp_path / "out"
    refused(command, path, *(["-o", out] if command == "compile" else []),
            expect=f"{path}:13:1: error: 'c' defines the same kernel as 'a' (line 1)")
    assert not out.exists()


@pytest.mark.parametrize("command", [["check"], ["explain"], ["compile"], ["tune", "--seqlen", "1024", "--dry-run"]])
@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_an_empty_file(command, text, tmp_path):
    path = tmp_path / "empty.tile"
    path.write_text(text)
    expect = "holds no search space" if command[0] == "tune" else f"error: no attention blocks in {path}"
    refused(*command, path, expect=expect)


# ---- 7. --emit ---------------------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@needs_nvcc
def test_emit_sass_without_cuobjdump_writes_the_rest(tmp_path, monkeypatch, capsys):
    def absent(cubin):
        raise FileNotFoundError("cuobjdump")
    monkeypatch.setattr("tiledsl.codegen.nvcc.sass", absent)
    assert main(["compile", FA2, "-o", str(tmp_path), "--emit", "cuda,cubin,sass"]) == 0
    out, err = capsys.readouterr()
    assert "cuobjdump is not on PATH; no SASS written" in err
    assert list(tmp_path.glob("*.cubin")) and list(tmp_path.glob("*.cu")) and not list(tmp_path.glob("*.sass"))


@needs_nvcc
def test_emit_ptx_names_only_what_it_wrote(tmp_path):
    done = cli("compile", FA2, "-o", tmp_path, "--emit", "ptx")
    assert done.returncode == 0, done.stderr
    assert ".ptx" in done.stdout and ".cu" not in done.stdout.replace(".cubin", "")
    assert [p.suffix for p in tmp_path.iterdir()] == [".ptx"]


# ---- 8. what check and tune print ----------------------------------------------------------------

def test_check_prints_dsl_values_not_python_reprs(capsys):
    assert main(["check", "--verbose", HOPPER, FA2]) == 0
    out = capsys.readouterr().out
    hopper = out.split(FA2)[0]
    assert "mma=wgmma" in hopper and "mma.sync" not in hopper and "pingpong=on" in hopper
    assert "softmax_scale=1/sqrt(64)" in out
    for python in ("None", "False", "True"):
        assert python not in out


def test_order_choices_print_as_pairs(write_spec, capsys):
    path = write_spec("attention s {\n    head_dim = 64\n    schedule {\n        order in {(q, kv), (kv, q)}\n"
                      "        tile q = 64, kv in {64, 128}\n    }\n}\n")
    assert main(["check", str(path)]) == 0
    assert "order in {(q, kv), (kv, q)}" in capsys.readouterr().out
    env = {**ENV, "PATH": "/nonexistent"}   # no nvcc: the model's register estimates, no ptxas
    done = cli("tune", path, "--seqlen", "1024", "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    configs = [re.search(r"(fa\d q64 kv\d+ w4 s2)", line).group(1) for line in done.stdout.splitlines() if " q64 kv" in line]
    assert sorted(configs) == ["fa1 q64 kv128 w4 s2", "fa1 q64 kv64 w4 s2", "fa2 q64 kv128 w4 s2", "fa2 q64 kv64 w4 s2"]


# ---- 9. the front end ----------------------------------------------------------------------------

def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.tile"
    path.write_bytes(b"\xef\xbb\xbf" + KERNEL.format(name="k", kv=64).encode())
    (spec,) = tiledsl.load_specs(path)
    assert spec.name == "k" and spec.span.column == 1


def test_non_utf8_points_at_the_byte(tmp_path):
    path = tmp_path / "latin1.tile"
    path.write_bytes(b"attention k {\n    head_dim = 64\n    # caf\xe9\n}\n")
    done = refused("check", path, expect=f"{path}:3:10: error: the file is not UTF-8 text: byte 0xe9 at offset 41")
    assert "    # caf" in done.stderr and "^" in done.stderr


def test_full_width_digits_are_refused_at_the_token(write_spec):
    path = write_spec("attention k {\n    head_dim = \uff16\uff14\n}\n")
    with pytest.raises(tiledsl.SpecError) as err:
        tiledsl.load_specs(path)
    assert (err.value.span.line, err.value.span.column) == (2, 16)
    assert "U+FF16 FULLWIDTH DIGIT SIX" in err.value.hint


def test_library_edges():
    with pytest.raises(tiledsl.SpecError, match="empty string"):
        tiledsl.load_specs("")
    (space,) = tiledsl.parse_file(SPACE)
    assert isinstance(space, tiledsl.SpecSpace)
    (spec,) = tiledsl.load_specs(FA2)
    assert spec.span_of("tile").line > spec.span.line
    with pytest.raises(KeyError, match="not a spec setting"):
        spec.span_of("nonsense")


# ---- 10. --version, progress, import time --------------------------------------------------------

def test_version():
    done = cli("--version")
    assert (done.returncode, done.stdout) == (0, f"tiledsl {tiledsl.__version__}\n")


def test_tune_dry_run_shows_ptxas_progress(capsys, monkeypatch):
    import tiledsl.tune.search as tune
    monkeypatch.setattr(tune, "nvcc_available", lambda: "nvcc")
    monkeypatch.setattr(tune, "ptxas_report", lambda spec, arch: (128, 0, 0))
    assert main(["tune", SPACE, "--seqlen", "1024", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "ptxas fa2_d64_fp16_" in err and err.count("\n") >= 2   # one line per config off a terminal


def test_import_loads_no_heavy_module():
    code = ("import sys, tiledsl; heavy = [m for m in ('networkx', 'jinja2', 'lark', 'cupy', 'numpy') "
            "if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr
