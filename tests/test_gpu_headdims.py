"""`tiledsl.attention` for every head dim that is a multiple of 8 from 8 to 256 on a real GPU
(pytest -m gpu; skipped without one): both dtypes per head dim, the masks rotating over head dims
and dtypes, each kernel run with q_len < kv_len and q_len > kv_len, against the float64 reference.
Multiples of 8 that are not of 16 run on fa2 mma.sync padded on chip (layout.mma_width); a few
cases pad only one of d / dv. Outputs are NaN-poisoned before the kernel writes them."""
from __future__ import annotations

import concurrent.futures

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tiledsl.dispatch import kernels as loaded
from .gpu_support import poison_outputs
from tiledsl.runtime import compile as runtime_compile, device, launch
from tiledsl.dispatch import tuned
from tiledsl import attention
from tiledsl.spec import DType, Mask  # noqa: E402
from tiledsl.runtime.tensors import torch_dtype
from tiledsl.reference.gpu import lse_error, reference_attention, relative_error

TOLERANCE_O, TOLERANCE_LSE = 1e-2, 1e-3
MASKS = ("none", "causal", "window")
WINDOW = (100, 20)
LENGTHS = ((200, 333), (333, 200))   # (q_len, kv_len): both orders
CASES = [dict(d=d, dv=d, dtype=dtype, mask=MASKS[(d // 8 + i) % 3])
         for d in range(8, 257, 8) for i, dtype in enumerate((DType.BF16, DType.FP16))]
CASES += [dict(d=40, dv=24, dtype=DType.BF16, mask="causal"), dict(d=24, dv=72, dtype=DType.FP16, mask="window"),
          dict(d=64, dv=40, dtype=DType.BF16, mask="none")]


def _spec(case: dict, q_len: int):
    mask = {"none": Mask.NONE, "causal": Mask.CAUSAL, "window": Mask.WINDOW}[case["mask"]]
    spec, _ = tuned.tuned_spec(device.device_arch(), case["dtype"], case["d"], mask, case["dv"],
                               WINDOW if mask is Mask.WINDOW else None, None, q_len)
    return spec


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Every kernel the file runs, compiled in parallel into the disk cache (NVRTC releases the GIL)."""
    from tiledsl.families import compile
    arch = device.device_arch()
    kernels = {spec: compile(spec) for spec in {_spec(c, q) for c in CASES for q, _ in LENGTHS}}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: runtime_compile.compile_cubin(k.source, k.name, arch), kernels.values()))
    for kernel in kernels.values():
        loaded.add(kernel)
    return kernels


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """attention's outputs start as NaN (filled on the launch stream, before the kernel)."""
    poison_outputs(monkeypatch)
    yield
    launch.clear_prepared()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c['d']}v{c['dv']}-{c['dtype'].value}-{c['mask']}")
def test_every_head_dim_multiple_of_8(case):
    dtype = torch_dtype(case["dtype"])
    for seed, (q_len, kv_len) in enumerate(LENGTHS):
        gen = torch.Generator(device="cuda").manual_seed(seed + case["d"])
        q = torch.randn(2, 4, q_len, case["d"], device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(2, 2, kv_len, case["d"], device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(2, 2, kv_len, case["dv"], device="cuda", dtype=dtype, generator=gen)
        out, lse = attention(q, k, v, causal=case["mask"] == "causal",
                             window=WINDOW if case["mask"] == "window" else None, return_lse=True)
        torch.cuda.synchronize()
        assert out.shape == (2, 4, q_len, case["dv"])
        ref_o, ref_lse = reference_attention(_spec(case, q_len).problem, q, k, v)
        err_o, err_lse = relative_error(out, ref_o), lse_error(lse, ref_lse)
        assert err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE, (_spec(case, q_len).kernel_name, q_len, kv_len, err_o, err_lse)
