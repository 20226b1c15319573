"""The checker: bundled specs, every class of error (message, file:line:col, caret), family
rules, and search-space expansion."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiledsl import load_specs, parse_file, parse_text
from tiledsl.frontend.space import SpecSpace
from tiledsl.errors import SpecError
from tiledsl.spec import Family, KernelSpec

# Not imported from conftest: tests/ may or may not be a package.
SPEC_FILES = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.tile"))

FAMILY_BY_FILE = {"fa1": Family.FA1, "fa2": Family.FA2, "hopper": Family.HOPPER, "decode": Family.DECODE,
                  "backward": Family.FA2}   # backward_*.tile: an fa2 forward with its backward (issue 14)


def block(settings: str = "", schedule: str | None = None, name: str = "k") -> str:
    """An attention block: line 1 `attention k {`, line 2 head_dim, then `settings` from line 3,
    then the schedule block (its statements start two lines after the last setting)."""
    lines = [f"attention {name} {{", "    head_dim = 64"] + [f"    {s}" for s in settings.splitlines()]
    if schedule is not None:
        lines += ["    schedule {"] + [f"        {s}" for s in schedule.splitlines()] + ["    }"]
    return "\n".join(lines + ["}"]) + "\n"


def check_error(text: str, error_parts, file: str = "bad.tile") -> dict:
    with pytest.raises(SpecError) as info:
        parse_text(text, file)
    assert info.value.span is not None and info.value.hint, "every spec error has a span and a hint"
    return error_parts(info.value.render())


# ---- bundled specs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_bundled_spec_checks(path):
    assert path.read_text().startswith("#"), "each spec file starts with a comment saying what it is"
    items = parse_file(path)
    assert items
    family = FAMILY_BY_FILE[path.name.split("_")[0]]
    for item in items:
        specs = item.expand()[0] if isinstance(item, SpecSpace) else [item]
        assert specs and all(spec.family is family for spec in specs)
        assert all(spec.source_file == str(path) and spec.span is not None for spec in specs)


def test_bundled_kernel_names_name_one_config_each():
    # A name may repeat across files (a space holds the fixed specs' configs) but only for one config.
    configs: dict[str, dict] = {}
    for path in SPEC_FILES:
        for spec in load_specs(path):
            config = {"problem": spec.config()["problem"], "schedule": spec.config()["schedule"]}
            assert configs.setdefault(spec.kernel_name, config) == config


def test_fa1_file_has_both_warp_splits():
    axes = {spec.schedule.warp_axis.value for spec in load_specs(Path(SPEC_FILES[0]).with_name("fa1_d64.tile"))}
    assert axes == {"q", "kv"}


def test_wgmma_specs_parse_and_name_the_instruction():
    from tiledsl.spec import Mma
    specs = [spec for path in SPEC_FILES if "wgmma" in path.name and not path.name.startswith("backward_") for spec in load_specs(path)]
    assert len(specs) == 4 and all(spec.schedule.mma is Mma.WGMMA and spec.kernel_name.endswith("_wgmma") for spec in specs)
    (plain,) = parse_text(block(schedule="tile q = 128\nwarps 8 along q\nmma mma.sync"))
    assert plain.schedule.mma is Mma.SYNC and not plain.kernel_name.endswith("wgmma")
    (space,) = parse_text(block(schedule="tile q = 128, kv = 64\nwarps 8 along q\nmma in {mma.sync, wgmma}"))
    assert {spec.schedule.mma for spec in space.expand()[0]} == {Mma.SYNC, Mma.WGMMA}


def test_default_spec_exists_and_is_hopper_causal():
    # The Makefile's DEFAULT_SPEC (make demo runs the hopper family); its schedule gets tuned, so only
    # what it computes is pinned.
    makefile = (SPEC_FILES[0].parent.parent / "Makefile").read_text()
    path = next(line.split("?=")[1].strip() for line in makefile.splitlines() if line.startswith("DEFAULT_SPEC"))
    (spec,) = load_specs(SPEC_FILES[0].parent.parent / path)
    assert (spec.family, spec.problem.head_dim_qk, spec.problem.mask.value) == (Family.HOPPER, 128, "causal")
    assert spec.kernel_name.startswith("hopper_d128_bf16_causal_q")


# ---- errors -------------------------------------------------------------------------------------------

ERRORS = [
    # (settings, schedule, line, message, underlined text)
    ("dtyp = bf16", None, 3, "unknown key 'dtyp'; did you mean 'dtype'?", "dtyp"),
    ("dtype = bf16\ndtype = fp16", None, 4, "duplicate key 'dtype' (first set on line 3)", "dtype"),
    ("order = 1", None, 3, "'order' is a schedule statement; put it inside `schedule { ... }`", "order"),
    ("dtype = bf61", None, 3, "unknown dtype 'bf61'; did you mean 'bf16'?", "bf61"),
    ("dtype = 16", None, 3, "dtype takes a name, got '16'", "16"),
    ("mask = causl", None, 3, "unknown mask 'causl'; did you mean 'causal'?", "causl"),
    ("mask = causal(left = 2)", None, 3, "mask 'causal' takes no arguments", "causal(left = 2)"),
    ("mask = window", None, 3, "a window mask needs its sizes", "window"),
    ("dtype = fp32", None, 3, "the fa2 template computes with fp16 or bf16 tensor cores, not fp32", "dtype = fp32"),
    ("mask = window(left = -1)", None, 3, "window left must be an integer in 0..1,073,741,824 (2^30), got -1", "-1"),
    ("mask = window(lft = 3)", None, 3, "unknown window size 'lft'; did you mean 'left'?", "lft"),
    ("mask = window(left = 1, left = 2)", None, 3, "window size 'left' given twice", "left"),
    ("scale = 0", None, 3, "scale must be a finite number > 0, got 0", "0"),
    ("scale = -0.5", None, 3, "scale must be a finite number > 0, got -0.5", "-0.5"),
    ("scale = 1e400", None, 3, "scale must be a finite number > 0, got 1e400", "1e400"),
    ("scale = big", None, 3, "scale takes a number, got 'big'", "big"),
    ("queries = 0", None, 3, "queries must be an integer in 1..16, got 0", "0"),
    ("queries = 17", None, 3, "queries must be an integer in 1..16, got 17", "17"),
    ("", "tiles q = 64", 4, "unknown key 'tiles'; did you mean 'tile'?", "tiles"),
    ("", "dtype = bf16", 4, "'dtype' is a problem setting; write it before `schedule {`", "dtype"),
    ("", "tile q = 64\ntile kv = 64", 5, "duplicate key 'tile' (first set on line 4)", "tile"),
    ("", "tile q = 100", 4, "tile q must be a positive multiple of 16 up to 1024, got 100", "100"),
    ("", "tile kv = 0", 4, "tile kv must be a positive multiple of 16 up to 1024, got 0", "0"),
    ("", "tile q = 64.0", 4, "tile q must be a positive multiple of 16 up to 1024, got 64.0", "64.0"),
    ("", "tile x = 64", 4, "unknown tile axis 'x'", "x"),
    ("", "pipeline 5 stages", 4, "pipeline stages must be an integer in 1..4, got 5", "5"),
    ("", "pipeline 0 stages", 4, "pipeline stages must be an integer in 1..4, got 0", "0"),
    ("", "pipeline 2 stages via cpasync", 4, "unknown copy 'cpasync'; did you mean 'cp.async'?", "cpasync"),
    ("", "warps 3", 4, "warps must be one of 1, 2, 4, 8, 16, got 3", "3"),
    ("", "warps 4 along x", 4, "unknown warp axis 'x'", "x"),
    ("", "order q, q", 4, "order must be `q, kv` (FA2) or `kv, q` (FA1), got `q, q`", "q, q"),
    ("", "tile q = 64\nwarps 8 along q", 5, "8 warps along q give each warp 8 of tile q = 64's rows", "warps 8 along q"),
    ("", "tile q = 32", 4, "4 warps (the default) along q give each warp 8 of tile q = 32's rows", "tile q = 32"),
    ("", "order kv, q\ntile kv = 32\nwarps 4 along kv", 6, "4 warps along kv give each warp 8 of tile kv = 32's rows",
     "warps 4 along kv"),
    ("", "order q, kv\nwarps 4 along kv", 5,
     "q-outer (FA2) splits warps along q; warps along kv is FA1's split-K: write `order kv, q`", "warps 4 along kv"),
    ("", "split kv = 4", 4, "split kv = 4 is only for the decode family; this kernel is fa2", "split kv = 4"),
    ("", "order kv, q\nsplit kv = auto", 5, "split kv = auto is only for the decode family; this kernel is fa1", None),
    ("queries = 1", "split kv = 0", 5, "split kv must be an integer in 1..1024 or auto, got 0", "0"),
    ("queries = 1", "split q = 2", 5, "split-KV splits the kv axis, got 'q'", "q"),
    ("", "pipeline 2 stages via tma", 4, "TMA copies need the hopper family; fa2 copies with cp.async", None),
    ("", "order kv, q\npipeline 2 stages via tma", 5, "TMA copies need the hopper family; fa1 copies", None),
    ("queries = 1", "pipeline 2 stages via tma", 5, "TMA copies need the hopper family; decode copies", None),
    ("", "overlap intra", 4, "overlap needs warp specialization (the hopper family); fa2 has no warpgroups",
     "overlap intra"),
    ("", "overlap pingpong, pingpong", 4, "overlap 'pingpong' given twice", None),
    ("", "overlap pingpog", 4, "unknown overlap 'pingpog'; did you mean 'pingpong'?", "pingpog"),
    ("queries = 1", "warps 4 along q", 5, "the decode family splits warps along kv", "warps 4 along q"),
    ("queries = 1", "order kv, q", 5, "the decode family runs q outer; `order kv, q` is FA1", "order kv, q"),
    ("", "warpgroups producer 1, consumer 2\nwarps 8", 5, "the hopper family gets its warps from `warpgroups`", None),
    ("", "warpgroups producer 1, consumer 2\npipeline 2 stages via cp.async", 5,
     "the hopper family copies with TMA, not cp.async", None),
    ("", "warpgroups producer 2, consumer 2", 4, "producer warpgroups must be 1, got 2", "2"),
    ("", "warpgroups producer 1, consumer 4", 4, "consumer warpgroups must be 1, 2 or 3, got 4", "4"),
    ("", "warpgroups producer 1 regs 20, consumer 2", 4, "producer regs must be a multiple of 8 in 24..256", "20"),
    ("", "warpgroups producer 1, consumer 2 regs 100", 4, "consumer regs must be a multiple of 8 in 24..256", "100"),
    ("", "warpgroups producer 1, producer 1", 4, "warpgroup role 'producer' given twice", None),
    ("", "warpgroups producr 1", 4, "unknown warpgroup role 'producr'; did you mean 'producer'?", "producr"),
    ("", "warpgroups producer 1 regs 24, consumer 2 regs 256", 4,
     "setmaxnreg: 1 x 24 + 2 x 256 = 536 registers per thread of a warpgroup", None),
    # 512 x 128 registers fit an SM, but a block of three warpgroups launches with 3 x 168 (65536 / 384 threads)
    ("", "warpgroups producer 1 regs 32, consumer 2 regs 240", 4, "share only those: 3 x 168 = 504", None),
    ("", "warpgroups producer 1, consumer 3", 4,
     "tile q = 128 is not a multiple of 64 x 3 consumer warpgroups = 192", "warpgroups producer 1, consumer 3"),
    ("", "warpgroups producer 1, consumer 1\noverlap pingpong", 5,
     "pingpong alternates two consumer warpgroups; this kernel has 1", "overlap pingpong"),
    ("queries = 1", "warpgroups producer 1, consumer 2", 3, "queries (decode) and warpgroups (hopper) exclude", None),
    ("", "warpgroups consumer 2\norder kv, q", 5, "the hopper family runs q outer", None),
    ("", "mma wgmm", 4, "unknown mma instruction 'wgmm'; did you mean 'wgmma'?", "wgmm"),
    ("", "mma wgmma", 4, "wgmma runs whole warpgroups (4 warps), each owning 64 query rows: 4 warps and tile q = 128",
     "mma wgmma"),
    ("", "tile q = 128, kv = 128\nwarps 4 along q\nmma wgmma", 5, "wgmma runs whole warpgroups", "warps 4 along q"),
    ("", "tile q = 128, kv = 512\nwarps 8 along q\nmma wgmma", 4, "wgmma's n is at most 256: tile kv = 512", None),
    ("head_dim_v = 96", "tile q = 128\nwarps 8 along q\nmma wgmma", 3, "wgmma reads 64-column panels", None),
    ("", "order kv, q\nmma wgmma", 5, "`mma wgmma` is built for the fa2 and hopper families; this kernel is fa1", "mma wgmma"),
    ("queries = 1", "mma wgmma", 5, "`mma wgmma` is built for the fa2 and hopper families; this kernel is decode", "mma wgmma"),
    ("", "tile q in {64, 64}", 4, "'64' appears twice in this choice", None),
    ("", "tile q in {64, 100}", 4, "tile q must be a positive multiple of 16 up to 1024, got 100", "100"),
    ("", "tile q = 64\nwarps in {8, 16}", 3, "none of the 2 configs of space 'k' is legal", None),
    ("", "pipeline in {1, 2} stages via tma", 4,
     "TMA copies need the hopper family; fa2 copies with cp.async (in all 2 configs of space 'k')", None),
]


@pytest.mark.parametrize("settings, schedule, line, message, underlined", ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_error(settings, schedule, line, message, underlined, error_parts):
    text = block(settings, schedule)
    error = check_error(text, error_parts)
    assert message in error["message"]
    if "none of the" in message:     # a whole-space error points at the block
        line = 1
    assert (error["file"], error["line"]) == ("bad.tile", line)
    source_line = text.splitlines()[line - 1]
    if underlined is not None:
        assert error["underlined"] == underlined
        assert error["column"] == source_line.rindex(underlined) + 1 or source_line.count(underlined) > 1
    else:
        assert error["underlined"] and error["underlined"] in source_line


def test_head_dim_range(error_parts):
    for value in ("0", "100", "264", "-8", "64.5"):
        error = check_error(block().replace("head_dim = 64", f"head_dim = {value}"), error_parts)
        assert error["message"] == f"head_dim must be a multiple of 8 in 8..256, got {value}"
        assert (error["line"], error["underlined"]) == (2, value)
    error = check_error(block("head_dim_v = 12"), error_parts)
    assert error["message"].startswith("head_dim_v must be a multiple of 8")


def test_missing_head_dim(error_parts):
    error = check_error("attention k {\n    dtype = bf16\n}\n", error_parts)
    assert error["message"] == "kernel 'k' has no head_dim" and error["underlined"] == "k"
    assert "head_dim = 128" in error["hint"]


def test_duplicate_kernel_and_schedule_block(error_parts):
    error = check_error(block() + block(), error_parts)
    assert error["message"] == "duplicate kernel name 'k' (first defined on line 1)"
    assert (error["line"], error["underlined"]) == (4, "k")
    error = check_error("attention k {\n    head_dim = 64\n    schedule {\n    }\n    schedule {\n    }\n}\n",
                        error_parts)
    assert error["message"] == "duplicate key 'schedule' (first set on line 3)"
    assert (error["line"], error["underlined"]) == (5, "schedule")


def test_kernel_name_must_be_an_identifier(error_parts):
    error = check_error(block(name="fa2.d64"), error_parts)
    assert error["message"] == "kernel name 'fa2.d64' is not an identifier" and error["underlined"] == "fa2.d64"


def test_spec_errors_render_file_line_column_and_caret(write_spec):
    path = write_spec(block("dtype = bf61"), "typo.tile")
    with pytest.raises(SpecError) as info:
        parse_file(path)
    lines = info.value.render().splitlines()
    assert lines[0] == f"{path}:3:13: error: unknown dtype 'bf61'; did you mean 'bf16'?"
    assert lines[1] == "    3 |     dtype = bf61"
    assert lines[2] == "                    ^^^^"
    assert lines[3] == "  hint: dtype is one of: fp16, bf16, fp32, e4m3"


# ---- spaces -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, counts", [("fa2_space_d64.tile", (45, 27)), ("fa2_space_d128.tile", (42, 30))])
def test_bundled_space_expansion(name, counts):
    (space,) = parse_file(SPEC_FILES[0].with_name(name))
    assert isinstance(space, SpecSpace)
    assert space.size == 72 and [n for n, _ in space.choices] == ["tile_q", "tile_kv", "warps", "stages", "mma"]
    legal, rejected = space.expand()
    # d128: q128 kv128 on 4 warps keeps ~296 registers of accumulators a thread (layout/ refuses it)
    assert (len(legal), len(rejected)) == counts
    from tiledsl.spec import Mma
    assert sum(spec.schedule.mma is Mma.WGMMA for spec in legal) == 18   # q64 w4 and q128 w8, 3 kv tiles, 3 depths
    for config, reason in rejected:
        if "registers" in reason:       # d128 only: q128 kv128 on 4 warps
            assert (name, config["tile_q"], config["tile_kv"], config["warps"]) == ("fa2_space_d128.tile", 128, 128, 4)
        elif config["mma"] is Mma.SYNC:   # 8 warps on 64 rows
            assert config["tile_q"] == 64 and config["warps"] == 8 and "a warp needs a multiple of 16" in reason
        else:                           # warpgroups that do not own 64 rows each
            assert config["warps"] * 16 != config["tile_q"] and "whole warpgroups" in reason
    names = [spec.kernel_name for spec in legal]
    assert len(set(names)) == len(names) and all(spec.name == space.name for spec in legal)
    with pytest.raises(SpecError):
        space.spec(rejected[0][0])
    assert isinstance(space.spec(space.configs()[0]), KernelSpec)


@pytest.mark.parametrize("schedule, size, legal", [
    ("order in {(q, kv), (kv, q)}\nwarps 4 along in {q, kv}", 4, 3),   # FA2 with warps along kv is out
    ("tile q in {64, 128}, kv in {32, 64, 128}\nwarps in {4, 8} along q\npipeline in {1, 2, 3} stages", 36, 27),
    ("pipeline 2 stages via in {cp.async, tma}", 2, 1),
])
def test_space_counts(schedule, size, legal):
    (space,) = parse_text(block(schedule=schedule))
    assert (space.size, len(space.expand()[0]), len(space.expand()[1])) == (size, legal, size - legal)
    assert len({s.kernel_name for s in space.expand()[0]}) == legal


def test_decode_split_and_hopper_regs_spaces():
    (space,) = parse_text(block("queries = 1", "split kv in {1, 4, auto}\ntile kv = 128"))
    assert [s.schedule.split_kv for s in space.expand()[0]] == [1, 4, "auto"]
    (space,) = parse_text(block(schedule="warpgroups producer 1 regs in {24, 32}, consumer in {1, 2}"))
    legal, rejected = space.expand()
    # default consumer regs fit each count; tile q (default 128) is 64 rows per consumer only for 2
    assert space.size == 4 and [s.schedule.consumer_warpgroups for s in legal] == [2, 2]
    assert all("each of the 1 consumer warpgroups owns 64 query rows" in reason for _, reason in rejected)


def test_load_specs_takes_paths_and_text():
    path = SPEC_FILES[0].with_name("fa2_space_d64.tile")
    assert len(load_specs(path)) == len(load_specs(str(path))) == 45
    assert [s.name for s in load_specs(block())] == ["k"]
    with pytest.raises(FileNotFoundError):
        load_specs("specs/no_such_spec.tile")


def test_same_config_in_two_files_is_the_same_kernel():
    (a,), (b,) = parse_text(block(), "a.tile"), parse_text("# other\n" + block(), "b.tile")
    assert a == b and hash(a) == hash(b) and a.config_hash == b.config_hash
    assert a.span_of("head_dim").line + 1 == b.span_of("head_dim").line
