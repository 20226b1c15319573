"""The register count each layout says ptxas will report (Layout.ptxas_registers) against ptxas itself, for every
bundled kernel (backward main kernels included) and a seeded sample of legal configs of every family
(tests/register_sample.py); and what check and explain print about it."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiledsl.cli.main import main as cli_main
from tiledsl.codegen import nvcc
from tiledsl.device_limits import H200, entry_registers, register_ceiling
from tiledsl.layout.base import PTXAS_REGISTER_SPREAD, PTXAS_REGISTER_TOLERANCE, SETMAXNREG_FAMILIES

from .register_sample import SPACES, bundled_kernels, legal_configs, sampled_kernels

TEST_PER_FAMILY = 4      # sampled configs per family compiled here (bench/register_estimates.py takes more)

needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None and os.environ.get("TILEDSL_REQUIRE_NVCC") != "1",
                                reason="nvcc not on PATH")


def kernels():
    return bundled_kernels() + sampled_kernels(TEST_PER_FAMILY)


def test_every_family_is_sampled_and_has_a_spread():
    sample = sampled_kernels(TEST_PER_FAMILY)
    assert {k.what for k in sample} == set(SPACES)
    assert {k.layout.family for k in sample} == set(PTXAS_REGISTER_SPREAD) | set(SETMAXNREG_FAMILIES)
    assert all(len(legal_configs(family)) > TEST_PER_FAMILY for family in SPACES)


def test_ranges_lie_under_the_launch_bounds_ceiling():
    for k in kernels():
        lay = k.layout
        low, high = lay.ptxas_registers
        assert 0 < low <= high <= lay.register_ceiling == register_ceiling(H200, lay.threads, lay.min_blocks_per_sm)
        assert f"__launch_bounds__(C::THREADS, {lay.min_blocks_per_sm})" in k.source, k.function
        if lay.family in SETMAXNREG_FAMILIES:   # ptxas reports what the block launches with
            assert low == high == min(255, entry_registers(H200, lay.threads)), k.function


def test_the_ceiling_is_the_launch_bounds_share_of_the_register_file():
    assert register_ceiling(H200, 128) == 255            # 512 a thread, at most 255
    assert register_ceiling(H200, 256, 2) == 128
    assert register_ceiling(H200, 384) == 168            # 170, in whole granules of 8
    assert register_ceiling(H200, 512) == 128


@needs_nvcc
def test_ptxas_counts_lie_in_the_layouts_ranges():
    def outside(k):
        found = nvcc.resources(k.source, k.function).registers
        low, high = k.layout.ptxas_registers
        if low <= found <= high:
            return ""
        return (f"{k.what} {k.function}: ptxas {found}, the layout says {low}..{high} (estimate "
                f"{k.layout.register_estimate}, ceiling {k.layout.register_ceiling})")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failures = [f for f in pool.map(outside, kernels()) if f]
    assert not failures, "\n".join(failures)


def test_check_says_who_decides_the_register_count(capsys):
    assert cli_main(["check", "specs/fa1_d64.tile"]) == 0
    out = capsys.readouterr().out
    low, high = PTXAS_REGISTER_SPREAD["fa1"]
    assert high - low > 2 * PTXAS_REGISTER_TOLERANCE   # too wide to print as one number
    assert out.count("ptxas decides the count") == 2, out
    assert cli_main(["check", "specs/hopper_d128.tile"]) == 0
    out = capsys.readouterr().out
    assert "ptxas: 168 registers per thread (the launch bounds' ceiling" in out, out
    assert cli_main(["check", "specs/backward_ws_d64.tile"]) == 0
    out = capsys.readouterr().out
    assert "registers (backward): ptxas: 168 registers per thread" in out, out


def test_explain_prints_the_range_beside_the_estimate(capsys):
    assert cli_main(["explain", "specs/decode_d128.tile", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "live in the loop; ptxas decides the count:" in out, out
