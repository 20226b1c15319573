"""The CLI and Python API at their edges: each case a user met (several files where one is bad, repeated
or contradictory options, empty or unwritable outputs, wrong argument types, hints that led to the next
error) answered in one clear message, and what the commands print readable by default."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiledsl
from tiledsl.cli.main import main
from tiledsl.errors import RuntimeInputError, SpecError

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
FA2, FA1 = str(SPECS / "fa2_d64.tile"), str(SPECS / "fa1_d64.tile")
SPACE, HOPPER_SPACE = str(SPECS / "fa2_space_d64.tile"), str(SPECS / "hopper_space_d128.tile")
BACKWARD = str(SPECS / "backward_d64.tile")
BAD = "attention bad {\n    head_dim = 64\n    mask = window(left = 4294967296)\n}\n"


def _lines(text: str) -> list[str]:
    return text.strip().splitlines()


# ---- check -------------------------------------------------------------------------------------------------

def test_check_of_several_files_reports_every_file(write_spec, capsys):
    bad = write_spec(BAD, "bad.tile")
    assert main(["check", FA2, str(bad), FA1]) == 2
    out, err = capsys.readouterr()
    assert f"{FA2}: fa2_d64_bf16_q128_kv128_w4q_s2 (fa2)" in out and f"{FA1}: fa1_d64_bf16" in out
    assert err.startswith(f"{bad}:3:26: error: window left must be") and err.count("error:") == 1
    assert _lines(out)[-1].startswith("2 of 3 files check: 3 kernels, 0 spaces")


def test_check_json_holds_every_file_and_the_errors(write_spec, capsys):
    bad = write_spec(BAD, "bad.tile")
    assert main(["check", "--json", str(bad), FA2]) == 2
    out, err = capsys.readouterr()
    items = json.loads(out)
    assert [item["type"] for item in items] == ["error", "kernel"]
    assert items[0]["file"] == str(bad) and "window left must be" in items[0]["error"]
    assert items[1]["kernel"] == "fa2_d64_bf16_q128_kv128_w4q_s2" and "window left" in err


def test_check_of_a_space_is_a_summary_and_verbose_lists_it(capsys):
    assert main(["check", SPACE]) == 0
    out = capsys.readouterr().out
    assert "space 'fa2_space_d64': 72 configs, 45 legal, 27 rejected" in out and "and 42 more" in out
    assert "rejected: 9 x 8 warps along q give each warp 8 of tile q = 64's rows" in out
    assert len(_lines(out)) < 15 and "--verbose" in out
    assert main(["check", "--verbose", SPACE]) == 0
    verbose = capsys.readouterr().out
    assert verbose.count("    legal     ") == 45 and verbose.count("    rejected  ") == 27


def test_check_prints_the_backward_the_fp8_cache_and_dequant(write_spec, capsys):
    fp8 = write_spec("attention d {\n    head_dim = 128\n    queries = 1\n    kv_dtype = e4m3\n    kv_scale = "
                     "per_tensor\n    schedule {\n        dequant fragments\n    }\n}\n", "fp8.tile")
    for path, expect in ((BACKWARD, "    backward: order=kv, q tile_q=64 tile_kv=128 warps=8 stages=2 mma=mma.sync "
                          "dq=atomic"), (str(fp8), "kv_dtype=e4m3 kv_scale=per_tensor")):
        assert main(["check", path]) == 0
        assert expect in capsys.readouterr().out
    assert main(["check", str(fp8)]) == 0
    assert "dequant=fragments" in capsys.readouterr().out


def test_an_unknown_option_names_the_subcommand(capsys):
    for command in ("check", "explain", "compile", "tune"):
        with pytest.raises(SystemExit) as done:
            main([command, FA2, "--bogus"] + (["--seqlen", "1024"] if command == "tune" else []))
        assert done.value.code == 2
        assert capsys.readouterr().err == (f"tiledsl {command}: error: unrecognized arguments: --bogus "
                                           f"(see tiledsl {command} --help)\n")


def test_python_dash_m_tiledsl_is_the_command():
    done = subprocess.run([sys.executable, "-m", "tiledsl", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("tiledsl ")
    done = subprocess.run([sys.executable, "-m", "tiledsl", "check", FA2], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "fa2_d64_bf16_q128_kv128_w4q_s2" in done.stdout


# ---- relative spec paths -----------------------------------------------------------------------------------

MODS_SPEC = "specs/mods/decode_expressions_d128.tile"


@pytest.mark.parametrize("command", ["check", "explain"])
def test_relative_spec_paths_are_read_from_the_current_folder(command, tmp_path):
    """`python -m tiledsl check / explain` read a relative spec path from the folder they run in (the repository
    root, or specs/ with mods/...), and from elsewhere say the path is not there and where they looked."""
    run = lambda path, cwd: subprocess.run([sys.executable, "-m", "tiledsl", command, path], cwd=cwd,  # noqa: E731
                                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                                           text=True, timeout=120)
    for path, cwd in ((MODS_SPEC, ROOT), (MODS_SPEC[len("specs/"):], SPECS)):
        done = run(path, cwd)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert "decode_d128_bf16_causal_smoddb4d1170_nq4" in done.stdout
    done = run(MODS_SPEC, tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"error: {MODS_SPEC}: no such file or directory (looked up from the current folder "
                           f"{tmp_path})\n")


def test_a_current_folder_deleted_and_made_again_is_named_as_the_reason(tmp_path):
    """A shell left in a folder that was deleted and made again (a checkout or worktree re-made under it) finds no
    relative path while every absolute one works: the error says so instead of only "no such file"."""
    folder = tmp_path / "checkout"
    script = ("import os, shutil, sys\n"
              "from tiledsl.cli.main import main\n"
              "folder, spec = sys.argv[1], sys.argv[2]\n"
              "os.makedirs(folder + '/specs/mods'); os.chdir(folder)\n"
              "shutil.rmtree(folder); os.makedirs(folder + '/specs/mods'); shutil.copy(spec, folder + '/specs/mods')\n"
              f"print('relative', main(['check', {MODS_SPEC!r}]))\n"
              f"print('absolute', main(['check', folder + '/' + {MODS_SPEC!r}]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(folder), str(ROOT / MODS_SPEC)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert "relative 2" in done.stdout and "absolute 0" in done.stdout, done.stdout + done.stderr
    assert done.stderr == (f"error: {MODS_SPEC}: no such file or directory (the current folder no longer exists: it "
                           "was deleted, or deleted and made again, after this shell entered it; cd into it again or "
                           "give an absolute path)\n")


# ---- compile -----------------------------------------------------------------------------------------------

def test_compile_of_a_file_named_twice_compiles_it_once(tmp_path, capsys):
    assert main(["compile", FA2, FA2, "-o", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.cu"))) == 1
    assert main(["check", FA2, FA2]) == 0


def test_compile_to_an_empty_folder_name_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compile", FA2, "-o", ""]) == 2
    assert capsys.readouterr().err == "error: -o '': give a folder name (e.g. -o out/generated)\n"
    assert not list(tmp_path.iterdir())


def test_compile_of_many_kernels_prints_a_count(tmp_path, capsys):
    assert main(["compile", FA2, FA1, SPACE, "-o", str(tmp_path)]) == 0
    out = _lines(capsys.readouterr().out)
    assert out[-1] == f"48 CUDA files in {tmp_path}: 48 updated, 0 unchanged (--verbose names each)"
    assert len(out) == 2   # and the space's counts
    assert main(["compile", FA2, FA1, SPACE, "-o", str(tmp_path)]) == 0
    assert "0 updated, 48 unchanged" in capsys.readouterr().out


# ---- explain -----------------------------------------------------------------------------------------------

def test_explain_dot_to_a_path_that_cannot_be_written_fails_first(tmp_path, capsys):
    assert main(["explain", FA2, "--dot", "/nonexistent/g.dot"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --dot /nonexistent/g.dot: the folder /nonexistent does not exist\n"


def test_explain_dot_writes_one_digraph_per_file_and_the_backward(tmp_path, capsys):
    dot = tmp_path / "graph.dot"
    assert main(["explain", BACKWARD, "--dot", str(dot), "--summary"]) == 0
    name = "fa2_d64_bf16_causal_q128_kv64_w4q_s2_bwd_kvq_q64_kv128_w8_s2_atomic"
    forward, backward = tmp_path / f"graph.{name}.dot", tmp_path / f"graph.{name}_backward.dot"
    for path in (forward, backward):
        text = path.read_text()
        assert text.count("digraph ") == 1 and text.count("{") == text.count("}")
    assert "dK" in backward.read_text() and "dK" not in forward.read_text()
    assert main(["explain", FA2, "--dot", str(dot)]) == 0   # one graph: the file itself
    assert dot.read_text().count("digraph ") == 1


def test_explain_name_picks_one_block(capsys):
    assert main(["explain", FA1, "--name", "fa1_d64_splitk", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "fa1_d64_splitk: fa1_d64_bf16_q64_kv128_w4kv_s2" in out and "fa1_d64_bf16_q64_kv64" not in out
    assert main(["explain", FA1, "--name", "nope"]) == 2
    assert "--name nope: no attention block of that name" in capsys.readouterr().err


def test_explain_of_a_space_is_a_summary_with_the_best_explained(capsys):
    assert main(["explain", SPACE]) == 0
    out = capsys.readouterr().out
    assert "the model's best for batch 1, heads 16, seqlen 4096" in out and "--all explains all 45" in out
    assert out.count("loop nest:") == 1 and len(_lines(out)) < 200
    best = next(line.split(":")[0].split()[-1] for line in _lines(out) if line.strip().startswith("1. "))
    assert f"fa2_space_d64: {best}" in out


def test_explain_summary_is_a_few_lines(capsys):
    assert main(["explain", str(SPECS / "hopper_d128_causal.tile"), "--summary"]) == 0
    out = _lines(capsys.readouterr().out)
    assert len(out) <= 8 and out[2].startswith("on chip: 196688 B shared memory")


# ---- tune, bench, warmup options ---------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (["--causal", "--no-causal"], "--causal and --no-causal contradict each other"),
    (["--budget", "5", "--exhaustive"], "--budget 5 and --exhaustive contradict each other"),
    (["--dry-run", "--plot", "x.png"], "--dry-run times nothing and writes nothing: --plot would be ignored"),
    (["--dry-run", "-o", "w.tile"], "--dry-run times nothing and writes nothing: -o would be ignored"),
])
def test_tune_refuses_contradictory_options(options, message, capsys):
    assert main(["tune", SPACE, "--seqlen", "1024", *options]) == 2
    assert capsys.readouterr().err == f"error: {message}" + (
        "" if "ignored" in message else ": --exhaustive times every legal config" if "budget" in message else
        ": give one (or neither: the space's mask)") + "\n"


def test_bench_seqlen_stops_at_the_spec():
    from tiledsl.cli.bench import split_seqlens
    from tiledsl.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--seqlen", "1024", "2048", FA2])
    split_seqlens(args)
    assert (args.specs, args.seqlen) == ([FA2], [1024, 2048])
    args = build_parser().parse_args(["bench", FA2])
    split_seqlens(args)
    assert args.seqlen == [1024, 4096, 8192, 16384]


def test_bench_without_a_spec_or_with_a_bad_length(capsys):
    assert main(["bench", "--seqlen", "1024"]) == 2
    assert "the following arguments are required: SPEC" in capsys.readouterr().err
    assert main(["bench", "--seqlen", "0", FA2]) == 2
    assert "argument --seqlen: expected an integer in 1..16,777,216, got 0" in capsys.readouterr().err


def test_warmup_head_dims_are_checked_before_the_gpu(capsys):
    assert main(["warmup", "--head-dim", "100"]) == 2
    assert capsys.readouterr().err.startswith("error: --head-dim 100: not in the tuned table (it has 64, 128, 256)")
    with pytest.raises(SystemExit):
        main(["warmup", "--head-dim", "1000"])
    assert "expected an integer in 8..256" in capsys.readouterr().err


def test_tune_dry_run_counts_a_window_s_pairs_and_models_splits(write_spec, capsys, monkeypatch):
    from tiledsl.schedule.cost import Shape, shape_flops
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")
    window = write_spec("attention w {\n    head_dim = 128\n    mask = window(left = 256, right = 0)\n    schedule {\n"
                        "        tile q in {64, 128}, kv = 64\n        warps 4\n    }\n}\n", "w.tile")
    (spec,) = tiledsl.load_specs(window)[:1]
    shape = Shape(2, 16, 8192, 8192)
    assert shape_flops(spec, shape) == 2 * 2 * 16 * (257 * 8192 - 256 * 257 // 2) * 256   # rows see up to 257 keys
    assert main(["tune", str(window), "--seqlen", "8192", "--dry-run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(r["predicted_tflops"] < 1000 for r in rows)   # the H200's dense peak is ~990
    decode = write_spec("attention d {\n    head_dim = 128\n    queries = 1\n    schedule {\n        tile kv = 128\n"
                        "        warps 4 along kv\n        pipeline 1 stage\n        split kv in {1, 4, auto}\n"
                        "    }\n}\n", "d.tile")
    assert main(["tune", str(decode), "--seqlen", "8192", "--dry-run", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shape"] == {"batch": 2, "heads": 16, "seqlen_q": 1, "seqlen_kv": 8192}
    labels = [r["config"] for r in result["rows"]]
    assert sorted(labels) == ["decode q16 kv128 w4 s1", "decode q16 kv128 w4 s1 split4", "decode q16 kv128 w4 s1 splitauto"]
    assert len({r["predicted_ms"] for r in result["rows"]}) == 3


def test_tune_table_lines_up_and_labels_estimates(capsys, monkeypatch):
    monkeypatch.setenv("TILEDSL_NO_NVCC", "1")
    assert main(["tune", HOPPER_SPACE, "--seqlen", "4096", "--dry-run"]) == 0
    lines = _lines(capsys.readouterr().out)
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# config"))
    bars = [line.index("|") for line in lines[header:] if "|" in line]
    (space,) = tiledsl.parse_file(HOPPER_SPACE)
    assert len(set(bars)) == 1 and len(bars) == len(space.expand()[0]) + 1   # the header and a row per legal config
    assert "~" in lines[header + 2] and lines[-1].startswith("~ registers: the plan's estimate")


# ---- the Python API ------------------------------------------------------------------------------------------

def test_parse_text_takes_bytes_and_refuses_other_types():
    text = "attention k {\n    head_dim = 64\n}\n"
    assert tiledsl.parse_text(text.encode()) == tiledsl.parse_text(text)
    with pytest.raises(SpecError, match="not UTF-8 text: byte 0xff"):
        tiledsl.parse_text(b"attention k {\xff\n}\n")
    for wrong in (None, 42, ["attention"]):
        with pytest.raises(TypeError, match="parse_text takes the spec's text"):
            tiledsl.parse_text(wrong)


def test_compile_and_load_specs_refuse_what_they_cannot_take():
    with pytest.raises(TypeError, match="tiledsl.compile takes a KernelSpec, a .tile path or spec text, got int"):
        tiledsl.compile(42)
    with pytest.raises(TypeError, match="load_specs takes a .tile path or spec text"):
        tiledsl.load_specs(None)
    with pytest.raises(SpecError, match="1:12: error: expected '\\{' after 'k'"):
        tiledsl.load_specs("attention k")


def test_compile_of_a_space_or_an_unknown_name_says_what_to_do():
    with pytest.raises(RuntimeInputError) as err:
        tiledsl.compile(SPACE)
    message = str(err.value)
    assert message.count("'fa2_space_d64'") == 1 and "search space of 45 legal kernels" in message
    assert "name=" not in message
    with pytest.raises(RuntimeInputError, match="no attention block named 'zzz'; its blocks: fa2_d64"):
        tiledsl.compile(FA2, name="zzz")
    with pytest.raises(RuntimeInputError, match="2 attention blocks \\(fa1_d64, fa1_d64_splitk\\); pass name="):
        tiledsl.compile(FA1)
    assert tiledsl.compile(FA1, name="fa1_d64_splitk").name == "fa1_d64_bf16_q64_kv128_w4kv_s2"


def test_dir_lists_the_api_not_the_imports():
    names = set(dir(tiledsl))
    assert {"annotations", "importlib", "_LAZY"}.isdisjoint(names)
    assert {"attention", "compile", "load_specs", "SpecError", "__version__"} <= names


# ---- hints: each suggestion passes every check ---------------------------------------------------------------

def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as err:
        tiledsl.parse_text(text, "k.tile")
    return err.value


@pytest.mark.parametrize("text, hint", [
    ("attenton k {\n    head_dim = 64\n}\n", "a spec file holds blocks `attention NAME { ... }`"),
    ("attention k {\n    head_dim = 64\n}\n}\n", "this '}' closes no block: remove it"),
    ("attention " + "a" * 200 + " {\n    head_dim = 64\n}\n", "names and numbers are at most 128 characters"),
    ("attention k {\n    head_dim = 64\n    schedule {\n        schedule {\n        }\n    }\n}\n",
     "close the enclosing block with '}' first"),
])
def test_parse_errors_carry_a_hint(text, hint):
    err = _error(text)
    assert hint in err.hint, err.render()
    if text.startswith("attenton"):
        assert err.message.endswith("did you mean 'attention'?")
    if "schedule {\n        schedule" in text:
        assert err.message.startswith("`schedule {` is not a statement") and err.render().count("'") < 12


@pytest.mark.parametrize("text", [
    "attention k {\n    head_dim = 64\n    schedule {\n        tile q = 1008\n    }\n}\n",
    "attention k {\n    head_dim = 256\n}\n",
    "attention k {\n    head_dim = 96\n    schedule {\n        tile q = 128, kv = 128\n        pipeline 4 stages\n"
    "    }\n}\n",
])
def test_size_hints_suggest_only_edits_that_check(text):
    import re
    err = _error(text)
    edits = re.findall(r"`([^`]+)`", err.hint)
    assert edits, err.render()
    for edit in edits:
        key = edit.split()[0]
        lines = [line for line in text.splitlines() if not line.strip().startswith(key)]
        if "schedule {" not in text:
            lines[-1:-1] = ["    schedule {", "    }"]
        at = next(i for i, line in enumerate(lines) if line.strip() == "schedule {")
        lines.insert(at + 1, f"        {edit}")
        if key == "tile" and "tile q = " in text and "kv" not in edit:   # keep the kv tile that was written
            lines[at + 1] += "".join(f", kv = {m}" for m in re.findall(r"kv = (\d+)", text))
        (spec,) = tiledsl.parse_text("\n".join(lines) + "\n")   # the suggestion checks
        assert spec.kernel_name


# ---- make demo: a screen of summaries --------------------------------------------------------------------------

DEMO_MAX_LINES = 60


def make_demo(out: Path) -> subprocess.CompletedProcess:
    """`make demo` with this Python (its install step taken as done) and the CUDA written under `out`."""
    import shutil
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-s", "-o", ".setup-system", "demo", "SYSTEM_PYTHON=1", f"PYTHON={sys.executable}",
                           f"DEMO_OUT={out}", f"DEMO_HTML={out / 'demo.html'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_make_demo_fits_one_screen(tmp_path):
    done = make_demo(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = _lines(done.stdout + done.stderr)
    assert len(lines) < DEMO_MAX_LINES, "\n".join(lines)
    import re
    assert re.search(r"^(\d+) of \1 files check", done.stdout, re.M) and "CUDA files in" in done.stdout
    assert any(line.startswith("on chip: ") for line in lines)
    assert len(list(tmp_path.glob("*.cu"))) > 150


def test_explain_and_tune_refuse_a_tile_table_past_a_few_seconds(write_spec, capsys):
    tiny = write_spec("attention t {\n    head_dim = 64\n    mask = causal\n    schedule {\n        tile q = 16, kv = 16\n"
                      "        warps 1\n    }\n}\n", "tiny.tile")
    assert main(["explain", str(tiny), "--seqlen", "262144"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is 268,435,456 tile pairs; the traffic model walks at most 8,388,608" in err
    assert "sequences of about 46,340" in err
    space = write_spec("attention s {\n    head_dim = 64\n    schedule {\n        tile q in {16, 64}, kv = 16\n"
                       "        warps 1\n    }\n}\n", "s.tile")
    assert main(["tune", str(space), "--seqlen", "262144", "--dry-run"]) == 2
    assert "tile pairs" in capsys.readouterr().err
