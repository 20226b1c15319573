"""The fuzzer: grammar-aware specs over every setting and schedule statement (backward blocks, paged and FP8
decode, varlen, search spaces, values at and past their bounds) and mutations of the bundled specs.

For every input: only SpecError escapes parse + check; every accepted config's kernel name is a C
identifier and it lowers and renders (check accepts exactly what compile builds), its backward too where
it has a template; check and explain of it finish within a few seconds. A seeded sample of accepted
configs of every family (backward kernels included) compiles with nvcc. Seeded and bounded for CI:
hypothesis runs derandomized, so a failure reproduces."""
from __future__ import annotations

import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings

from tiledsl.cli.report import explain
from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.errors import SpecError
from tiledsl.families import lower
from tiledsl.frontend.parse import parse_text
from tiledsl.frontend.space import SpecSpace
from tiledsl.layout.backward import backward_has_template
from tiledsl.lower.backward import lower_backward
from tiledsl.spec import MAX_SPLIT_KV, MAX_WINDOW, Family

from .test_spec_fuzz import mutated_spec

C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECONDS = 5.0            # check + explain of one input, whatever it holds (inside the documented limits)
CONFIGS_CHECKED = 6      # legal configs of a space lowered and explained per input
FUZZ = settings(max_examples=int(os.environ.get("TILEDSL_FUZZ_EXAMPLES", "150")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# ---- the generators: one attention block, statement by statement, from a seeded Random -------------------------
# `wild_spec` writes every setting and statement with values inside, at and past their bounds (most blocks are
# refused, somewhere); `tame_spec` writes configs of every family a template builds (most are accepted).

class Values(tuple):
    """Values a setting takes, then values at or past its bounds: `pick` takes one of the first mostly
    (so that many blocks are accepted and reach the lowering), one of the second sometimes."""

    def __new__(cls, usual, edges=()):
        return super().__new__(cls, (tuple(usual), tuple(edges)))


EDGE = 0.12   # the share of values drawn at or past a bound


def pick(rng: random.Random, values):
    if isinstance(values, Values):
        usual, edges = values
        return rng.choice(edges if edges and rng.random() < EDGE else usual)
    return rng.choice(values)


WILD_HEAD_DIMS = Values([64, 64, 128, 128, 256, 32, 96, 16, 192, 40], [8, 7, 12, 264, 1000, 0])
WILD_TILES = Values([16, 32, 48, 64, 64, 80, 96, 128, 128, 176, 192, 256], [1024, 1040, 0, 8])
WILD_SIZES = Values([0, 1, 64, 256, 4095], [MAX_WINDOW, MAX_WINDOW + 1, 2**31, 2**63])


def _slot(rng: random.Random, values) -> str:
    """One value, or sometimes a search space `in {a, b}` of two."""
    if rng.random() < 0.2:
        return "in {" + ", ".join(dict.fromkeys(str(pick(rng, values)) for _ in range(2))) + "}"
    return str(pick(rng, values))


def _dim(rng: random.Random, values) -> str:
    slot = _slot(rng, values)
    return slot if slot.startswith("in ") else f"= {slot}"


def wild_problem(rng: random.Random) -> list[str]:
    coin = lambda p=0.5: rng.random() < p  # noqa: E731
    one = lambda values: pick(rng, values)  # noqa: E731
    lines = [f"head_dim = {one(WILD_HEAD_DIMS)}"]
    if coin():
        lines.append(f"head_dim_v = {one(WILD_HEAD_DIMS)}")
    if coin():
        lines.append(f"dtype = {one(Values(['bf16', 'fp16', 'fp32'], ['e4m3', 'int8']))}")
    mask = one(["none", "causal", "window", "window", None])
    if mask == "window":
        sides = rng.sample(["left", "right"], rng.randint(1, 2))
        lines.append("mask = window(" + ", ".join(f"{side} = {one(WILD_SIZES)}" for side in sides) + ")")
    elif mask:
        lines.append(f"mask = {mask}")
    if coin(0.25):
        lines.append(f"scale = {one(Values(['0.125', '1', '2', '1e-30', '1e30'], ['1e-31', '0', '-1', '1e31']))}")
    if coin():
        lines.append(f"queries = {one(Values([1, 1, 4, 16, 8], [17, 0]))}")
    cache = one([None, None, "contiguous", "paged"])
    if cache == "paged":
        lines.append(f"kv_cache = paged(page = {one(Values([1, 16, 16, 64, 256], [3, 512]))})")
    elif cache:
        lines.append(f"kv_cache = {cache}")
    if coin(0.25):
        lines.append(f"layout = {one(['varlen', 'batched'])}")
    if coin(0.25):
        lines.append(f"kv_dtype = {one(['e4m3', 'bf16'])}")
        if coin():
            lines.append(f"kv_scale = {one(['per_head', 'per_tensor'])}")
    return lines


def wild_schedule(rng: random.Random, backward: bool = False) -> list[str]:
    coin = lambda p=0.5: rng.random() < p  # noqa: E731
    one = lambda values: pick(rng, values)  # noqa: E731
    lines = []
    if coin():
        lines.append("order " + one(["q, kv", "kv, q", "in {(q, kv), (kv, q)}"]))
    if coin():
        lines.append(f"tile q {_dim(rng, WILD_TILES)}, kv {_dim(rng, WILD_TILES)}")
    if coin():
        lines.append(f"warps {_slot(rng, Values([1, 2, 4, 8, 16], [3]))}"
                     + (f" along {one(['q', 'kv'])}" if not backward and coin() else ""))
    if coin():
        lines.append(f"pipeline {_slot(rng, Values([1, 2, 3, 4], [0, 5]))} stages"
                     + (f" via {one(['cp.async', 'tma'])}" if not backward and coin() else ""))
    if coin():
        lines.append(f"mma {_slot(rng, ['mma.sync', 'wgmma'])}")
    if backward:
        if coin():
            lines.append(f"dq accumulate {_slot(rng, ['atomic', 'separate', 'ordered'])}")
        return lines
    if coin(0.35):
        roles = ["producer 1" + (f" regs {one(Values([24, 32, 40], [20]))}" if coin() else "")]
        if coin():
            roles.append(f"consumer {_slot(rng, Values([1, 2, 3], [4]))}" + (f" regs {one(Values([160, 240, 256], [264]))}" if coin() else ""))
        lines.append("warpgroups " + ", ".join(roles))
    if coin(0.25):
        flags = rng.sample(["pingpong", "intra"], rng.randint(1, 2))
        lines.append("overlap " + ", ".join(f + (" in {on, off}" if coin() else "") for f in flags))
    if coin(0.25):
        lines.append(f"split kv {_dim(rng, Values([1, 4, 'auto', MAX_SPLIT_KV], [MAX_SPLIT_KV + 1, 0]))}")
    if coin(0.2):
        lines.append(f"dequant {_slot(rng, ['shared', 'fragments'])}")
    return lines


def _block(problem: list[str], schedule: list[str], backward: list[str] | None) -> str:
    body = [f"    {line}" for line in problem] + ["    schedule {"] + [f"        {line}" for line in schedule] + ["    }"]
    if backward is not None:
        body += ["    backward {"] + [f"        {line}" for line in backward] + ["    }"]
    return "attention fuzz {\n" + "\n".join(body) + "\n}\n"


def wild_spec(rng: random.Random) -> str:
    return _block(wild_problem(rng), wild_schedule(rng), wild_schedule(rng, True) if rng.random() < 0.25 else None)


# ---- what must hold of every input ---------------------------------------------------------------------------

def accepted_configs(text: str) -> list:
    """The concrete configs `text` defines (a few of each space); a SpecError must point into the text."""
    try:
        items = parse_text(text, "fuzz.tile")
    except SpecError as err:
        assert err.span is not None and err.render().startswith("fuzz.tile:"), err.render()
        return []
    specs = []
    for item in items:
        specs += item.expand()[0][:CONFIGS_CHECKED] if isinstance(item, SpecSpace) else [item]
    return specs


def holds(text: str) -> None:
    start = time.monotonic()
    for spec in accepted_configs(text):
        assert C_IDENTIFIER.fullmatch(spec.kernel_name), spec.kernel_name
        try:
            plan = lower(spec)   # check accepted it: compile must build it
        except SpecError as err:
            raise AssertionError(f"check accepts what compile refuses:\n{text}\n{err.render()}") from None
        assert C_IDENTIFIER.fullmatch(plan.kernel_name) and "__global__" in render(plan)
        if spec.backward is not None and not backward_has_template(spec):
            assert "__global__" in render(lower_backward(spec))
        explain(spec)
    assert time.monotonic() - start < SECONDS, f"check and explain took {time.monotonic() - start:.1f} s:\n{text}"


FUZZ_BLOCKS = int(os.environ.get("TILEDSL_FUZZ_BLOCKS", "300"))   # per generator; CI's bound
CHUNK = 50


@pytest.mark.parametrize("start", range(0, FUZZ_BLOCKS, CHUNK))
def test_generated_specs_check_exactly_what_compiles(start):
    for seed in range(start, start + CHUNK):
        holds(wild_spec(random.Random(seed)))


@pytest.mark.parametrize("start", range(0, FUZZ_BLOCKS, CHUNK))
def test_configs_of_every_family_check_exactly_what_compiles(start):
    for seed in range(start, start + CHUNK):
        holds(tame_spec(random.Random(10_000 + seed)))
        holds(mixed_spec(random.Random(20_000 + seed)))


@FUZZ
@given(mutated_spec())
def test_mutated_bundled_specs_check_exactly_what_compiles(text):
    holds(text)


def test_the_generators_reach_every_family_and_setting():
    """The fuzz is worth its time only where its blocks are accepted: both generators' blocks must reach
    every family and serving layout, the wild one every setting's refusal too."""
    seen, refused = set(), set()
    for seed in range(FUZZ_BLOCKS):
        for text in (wild_spec(random.Random(seed)), tame_spec(random.Random(10_000 + seed)),
                     mixed_spec(random.Random(20_000 + seed))):
            try:
                parse_text(text, "fuzz.tile")
            except SpecError as err:
                refused.add(err.span.line)
            for spec in accepted_configs(text):
                p = spec.problem
                seen.add(spec.family)
                seen.update(name for name, on in (("paged", p.kv_page_size is not None), ("fp8", p.kv_fp8),
                                                  ("varlen", p.seq_layout.value == "varlen"),
                                                  ("backward", spec.backward is not None)) if on)
    assert seen >= {Family.FA1, Family.FA2, Family.DECODE, Family.HOPPER, "paged", "fp8", "varlen", "backward"}, seen
    assert len(refused) > 8   # refusals at many lines: settings, statements, the backward block


def tame_spec(rng: random.Random) -> str:
    """A config of a family a template builds: its statements with values the family takes."""
    return _block(*tame_parts(rng))


def mixed_spec(rng: random.Random) -> str:
    """A tame config with one or two settings or statements of the wild generator in place of its own:
    every family meets every other setting (fp32, a paged cache on hopper, varlen on fa2, wgmma on decode,
    warps 1 on a paged decode, ...), which check must refuse or compile must build."""
    problem, schedule, backward = tame_parts(rng)
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.5:
            problem = _merged(problem, wild_problem(rng))
        else:
            schedule = _merged(schedule, wild_schedule(rng))
    return _block(problem, schedule, backward)


def _key(line: str) -> str:
    return line.split()[0]


def _merged(lines: list[str], extra: list[str]) -> list[str]:
    """`lines` with one line of `extra` in place of the line of the same key (or added)."""
    if not extra:
        return lines
    new = extra[len(lines) % len(extra)]
    return [line for line in lines if _key(line) != _key(new)] + [new]


def tame_parts(rng: random.Random) -> tuple[list[str], list[str], list[str] | None]:
    """(problem lines, schedule lines, backward lines or None) of tame_spec."""
    def pick(values):
        return rng.choice(values)
    problem = [f"head_dim = {pick([64, 64, 128, 128, 256, 32, 96, 16, 192])}"]
    if rng.random() < 0.3:
        problem.append(f"head_dim_v = {pick([64, 128, 32])}")
    problem.append(f"dtype = {pick(['bf16', 'fp16'])}")
    problem.append(pick(["mask = none", "mask = causal", "mask = window(left = 256, right = 8)"]))
    family = pick(["fa1", "fa2", "fa2", "wgmma", "decode", "decode", "hopper"])
    schedule = []
    if family == "decode":
        problem.append(f"queries = {pick([1, 4, 16])}")
        if rng.random() < 0.4:
            problem.append(f"kv_cache = paged(page = {pick([1, 16, 64])})")
        if rng.random() < 0.4:
            problem += ["kv_dtype = e4m3", f"kv_scale = {pick(['per_head', 'per_tensor'])}"]
            schedule.append(f"dequant {pick(['shared', 'fragments'])}")
        schedule += [f"tile kv = {pick([64, 128])}", f"warps {pick([1, 2, 4])} along kv",
                     f"pipeline {pick([1, 2])} stages", f"split kv = {pick(['1', '4', 'auto'])}"]
    elif family == "hopper":
        consumers = pick([1, 2, 3])
        if rng.random() < 0.3:
            problem.append("layout = varlen")
        schedule += [f"tile q = {64 * consumers}, kv = {pick([64, 128])}", f"warpgroups producer 1, consumer {consumers}",
                     f"pipeline {pick([2, 3])} stages"] + (["overlap intra"] if rng.random() < 0.5 else [])
    elif family == "fa1":
        axis = pick(["q", "kv"])
        schedule += ["order kv, q", f"tile q = {pick([32, 64])}, kv = {pick([64, 128])}", f"warps {pick([2, 4])} along "
                     f"{axis}", f"pipeline {pick([1, 2])} stages"]
    else:
        warps = pick([4, 8])
        if family == "wgmma":
            schedule += [f"tile q = {warps // 4 * 64}, kv = {pick([64, 128])}", f"warps {warps}", "mma wgmma"]
        else:
            schedule += [f"tile q = {pick([64, 128])}, kv = {pick([32, 64])}", f"warps {warps}"]
            if rng.random() < 0.3:
                problem.append(f"kv_cache = paged(page = {pick([16, 64])})")
        schedule.append(f"pipeline {pick([1, 2, 3])} stages")
    backward = []
    if family in ("fa2", "wgmma") and "kv_cache" not in " ".join(problem) and rng.random() < 0.4:
        mma = pick(["mma.sync", "wgmma"])
        backward = ["order kv, q", f"tile q = 64, kv = {128 if mma == 'wgmma' else pick([64, 128])}",
                    f"warps {8 if mma == 'wgmma' else pick([4, 8])}", "pipeline 2 stages", f"mma {mma}"]
    return problem, schedule, backward or None


# ---- nvcc: a seeded sample of every family compiles ----------------------------------------------------------

def _kind(spec) -> str:
    p = spec.problem
    kind = spec.family.value + ("_wgmma" if spec.schedule.mma.value == "wgmma" and spec.family is Family.FA2 else "")
    return kind + "".join(f"_{name}" for name, on in (("paged", p.kv_page_size is not None), ("fp8", p.kv_fp8),
                                                     ("varlen", p.seq_layout.value == "varlen")) if on)


def nvcc_sample(per_kind: int = 1, draws: int = 3000) -> list[tuple[str, str, str]]:
    """(what, kernel function, CUDA source) of `per_kind` accepted configs of every family and serving
    variant, and of each backward kernel (mma.sync, wgmma), from a seeded draw."""
    rng, taken, out = random.Random(2212), {}, []
    for _ in range(draws):
        for spec in accepted_configs(tame_spec(rng)):
            kind = _kind(spec)
            if taken.get(kind, 0) < per_kind:
                taken[kind] = taken.get(kind, 0) + 1
                out.append((kind, spec.kernel_name, render(lower(spec))))
            if spec.backward is not None and not backward_has_template(spec):
                kind = f"backward_{spec.backward.mma.value}"
                if taken.get(kind, 0) < per_kind:
                    taken[kind] = taken.get(kind, 0) + 1
                    plan = lower_backward(spec)
                    out.append((kind, plan.kernel_names["main"], render(plan)))
    return out


needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None and os.environ.get("TILEDSL_REQUIRE_NVCC") != "1",
                                reason="nvcc not on PATH")


@needs_nvcc
def test_a_sample_of_every_family_compiles_with_nvcc(tmp_path):
    sample = nvcc_sample()
    kinds = {kind for kind, _, _ in sample}
    assert kinds >= {"fa1", "fa2", "fa2_wgmma", "fa2_paged", "decode", "decode_paged", "decode_fp8", "hopper",
                     "hopper_varlen", "backward_mma.sync", "backward_wgmma"}, kinds

    def compiled(item):
        kind, function, source = item
        try:
            nvcc.resources(source, function)
        except RuntimeError as err:
            return f"{kind} {function}: {str(err)[:2000]}"
        return ""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(compiled, sample) if f]
    assert not failures, "\n\n".join(failures)
