"""Block-sparse attention (`mask = blocks(q = N, kv = M)`, the API's block_mask= / block_size=) in the hopper
forward on the GPU against the float64 reference (tiledsl.reference.forward), into NaN-poisoned outputs: random
block tables of density 0.1, 0.5 and 1.0, a whole empty q-block row (O = 0, LSE = -inf), blocks larger than the
kernel's tiles and blocks whose size makes the API pick smaller tiles, (1, 1, ...), (1, heads, ...) and
(batch, 1, ...) broadcast tables, causal + blocks, kv_lens with 0, GQA, query lengths 17, 1000 and 4097, fp16 and
bf16, with documents and the score modifications; a FlexAttention BlockMask input, the refusals before launch,
no host sync, a gradient the backward's tiles cannot give refused before the forward, and one compute-sanitizer
run. The backward: tests/test_gpu_block_sparse_backward.py."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tiledsl.mods.model import AUX_BLOCK_MASK, AUX_DOCUMENT_IDS, AUX_SINKS, Modifications

from .gpu_support import check, memcheck, no_host_sync, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def random_table(rng, shape: tuple, density: float) -> np.ndarray:
    return (rng.random(shape) < density).astype(np.int32)


def blocks_of(q_len: int, kv_len: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-q_len // block[0]), -(-kv_len // block[1])


def run(q_len, kv_len, table: np.ndarray, block=(128, 128), *, batch=2, heads=4, kv_heads=None, head_dim=128,
        causal=False, kv_lens=None, dtype="bfloat16", table_dtype="int32", extra=None, window=None):
    """(O error, LSE error) of tiledsl.attention(..., block_mask=table, block_size=block) into NaN-poisoned
    outputs (the kernel the API picks, run with out= / lse= through its prepared call) against the float64
    reference of the spec spec_for prints; returns (errors, O, LSE) for further checks."""
    import cupy
    import torch

    import tiledsl
    from tiledsl.reference.forward import reference_attention
    from tiledsl.reference.gpu import as_float64, lse_error, relative_error
    from tiledsl.runtime.tensors import view
    dt = getattr(torch, dtype)
    kv_heads = kv_heads or heads
    q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dt)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, device="cuda", dtype=dt)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, device="cuda", dtype=dt)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    given = torch.tensor(table, device="cuda").to(getattr(torch, table_dtype))
    extra = dict(extra or {})
    out, lse = tiledsl.attention(q, k, v, causal=causal, window=window, kv_lens=lens, block_mask=given,
                                 block_size=block, return_lse=True, **extra)
    torch.cuda.synchronize()
    spec = tiledsl.parse_text(tiledsl.spec_for(q, k, v, causal=causal, window=window, block_mask=given,
                                               block_size=block, **extra))[0]
    aux = {AUX_BLOCK_MASK: np.asarray(table, dtype=np.int32)}
    aux |= {name: extra[key].cpu().numpy() for name, key in ((AUX_SINKS, "sinks"), (AUX_DOCUMENT_IDS, "document_ids"))
            if key in extra}
    if "alibi_slopes" in extra:
        aux["alibi_slopes"] = extra["alibi_slopes"].cpu().numpy()
    q64, k64, v64 = (cupy.asnumpy(as_float64(view(x, n))) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    ref_o, ref_lse = reference_attention(spec, q64, k64, v64, None if kv_lens is None else np.array(kv_lens), aux=aux)
    return (relative_error(out, cupy.asarray(ref_o)), lse_error(lse, cupy.asarray(ref_lse))), out, lse


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output the runtime allocates starts as NaN: a row the kernel fails to write shows up."""
    from .gpu_support import poison_outputs
    poison_outputs(monkeypatch)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("q_len", [17, 1000])
