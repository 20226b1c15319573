"""GPU tests of block-sparse attention in the warp-specialized backward (attention_backward(..., block_mask=,
block_size=) and autograd through tiledsl.attention(..., block_mask=)): dQ, dK, dV of fresh random inputs against
the float64 reference's gradients (tiledsl.reference.backward runs the same block mask), with O and the LSE from
the float64 reference forward, into memory poisoned with NaN; the other backward tests' error bound
(gpu_support.TOLERANCE_O, normwise relative). Random tables of density 0.1, 0.5 and 1.0, an empty q-block row and
an empty kv-block column (zero dK, dV), blocks larger than the tiles, (1, 1, ...), (1, heads, ...) and (batch, 1,
...) broadcast tables with GQA (a kv tile's steps span its query heads' rows), causal, kv_lens with a 0, query
lengths 17, 1000 and 4097, fp16 and bf16, ALiBi with blocks; deterministic dQ bit-identical run to run (and
right); autograd end to end; one compute-sanitizer run."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests.gpu_support import TOLERANCE_O, float64, memcheck, rel, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def table_of(rng, shape, density):
    return (rng.random(shape) < density).astype(np.int32)


def run(table: np.ndarray, d=128, causal=False, batch=2, heads=4, kv_heads=2, q_len=1000, kv_len=1000, block=128,
        kv_lens=None, deterministic=False, dtype="bfloat16", alibi=False, window=None, document_ids=None):
    """(errors of dQ, dK, dV, the gradients) of one attention_backward on fresh inputs into NaN-poisoned memory."""
    import torch

    from tiledsl.dispatch.backward import attention_backward, chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    dt = getattr(torch, dtype)
    q = torch.randn(batch, heads, q_len, d, device="cuda", dtype=dt)
    k = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=dt)
    v = torch.randn(batch, kv_heads, kv_len, d, device="cuda", dtype=dt)
    do = torch.randn(batch, heads, q_len, d, device="cuda", dtype=dt)
    kw = {"block_mask": torch.tensor(table, device="cuda"), "block_size": block}
    aux = {"block_mask": np.asarray(table)}
    if alibi:
        kw["alibi_slopes"] = torch.rand(heads, device="cuda") * 0.3
        aux["alibi_slopes"] = float64(kw["alibi_slopes"])
    if document_ids is not None:
        kw["document_ids"] = torch.tensor(document_ids, device="cuda", dtype=torch.int32)
        aux["document_ids"] = np.asarray(document_ids)
    mods, _ = modifications("attention_backward", differentiable=True, **kw)
    mask = Mask.WINDOW if window else Mask.CAUSAL if causal else Mask.NONE
    spec = chosen_backward_spec(device_arch(), DType.BF16, d, mask, d, window, deterministic=deterministic, mods=mods)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    lens64 = None if kv_lens is None else np.array(kv_lens)
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64, lens64, aux=aux)
    o, lse = torch.tensor(o64, device="cuda").to(dt), torch.tensor(lse64, device="cuda").float()
    ref = reference_backward(spec, q64, k64, v64, do64, float64(o), lse64, kv_lens=lens64, aux=aux)
    poison = [torch.full_like(x, float("nan")) for x in (q, k, v)]   # freed NaN blocks the outputs reuse
    del poison
    torch.cuda.synchronize()
    out = attention_backward(q, k, v, o, lse, do, causal=causal, window=window, kv_lens=lens,
                             deterministic=deterministic, **kw)
    torch.cuda.synchronize()
    return [rel(x, r) for x, r in zip(out, ref)], out


def check(errors):
    assert all(e < TOLERANCE_O for e in errors), f"dQ, dK, dV relative errors {errors}"


@pytest.fixture(scope="module", autouse=True)
def seeded():
    import torch
    torch.manual_seed(np.random.SeedSequence().entropy % 2 ** 31)   # fresh inputs per run
    yield


def blocks(q_len, kv_len, block=128):
    return -(-q_len // block), -(-kv_len // block)


@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("seqlen", [17, 1000])
def test_gradients(density, d, causal, seqlen):
    rng = np.random.default_rng()
    check(run(table_of(rng, (2, 4) + blocks(seqlen, seqlen), density), d, causal, q_len=seqlen, kv_len=seqlen)[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_4097_queries(dtype):
    rng = np.random.default_rng()
    check(run(table_of(rng, (1, 2) + blocks(4097, 4097), 0.25), 128, True, batch=1, heads=2, kv_heads=1,
              q_len=4097, kv_len=4097, dtype=dtype)[0])


def test_an_empty_q_row_and_an_empty_kv_column():
    import torch
    rng = np.random.default_rng()
    table = table_of(rng, (2, 4, 8, 8), 0.5)
    table[:, :, 2, :] = 0          # q block 2 sees nothing: zero dQ rows
    table[1, :, :, 5] = 0          # kv block 5 of batch 1 is seen by no query of any head: zero dK, dV
    errors, (dq, dk, dv) = run(table)
    check(errors)
    assert not dq[:, :, 256:384].any()
    assert not dk[1, :, 640:768].any() and not dv[1, :, 640:768].any()
    assert torch.isfinite(dq).all()


@pytest.mark.parametrize("block", [(256, 256), (256, 128), (128, 384)])
def test_blocks_larger_than_the_tiles(block):
    rng = np.random.default_rng()
    table = table_of(rng, (2, 4, -(-1000 // block[0]), -(-1300 // block[1])), 0.5)
    check(run(table, 128, True, q_len=1000, kv_len=1300, block=block)[0])


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_broadcast_tables_with_gqa(shape, d):
    rng = np.random.default_rng()
    check(run(table_of(rng, shape + blocks(700, 900), 0.5), d, False, heads=4, kv_heads=1, q_len=700, kv_len=900)[0])


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_kv_lens_including_zero(causal):
    rng = np.random.default_rng()
    errors, (dq, dk, dv) = run(table_of(rng, (3, 4) + blocks(330, 600), 0.5), 128, causal, batch=3, q_len=330,
                               kv_len=600, kv_lens=[600, 0, 177])
    check(errors)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_sliding_window_with_blocks(deterministic):
    rng = np.random.default_rng()
    check(run(table_of(rng, (2, 4) + blocks(1000, 1000), 0.5), 64, False, window=(300, 40),
              deterministic=deterministic)[0])


def test_documents_with_blocks():
    """Both narrow a kv tile's q tiles (documents by the keys' span, blocks by the table's column): together.
    Deterministic dQ with both is refused (layout.backward_ws.ws_ordered_refusal): its two counts of a writer's turn
    disagree, and the deterministic case never finished on the GPU."""
    rng = np.random.default_rng()
    lengths = rng.integers(1, 300, size=20)
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[:900]
    ids = np.concatenate([ids, np.full(900 - len(ids), -1, np.int32)])   # padding past the last document
    check(run(table_of(rng, (2, 4) + blocks(900, 900), 0.5), 128, True, q_len=900, kv_len=900,
              document_ids=np.stack([ids, ids[::-1].copy()]))[0])


def test_alibi_with_blocks():
    rng = np.random.default_rng()
    check(run(table_of(rng, (2, 4) + blocks(800, 800), 0.5), 128, True, q_len=800, kv_len=800, alibi=True)[0])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_bits_and_values(d):
    import torch

    from tiledsl.dispatch.backward import attention_backward
    rng = np.random.default_rng()
    table = table_of(rng, (2, 4) + blocks(1500, 1500), 0.4)
    check(run(table, d, True, q_len=1500, kv_len=1500, deterministic=True)[0])
    q, k, v, o, do = (torch.randn(2, 4, 1500, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(2, 4, 1500, device="cuda") + 8
    mask = torch.tensor(table, device="cuda")
    first = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, block_mask=mask)
    for _ in range(3):
        again = attention_backward(q, k, v, o, lse, do, causal=True, deterministic=True, block_mask=mask)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_end_to_end(deterministic):
    import torch

    import tiledsl
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.reference.backward import reference_backward
    from tiledsl.reference.forward import reference_attention
    from tiledsl.runtime.device import device_arch
    from tiledsl.spec import DType, Mask
    rng = np.random.default_rng()
    table = table_of(rng, (1, 4, 6, 6), 0.5)
    q, k, v = (torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = torch.tensor(table, device="cuda").bool()
    o = tiledsl.attention(q, k, v, causal=True, block_mask=mask, deterministic=deterministic)
    do = torch.randn_like(o)
    o.backward(do)
    mods, _ = modifications("attention", block_mask=mask)
    spec = chosen_backward_spec(device_arch(), DType.BF16, 128, Mask.CAUSAL, 128, mods=mods)
    aux = {"block_mask": table}
    q64, k64, v64, do64 = (float64(x) for x in (q, k, v, do))
    o64, lse64 = reference_attention(spec, q64, k64, v64, aux=aux)
    assert rel(o, o64) < TOLERANCE_O
    ref = reference_backward(spec, q64, k64, v64, do64, o64, lse64, aux=aux)
    check([rel(x.grad, r) for x, r in zip((q, k, v), ref)])


def test_compute_sanitizer_on_a_small_case(tmp_path):
    script = tmp_path / "blocks_backward_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tiledsl
        q = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 1, 450, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        table = torch.rand(2, 1, 3, 4, device="cuda") < 0.5
        o = tiledsl.attention(q, k, k, causal=True, block_mask=table, deterministic=True,
                              kv_lens=torch.tensor([450, 3], device="cuda", dtype=torch.int32))
        o.sum().backward()
        torch.cuda.synchronize()
    """))
    memcheck(script)
