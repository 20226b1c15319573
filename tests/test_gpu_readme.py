"""The README's serving example, run as written on the GPU: its outputs (the packed prompt prefill,
the last decode step, the chunked prefill) against the float64 serving references on the cache
the example filled. A README that stops working, or a kernel that reads the wrong page, fails here."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from .gpu_support import TOLERANCE_O, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]
README = Path(__file__).resolve().parent.parent / "README.md"


def serving_example() -> str:
    """The python block of the README's "Serving" section."""
    section = README.read_text().split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def relative_error(out, ref) -> float:
    out = out.float().cpu().numpy().astype(np.float64)
    return np.inf if not np.isfinite(out).all() else float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_readme_serving_example_runs_and_matches_the_references():
    torch = pytest.importorskip("torch")
    from tiledsl.reference.serving import paged_attention, varlen_attention
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(serving_example(), "README.md:Serving", "exec"), ns)   # noqa: S102 - the README's own code
    f64 = lambda t: t.float()   # noqa: E731 - the references read host copies; NumPy has no bf16
    ref, _ = varlen_attention(f64(ns["q"]), f64(ns["k"]), f64(ns["v"]), ns["cu"], ns["cu"], mask="causal")
    assert relative_error(ns["o_prompt"], ref) < TOLERANCE_O
    caches = f64(ns["k_cache"]), f64(ns["v_cache"])
    ref, _ = paged_attention(f64(ns["q_chunk"]), *caches, ns["block_table"], ns["kv_lens"], mask="causal")
    assert relative_error(ns["o_chunk"], ref) < TOLERANCE_O
    # the last decode step saw the cache before the chunk: kv_lens - chunk keys
    ref, _ = paged_attention(f64(ns["q_step"]), *caches, ns["block_table"], ns["kv_lens"] - ns["chunk"])
    assert relative_error(ns["o_step"], ref) < TOLERANCE_O


def plan_example() -> str:
    """The python block of the README's plan / run subsection (the 32-layer decode loop)."""
    section = README.read_text().split("\n### Plan once per step, run once per layer\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_plan_run_example_runs_and_its_last_layer_matches_the_reference():
    torch = pytest.importorskip("torch")
    from tiledsl.reference.serving import paged_attention
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(plan_example(), "README.md:Plan", "exec"), ns)   # noqa: S102 - the README's own code
    torch.cuda.synchronize()
    ref, _ = paged_attention(ns["q"].float(), ns["k_caches"][-1].float(), ns["v_caches"][-1].float(),
                             ns["block_table"], ns["kv_lens"])
    assert relative_error(ns["out"], ref) < TOLERANCE_O


def test_make_demo_runs_benches_and_fits_one_screen(tmp_path):
    """On the GPU the demo also runs, validates and times the default spec: still under one screen."""
    from .test_cli_edges import DEMO_MAX_LINES, make_demo
    done = make_demo(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) < DEMO_MAX_LINES, "\n".join(lines)
    assert any(line.endswith(" ok") and "O rel. error" in line for line in lines), "\n".join(lines)
    assert any("TFLOP/s" in line for line in lines) and "skipping run and bench" not in done.stdout