def test_random_tables_match_the_reference(head_dim, causal, density, q_len):
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4) + blocks_of(q_len, q_len, (128, 128)), density)
    check(run(q_len, q_len, table, head_dim=head_dim, causal=causal)[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_4097_queries_fp16_and_bf16(dtype, causal):
    rng = np.random.default_rng()
    table = random_table(rng, (1, 2) + blocks_of(4097, 4097, (128, 128)), 0.25)
    check(run(4097, 4097, table, batch=1, heads=2, causal=causal, dtype=dtype)[0])


def test_an_empty_q_block_row_writes_zero_and_minus_infinity():
    import torch
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4, 8, 8), 0.5)
    table[1, 2, 3, :] = 0          # q block 3 of (batch 1, head 2) sees nothing
    table[0, :, 0, :] = 0          # and the first q block of every head of batch 0
    errs, out, lse = run(1000, 1000, table)
    check(errs)
    assert torch.equal(out[1, 2, 384:512], torch.zeros_like(out[1, 2, 384:512]))
    assert bool(torch.isneginf(lse[1, 2, 384:512]).all()) and bool(torch.isneginf(lse[0, :, :128]).all())


@pytest.mark.parametrize("block", [(256, 256), (256, 64), (128, 256), (384, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_larger_than_the_tiles_and_smaller_kv_blocks(block, causal):
    """256 / 384 blocks hold several 128 tiles; 64-key blocks make the API pick 64-key tiles."""
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4) + blocks_of(1000, 1300, block), 0.5)
    check(run(1000, 1300, table, block, causal=causal)[0])


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 1)])
def test_broadcast_tables(shape):
    rng = np.random.default_rng()
    table = random_table(rng, shape + blocks_of(700, 900, (128, 128)), 0.5)
    check(run(700, 900, table)[0])


@pytest.mark.parametrize("table_dtype", ["bool", "int8", "int64"])
def test_bool_and_other_int_tables_are_converted_on_the_device(table_dtype):
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4, 4, 4), 0.5)
    check(run(500, 500, table, table_dtype=table_dtype)[0])


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_unequal_lengths_and_kv_lens_with_zero(causal):
    rng = np.random.default_rng()
    table = random_table(rng, (3, 8) + blocks_of(300, 700, (128, 128)), 0.5)
    check(run(300, 700, table, batch=3, heads=8, kv_heads=2, causal=causal, kv_lens=[0, 1, 537])[0])
    table = random_table(rng, (3, 1) + blocks_of(900, 260, (128, 128)), 0.5)
    check(run(900, 260, table, batch=3, heads=4, kv_heads=1, causal=causal, kv_lens=[260, 0, 129],
              head_dim=64)[0])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_sliding_window_with_blocks(head_dim):
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4) + blocks_of(1000, 1000, (128, 128)), 0.5)
    check(run(1000, 1000, table, head_dim=head_dim, window=(300, 40))[0])


def test_with_the_score_modifications_and_documents():
    import torch
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4, 8, 8), 0.5)
    extra = dict(alibi_slopes=torch.rand(4, device="cuda") * 0.3, sinks=torch.randn(4, device="cuda"))
    check(run(1000, 1000, table, causal=True, extra=extra)[0])
    ids = np.repeat(np.arange(10, dtype=np.int32), 100)[None].repeat(2, 0)
    check(run(1000, 1000, table, causal=True, extra=dict(document_ids=torch.tensor(ids, device="cuda")))[0])


