"""`tiledsl tune` over a backward space on a real GPU (pytest -m gpu; skipped without one), and the
v2 dQ atomics (lower_backward(dq_vector=2)) the A/B bench compares with the default v4."""
from __future__ import annotations

import json

import pytest

from tests.test_tune_backward_cpu import SPACE

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tiledsl.cli.main import main
from tiledsl.frontend.parse import load_spec


def test_tiny_backward_tune_checks_times_and_stores(tmp_path, capsys):
    path, store, winner = tmp_path / "space.tile", tmp_path / "tune.json", tmp_path / "winner.tile"
    path.write_text(SPACE.format(d=64))
    args = ["tune", str(path), "--seqlen", "512", "--batch", "1", "--heads", "4", "--budget", "2",
            "--store", str(store), "-o", str(winner), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["timed"] == 2 and first["from_store"] == 0 and first["winner_tflops"] > 1
    checked = [r for r in first["rows"] if r["status"] == "timed"]
    assert len(checked) == 2 and all(max(r["errors"].values()) < 1e-2 for r in checked)
    spec = load_spec(winner)
    assert spec.kernel_name == first["winner"] and spec.backward is not None
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["timed"] == 0 and second["from_store"] == 2 and second["winner"] == first["winner"]


@pytest.mark.parametrize("d,tile", [(64, (128, 128, 8, 2)), (128, (64, 128, 8, 2))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("vector", [2, 4])
def test_dq_vector_variants(d, tile, causal, vector):
    from tiledsl.runtime.backward import BackwardKernel
    from tiledsl.dispatch.backward import backward_spec
    from tiledsl.lower.backward import lower_backward
    from tiledsl.spec import BackwardSchedule, DqAccumulate, DType, KernelSpec, LoopOrder, Mask
    from tiledsl.tune.backward import check_backward
    base = backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE)
    spec = KernelSpec(base.name, base.problem, base.schedule,
                      backward=BackwardSchedule(LoopOrder.KV_OUTER, *tile, dq=DqAccumulate.ATOMIC))
    ok, errors, why = check_backward(BackwardKernel(spec, lower_backward(spec, dq_vector=vector)))
    assert ok, (errors, why)
