"""`tiledsl tune` and `tiledsl.attention` on a real GPU (pytest -m gpu; skipped without one)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tiledsl.dispatch import tuned
from tiledsl.runtime import warm
from tiledsl import attention
from tiledsl.cli.main import main
from tiledsl.frontend.parse import load_spec
from tiledsl.spec import DType, Mask, Problem  # noqa: E402
from tiledsl.reference.gpu import reference_attention, relative_error

ROOT = Path(__file__).resolve().parent.parent


def test_tune_writes_a_checked_winner_and_answers_again_from_the_store(tmp_path, capsys):
    store, winner = tmp_path / "tune.json", tmp_path / "winner.tile"
    args = ["tune", str(ROOT / "specs" / "fa2_space_d64.tile"), "--seqlen", "1024", "--batch", "2", "--heads", "8",
            "--budget", "3", "--store", str(store), "-o", str(winner), "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["timed"] == 3 and first["from_store"] == 0 and first["winner_tflops"] > 10
    spec = load_spec(winner)
    assert spec.kernel_name == first["winner"]
    assert main(["check", str(winner)]) == 0
    capsys.readouterr()
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["timed"] == 0 and second["from_store"] == 3 and second["winner"] == first["winner"]


def test_tune_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "tune.png"
    assert main(["tune", str(ROOT / "specs" / "fa2_space_d128.tile"), "--seqlen", "512", "--batch", "1", "--heads", "4",
                 "--budget", "2", "--store", str(tmp_path / "s.json"), "-o", str(tmp_path / "w.tile"),
                 "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_matches_the_reference(d, causal, dtype):
    q, k, v = (torch.randn(2, 4, 333, d, device="cuda", dtype=dtype) for _ in range(3))
    o = attention(q, k, v, causal=causal)
    problem = Problem(d, d, DType.BF16 if dtype is torch.bfloat16 else DType.FP16, Mask.CAUSAL if causal else Mask.NONE)
    ref, _ = reference_attention(problem, q, k, v)
    assert relative_error(o, ref) < 1e-2
    from tiledsl.dispatch.kernels import LOADED
    assert len(LOADED) >= 1


def test_attention_on_an_unknown_gpu_uses_the_default_and_hints_once(capsys, monkeypatch):
    monkeypatch.setattr(tuned, "_hinted", set())
    monkeypatch.setattr(tuned, "_resolved", {})   # resolve afresh, and keep this pick out of the warm records
    monkeypatch.setattr(warm, "load", lambda arch, lookup: None)
    monkeypatch.setattr(warm, "save", lambda *a: None)
    q, k, v = (torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    real = tuned.tuned_spec   # the GPU is an H200; make the table lookup miss as on a GPU it does not know
    monkeypatch.setattr(tuned, "tuned_spec", lambda arch, *a, **kw: real("sm_1000", *a, **kw))
    for _ in range(2):
        o = attention(q, k, v)
    err = capsys.readouterr().err
    assert err.count("tiledsl tune") == 1
    ref, _ = reference_attention(Problem(64, 64, DType.BF16, Mask.NONE), q, k, v)
    assert relative_error(o, ref) < 1e-2