def flex_block_mask(table, q_len: int, kv_len: int, block: int = 128):
    """A FlexAttention BlockMask whose blocks are `table`'s nonzero entries, all full (no mask_mod)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    t = torch.tensor(table, device="cuda", dtype=torch.int32)
    counts = t.sum(-1).to(torch.int32)
    indices = torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)
    empty = torch.zeros_like(counts)
    return BlockMask.from_kv_blocks(empty, indices, counts, indices, BLOCK_SIZE=block, seq_lengths=(q_len, kv_len))


def test_a_flex_block_mask_gives_the_table_s_answer():
    import torch

    import tiledsl
    rng = np.random.default_rng()
    table = random_table(rng, (2, 4, 8, 8), 0.3)
    q = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    dense = tiledsl.attention(q, k, v, block_mask=torch.tensor(table, device="cuda"), block_size=128)
    flex = tiledsl.attention(q, k, v, block_mask=flex_block_mask(table, 1000, 1000))
    assert torch.equal(dense, flex)
    check(run(1000, 1000, table)[0])


def test_a_flex_block_mask_with_a_mask_mod_is_refused():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 256, 256, device="cuda")
    with pytest.raises(RuntimeInputError, match="BlockMask with a mask_mod"):
        tiledsl.attention(q, q, q, block_mask=mask)


def test_tables_are_checked_before_launch():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    good = torch.ones(2, 4, 8, 8, device="cuda", dtype=torch.int32)
    tiledsl.attention(q, q, q, block_mask=good)
    for table, size, words in ((torch.ones(2, 4, 8, device="cuda", dtype=torch.int32), 128, "4-d"),
                               (good.float(), 128, "int or bool"),
                               (torch.ones(2, 4, 7, 8, device="cuda", dtype=torch.int32), 128,
                                r"block_mask must be \(batch or 1, heads or 1, 8, 8\)"),
                               (torch.ones(2, 4, 8, 7, device="cuda", dtype=torch.int32), 128, "block_mask must be"),
                               (torch.ones(3, 4, 8, 8, device="cuda", dtype=torch.int32), 128, "block_mask must be"),
                               (good, 100, "multiples of 16"),
                               (good, (128, 128, 1), "block_size"),
                               (torch.ones(2, 4, 16, 16, device="cuda", dtype=torch.int32), 64,
                                "tiles .* must divide the blocks")):
        with pytest.raises(RuntimeInputError, match=words):
            tiledsl.attention(q, q, q, block_mask=table, block_size=size)
    with pytest.raises(RuntimeInputError, match="pass block_mask too"):
        tiledsl.attention(q, q, q, block_size=128)


def test_no_host_sync():
    import torch

    import tiledsl
    rng = np.random.default_rng()
    q = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor(random_table(rng, (2, 4, 8, 8), 0.5), device="cuda").bool()
    flex = flex_block_mask(random_table(rng, (2, 4, 8, 8), 0.5), 1000, 1000)
    tiledsl.attention(q, q, q, block_mask=table)
    tiledsl.attention(q, q, q, block_mask=flex)
    torch.cuda.synchronize()
    with no_host_sync():
        tiledsl.attention(q, q, q, block_mask=table)
        tiledsl.attention(q, q, q, block_mask=flex)


def test_a_gradient_the_backward_tiles_cannot_give_is_refused_before_it_runs():
    import torch

    import tiledsl
    from tiledsl.errors import RuntimeInputError
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    table = torch.ones(1, 1, 4, 4, device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications .blocks.*must divide"):
        tiledsl.attention(q, q, q, block_mask=table, block_size=64)


def test_the_kernel_refuses_a_table_of_the_wrong_element_type():
    import torch

    from tiledsl import compile
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.errors import RuntimeInputError
    from tiledsl.spec import DType, Mask
    kernel = compile(tuned_spec("sm_90a", DType.BF16, 128, Mask.NONE, 128, None, None, 256,
                                Modifications(blocks=(128, 128)))[0])
    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeInputError, match="block_mask must be int32"):
        kernel(q, q, q, aux={AUX_BLOCK_MASK: torch.ones(1, 1, 2, 2, device="cuda", dtype=torch.int64)})


def test_compute_sanitizer_on_a_small_block_sparse_case(tmp_path):
    script = tmp_path / "blocks_memcheck.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tiledsl
        q = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1, 450, 64, device="cuda", dtype=torch.bfloat16)
        table = torch.rand(2, 1, 3, 4, device="cuda") < 0.5
        tiledsl.attention(q, k, k, causal=True, block_mask=table, kv_lens=torch.tensor([450, 3], device="cuda",
                          dtype=torch.int32))
        torch.cuda.synchronize()
    """))
    memcheck(script)
