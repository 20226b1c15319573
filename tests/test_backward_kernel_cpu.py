"""The backward kernels on the CPU (issue 14): layout rules and refusals at the DSL line, the plan of
templates/backward.cu.j2 (ops in the backward graph's order, shared-memory layout), the spec table of
tiledsl.dispatch.backward, the bundled backward specs' generated/ files, CLI output, and (with nvcc) ptxas."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiledsl.codegen import nvcc
from tiledsl.dispatch.backward import BACKWARD_TUNED, backward_spec
from tiledsl.runtime.backward import compile_backward
from tiledsl.cli.main import main as cli_main
from tiledsl.errors import SpecError
from tiledsl.families import lower
from tiledsl.layout.backward import backward_has_template, backward_layout
from tiledsl.lower.backward import backward_kernel_name, lower_backward
from tiledsl.frontend.parse import load_spec
from tiledsl.codegen.render import render
from tiledsl.spec import DqAccumulate, DType, Mask

from .test_codegen import generable_specs

ROOT = Path(__file__).resolve().parent.parent
BACKWARD_SPECS = [s for s in generable_specs() if s.backward is not None]


def kernel(backward: str, head_dim: int = 128, mask: str = "causal") -> str:
    body = "".join(f"        {line.strip()}\n" for line in backward.split(";") if line.strip())
    return (f"attention b {{\n    head_dim = {head_dim}\n    dtype = bf16\n    mask = {mask}\n"
            "    schedule {\n        tile q = 64, kv = 32\n        warps 4\n    }\n"   # a forward that fits d256
            f"    backward {{\n{body}    }}\n}}\n")


def test_bundled_backward_specs_exist():
    assert {s.problem.head_dim_qk for s in BACKWARD_SPECS} >= {64, 128}


@pytest.mark.parametrize("spec", BACKWARD_SPECS, ids=lambda s: s.name)
def test_generated_backward_is_fresh(spec):
    path = ROOT / "generated" / f"{backward_kernel_name(spec)}.cu"
    assert path.exists() and path.read_text() == render(lower_backward(spec)), \
        f"{path.name} missing or stale: run `tiledsl compile specs/{Path(spec.source_file).name} -o generated`"


@pytest.mark.parametrize("spec", BACKWARD_SPECS, ids=lambda s: s.name)
def test_forward_of_a_backward_spec_is_unchanged(spec):
    plan = lower(spec)   # tiledsl.compile's plan: the forward kernel
    assert plan.template == "fa2.cu.j2" and "_backward" not in plan.kernel_name


@pytest.mark.parametrize("dq", ["atomic", "separate"])
def test_loop_body_follows_the_graph(dq):
    plan = lower_backward(load_spec(kernel(f"dq accumulate {dq}")))
    kinds = [op.kind for op in plan.loop_body]
    expect = ["mma_qk", "mask", "recompute_p", "mma_dv", "mma_dp", "softmax_grad", "mma_dk"]
    if dq == "atomic":
        expect += ["stage_ds", "mma_dq", "accumulate_dq"]
    assert kinds == expect
    assert set(plan.kernel_names) == {"preprocess", "main", "convert" if dq == "atomic" else "dq"}
    assert all(op.where.startswith("<string>:") or ":" in op.where for op in plan.loop_body)
    assert (plan.dq_launch is None) == (dq == "atomic")


@pytest.mark.parametrize("d,tile_q,stages,dq", [(64, 64, 2, "atomic"), (128, 32, 1, "atomic"), (96, 64, 3, "separate"),
                                                (80, 64, 2, "separate")])
def test_shared_memory_layout(d, tile_q, stages, dq):
    spec = load_spec(kernel(f"tile q = {tile_q}, kv = 128; warps 8; pipeline {stages} stages; dq accumulate {dq}", d))
    plan = lower_backward(spec)
    c = {k.name: k.value for k in plan.constants}
    lay = backward_layout(spec)
    spans = sorted((b.offset, b.offset + b.bytes) for b in lay.main.buffers)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans   # no overlap
    assert all(b.offset % 128 == 0 for b in lay.main.buffers)
    assert c["SMEM_BYTES"] == plan.launch.smem_bytes >= spans[-1][1]
    assert c["Q_STAGE_BYTES"] * stages == lay.main.buffer("Q").bytes
    assert plan.launch.threads == 256 and c["KV_M_TILES"] == 1
    if dq == "separate":
        assert plan.dq_launch.smem_bytes == c["DQK_SMEM_BYTES"] and plan.dq_launch.threads == 32 * tile_q // 16


@pytest.mark.parametrize("backward,line,message", [
    ("tile q = 64, kv = 128; warps 8", 10, "registers: ~"),                        # d256: dK + dV alone 256 registers
    ("tile q = 64, kv = 96; warps 8", 11, "a multiple of 16"),
])
def test_check_refuses_what_does_not_fit_at_the_backward_line(backward, line, message):
    with pytest.raises(SpecError, match=message) as err:
        load_spec(kernel(backward, 256 if "kv = 128" in backward else 64))
    assert err.value.span.line == line


@pytest.mark.parametrize("backward,why", [("order q, kv", "kv outer"), ("dq accumulate ordered", "ordered"),
                                          ("tile q = 64, kv = 128; warps 8; mma wgmma; dq accumulate separate", "wgmma")])
def test_backwards_without_a_template_check_but_do_not_lower(backward, why):
    spec = load_spec(kernel(backward, 128))   # the checker takes it (explain, reference_backward)
    assert why in backward_has_template(spec)
    with pytest.raises(SpecError, match=why):
        lower_backward(spec)


def test_backward_spec_table_and_fallbacks():
    spec = backward_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL)
    assert spec.backward == BACKWARD_TUNED[128]
    assert spec.backward.dq is DqAccumulate.ATOMIC
    assert backward_spec("sm_90a", DType.FP16, 64, Mask.NONE, deterministic=True).backward.dq is DqAccumulate.SEPARATE
    odd = backward_spec("sm_90a", DType.BF16, 80, Mask.NONE)   # 8 warps can't split an 80-wide dQ: 4 warps
    assert odd.backward.warps == 4 and compile_backward(odd).source
    with pytest.raises(Exception, match="no backward schedule fits head dim 256"):
        backward_spec("sm_90a", DType.BF16, 256, Mask.NONE)


def test_cli_compile_writes_the_backward_module(tmp_path, capsys):
    spec = BACKWARD_SPECS[0]
    assert cli_main(["compile", str(spec.source_file), "-o", str(tmp_path)]) == 0
    assert (tmp_path / f"{backward_kernel_name(spec)}.cu").read_text() == render(lower_backward(spec))
    assert (tmp_path / f"{spec.kernel_name}.cu").exists()


@pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("spec", BACKWARD_SPECS, ids=lambda s: s.name)
def test_bundled_backward_compiles_without_spills(spec):
    plan = lower_backward(spec)
    from tiledsl.codegen.nvcc import compile_to, parse_ptxas
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        _, report = compile_to(render(plan), plan.kernel_name, "cubin", Path(tmp))
    resources = parse_ptxas(report)
    for role, name in plan.kernel_names.items():
        res = resources[name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, f"{name} spills:\n{report}"
        assert 0 < res.registers <= 255
