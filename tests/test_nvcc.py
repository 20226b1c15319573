"""Every bundled kernel compiled by nvcc for sm_90a, with its ptxas report checked: no spills, no
stack frame, registers and shared memory within the limits. Search-space members must compile
too (their spills are the tuner's business). CI sets TILEDSL_REQUIRE_NVCC=1 so that a missing
nvcc fails loudly instead of skipping."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiledsl import nvcc
from tiledsl.check import SpecSpace
from tiledsl.errors import SpecError
from tiledsl.families import WITH_TEMPLATE, lower
from tiledsl.parse import parse_file
from tiledsl.render import render

from .test_codegen import SPEC_FILES, generable_specs

SHARED_LIMIT = 232448   # sm_90: 227 KB of dynamic shared memory per block

if nvcc.nvcc_path() is None:
    if os.environ.get("TILEDSL_REQUIRE_NVCC") == "1":
        raise RuntimeError("TILEDSL_REQUIRE_NVCC=1 but nvcc is not on PATH")
    pytest.skip("nvcc not on PATH", allow_module_level=True)


@pytest.mark.parametrize("spec", generable_specs(), ids=lambda s: s.kernel_name)
def test_bundled_kernel_compiles_without_spills(spec):
    plan = lower(spec)
    res = nvcc.resources(render(plan), spec.kernel_name)
    assert res.spill_stores == 0 and res.spill_loads == 0, f"{spec.kernel_name} spills:\n{res.report}"
    assert res.stack_bytes == 0, f"{spec.kernel_name} has a stack frame (local arrays):\n{res.report}"
    assert 0 < res.registers <= 255
    assert plan.launch.smem_bytes + res.static_shared_bytes <= SHARED_LIMIT


def test_search_space_members_compile():
    members = []
    for path in SPEC_FILES:
        for item in parse_file(path):
            if isinstance(item, SpecSpace):
                members += [s for s in item.expand()[0] if s.family in WITH_TEMPLATE]
    assert members, "the bundled search spaces should have members"
    plans = []
    for spec in members:
        try:
            plans.append(lower(spec))
        except SpecError:   # refused by the legality pass: the tuner prunes it
            continue
    assert len(plans) >= len(members) // 2, "most of a bundled space should be legal"
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        reports = list(pool.map(lambda p: nvcc.resources(render(p), p.kernel_name), plans))
    assert all(r.registers > 0 for r in reports)
