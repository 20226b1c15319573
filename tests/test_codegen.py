"""Lowering and rendering: deterministic output, named sources, sizes derived in Python, and the
generated/ folder in step with specs/ and templates/."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from tiledsl.cli.common import concrete_specs
from tiledsl.errors import SpecError
from tiledsl.families import WITH_TEMPLATE, lower
from tiledsl.layout.base import tile_row_bytes
from tiledsl.codegen.render import cuda_literal, render
from tiledsl.spec import DTYPES, DType, KernelSpec, Mask, Problem, Schedule

ROOT = Path(__file__).resolve().parent.parent
SPEC_FILES = sorted((ROOT / "specs").glob("*.tile"))


def generable_specs():
    return [s for s in concrete_specs([str(p) for p in SPEC_FILES]) if s.family in WITH_TEMPLATE]


def test_every_dtype_has_every_spelling():
    assert set(DTYPES) == set(DType)
    for dtype, info in DTYPES.items():
        for name, value in dataclasses.asdict(info).items():
            assert value or (name == "cai" and dtype in (DType.BF16, DType.E4M3)), f"{dtype}: no {name}"   # no CAI typestr
        assert np.dtype(info.storage).itemsize == info.bytes == info.dlpack[1] // 8, dtype
        assert info.cai in (None, np.dtype(info.storage).str), dtype   # typestrs are little-endian NumPy strs


def test_bundled_specs_include_every_family_with_a_template():
    families = {s.family for s in generable_specs()}
    assert set(WITH_TEMPLATE) <= families


@pytest.mark.parametrize("spec", generable_specs(), ids=lambda s: s.kernel_name)
def test_generated_folder_is_fresh(spec):
    path = ROOT / "generated" / f"{spec.kernel_name}.cu"
    assert path.exists(), f"{path.name} missing: run `tiledsl compile specs/*.tile -o generated`"
    assert path.read_text() == render(lower(spec)), f"{path.name} is stale: run `tiledsl compile specs/*.tile -o generated`"


def test_no_stray_files_in_generated():
    from tiledsl.layout.backward import backward_has_template
    from tiledsl.lower.backward import backward_kernel_name
    expected = {f"{s.kernel_name}.cu" for s in generable_specs()}
    expected |= {f"{backward_kernel_name(s)}.cu" for s in generable_specs()   # backward modules (issue 14)
                 if s.backward is not None and not backward_has_template(s)}
    present = {p.name for p in (ROOT / "generated").glob("*.cu")}
    assert present <= expected, f"generated/ has files no spec produces: {sorted(present - expected)}"


@pytest.mark.parametrize("spec", generable_specs(), ids=lambda s: s.kernel_name)
def test_source_names_its_spec(spec):
    source = render(lower(spec))
    assert source == render(lower(spec)), "rendering must be deterministic"
    assert spec.config_hash in source and spec.kernel_name in source
    tile_file = Path(spec.source_file).name
    regions = re.findall(rf"// \[{re.escape(tile_file)}:(\d+)\]", source)
    assert len(regions) >= 5, "each region of the kernel names its DSL line"
    lines = spec.source_text.splitlines()
    for line in set(regions):
        assert 1 <= int(line) <= len(lines)


def _spec(d=128, tile_q=128, tile_kv=64, warps=4, stages=2, dtype=DType.BF16, mask=Mask.NONE, dv=None):
    return KernelSpec("t", Problem(d, dv or d, dtype, mask), Schedule(tile_q=tile_q, tile_kv=tile_kv, warps=warps, stages=stages))


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (256, 256), (128, 64)])
def test_shared_memory_layout(d, dv, stages):
    plan = lower(_spec(d=d, dv=dv, tile_q=64, tile_kv=32, stages=stages))
    c = {k.name: k.value for k in plan.constants}
    for name in ("Q_OFFSET", "K_OFFSET", "V_OFFSET", "O_OFFSET"):
        assert c[name] % 128 == 0
    assert c["K_OFFSET"] >= c["Q_OFFSET"] + 64 * c["QK_ROW_BYTES"]
    assert c["V_OFFSET"] >= c["K_OFFSET"] + stages * c["K_STAGE_BYTES"]
    assert c["SMEM_BYTES"] >= c["V_OFFSET"] + stages * c["V_STAGE_BYTES"]
    assert c["SMEM_BYTES"] == plan.launch.smem_bytes
    assert c["QK_ROW_BYTES"] == tile_row_bytes(d)[0] and c["V_ROW_BYTES"] == tile_row_bytes(dv)[0]
    if c["O_OFFSET"] != c["Q_OFFSET"]:
        assert c["O_OFFSET"] >= c["V_OFFSET"] + stages * c["V_STAGE_BYTES"]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_pipeline_bookkeeping(stages):
    """cp.async groups: Q, then K and V of each tile; waits must leave exactly the later groups in flight."""
    body = lower(_spec(stages=stages)).loop_body
    kinds = [op.kind for op in body]
    assert kinds.index("mma_qk") < kinds.index("online_softmax") < kinds.index("mma_pv")
    wait_k = next(op for op in body if op.kind == "wait_k")
    wait_v = next(op for op in body if op.kind == "wait_v")
    prefetch = next(op for op in body if op.kind == "prefetch_kv")
    assert prefetch.distance == stages - 1
    if stages == 1:
        assert kinds.index("prefetch_kv") < kinds.index("wait_k") and (wait_k.pending, wait_v.pending) == (1, 0)
    else:
        assert kinds.index("wait_k") < kinds.index("prefetch_kv") < kinds.index("mma_qk")
        assert (wait_k.pending, wait_v.pending) == (2 * stages - 3, 2 * stages - 2)


def test_fp32_is_refused_by_fa2_with_the_dtype_line():
    with pytest.raises(SpecError, match="fp16 or bf16"):
        lower(_spec(dtype=DType.FP32))


@pytest.mark.parametrize("value,text", [(True, "true"), (False, "false"), (3, "3"), (0.5, "0.5f"), (2**31, "2147483648u")])
def test_cuda_literal(value, text):
    assert cuda_literal(value) == text
