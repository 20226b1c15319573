"""Block-sparse attention (`mask = blocks(q = N, kv = M)`) in the hopper forward without a GPU: the spec builds
(families.BUILT_MODS), the layout holds two kv tile lists and refuses tiles that do not divide the blocks at the
mask's line, the rendered kernel lists each q tile's nonzero blocks once and walks the list in the producer and
the consumers (no per-element test for the blocks), the API picks tiles that divide the blocks (spec_for prints
them), and the launch path (tests/host_stubs.py) passes block_mask with its broadcast strides and refuses bad
tables by name before any launch."""
from __future__ import annotations

import numpy as np
import pytest

import tiledsl
from tests.host_stubs import stub_device
from tiledsl.codegen.render import render
from tiledsl.dispatch.modified import check_launch, modifications
from tiledsl.dispatch.tuned import TUNED, tuned_spec
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.families import BUILT_MODS, layout_of, lower, missing_template, takes_mods
from tiledsl.frontend.parse import load_specs, parse_text
from tiledsl.layout.hopper import LISTED_TILES, TILE_LIST_BYTES
from tiledsl.mods.model import Documents, Modifications
from tiledsl.spec import DType, Family, KernelSpec, Mask, Problem, SeqLayout


class Shaped:
    """An array stand-in with a shape and a dtype only (spec_for reads no data)."""
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


@pytest.fixture
def device(tmp_path):
    with stub_device(tmp_path) as dev:
        yield dev


def spec(mask="none", d=128, blocks=(128, 128), **mods) -> KernelSpec:
    return KernelSpec("blocks", Problem(d, d, DType.BF16, Mask(mask), mods=Modifications(blocks=blocks, **mods)),
                      TUNED[("sm_90", "bf16", d, mask)])


def test_the_hopper_forward_builds_blocks_and_the_other_templates_refuse_them():
    assert "blocks" in BUILT_MODS[(Family.HOPPER, SeqLayout.BATCHED)]
    assert takes_mods(Family.HOPPER, Modifications(blocks=(128, 128)))
    assert not takes_mods(Family.HOPPER, Modifications(blocks=(128, 128)), SeqLayout.VARLEN)
    assert not takes_mods(Family.DECODE, Modifications(blocks=(128, 128)))
    for s in load_specs("specs/mods/block_sparse_d128.tile"):
        assert missing_template(s) == "", s.name
        assert "list_visible_tiles<C>" in render(lower(s))
        from tiledsl.lower.backward import lower_backward
        assert "mark_visible_steps<C>" in render(lower_backward(s))


def test_layout_holds_two_lists_only_with_blocks():
    with_blocks = layout_of(spec(mask="causal"))
    lists = with_blocks.buffer("kv tile lists")
    assert lists.stages == 2 and lists.stage_bytes == TILE_LIST_BYTES == 16 + 2 * LISTED_TILES
    assert lists.offset % 16 == 0
    plain = KernelSpec("plain", Problem(128, 128, DType.BF16, Mask.CAUSAL), TUNED[("sm_90", "bf16", 128, "causal")])
    assert "kv tile lists" not in [b.name for b in layout_of(plain).buffers]


def test_tiles_that_do_not_divide_the_blocks_are_refused_at_the_mask_line():
    text = ("attention small_blocks {\n    head_dim = 128\n    mask     = blocks(q = 64, kv = 128)\n"
            "    schedule {\n        warpgroups producer 1, consumer 2\n        tile       q = 128, kv = 128\n"
            "    }\n}\n")
    with pytest.raises(SpecError) as err:
        lower(parse_text(text, "small.tile")[0])
    rendered = err.value.render()
    assert "small.tile:3:" in rendered and "must divide the blocks" in rendered and "^" in rendered
    with pytest.raises(SpecError, match="must divide the blocks"):
        lower(spec(blocks=(128, 96)))


def test_rendered_kernel_walks_the_listed_tiles():
    source = render(lower(spec(mask="causal")))
    body = source.split('extern "C"')[1]
    producer, consumer = body.split("registers_increase")
    assert "w.tile_end = list_visible_tiles<C>(block_mask_row<C>(block_mask" in producer
    assert "kv_tile * C::BC, w.kv_head, w.batch" in producer and "tile * C::BC, w.kv_head" not in \
        producer.replace("kv_tile * C::BC, w.kv_head", "")
    assert "w.tile_end = listed_count(tile_list)" in consumer
    # the peeled first trip and the loop
    assert consumer.count("const int kv_tile = listed_tile(tile_list, tile);") == 2
    assert "tile_needs_mask<C>(row0, 64, kv_tile * C::BC" in consumer
    assert "block_mask" not in "\n".join(line.split("//")[0] for line in consumer.splitlines())   # no per-element read
    assert "shared.tile_lists(q_round & 1)" in producer and "shared.tile_lists(q_round & 1)" in consumer
    assert "BLOCK_Q = 128" in source and "BLOCK_KV = 128" in source
    plain = render(lower(KernelSpec("plain", Problem(128, 128, DType.BF16, Mask.CAUSAL),
                                    TUNED[("sm_90", "bf16", 128, "causal")])))
    assert "block_mask" not in plain and "kv_tile" not in plain


def test_consumers_wait_for_q_before_they_read_the_list():
    consumer = render(lower(spec())).split('extern "C"')[1].split("registers_increase")[1]
    wait = consumer.index("mbarrier_wait(bars + C::Q_FULL_BAR * 8, q_round & 1);   // the list comes with Q")
    assert wait < consumer.index("listed_count(tile_list)")
    assert lower(spec()).q_wait == "span"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (256, 64), (384, 256), (128, 48)])
def test_the_api_picks_tiles_that_divide_the_blocks(d, causal, block):
    q = Shaped((2, 4, 4096, d), "bfloat16")
    table = Shaped((1, 1, -(-4096 // block[0]), -(-4096 // block[1])), "bool")
    text = tiledsl.spec_for(q, q, q, causal=causal, block_mask=table, block_size=block)
    assert f"blocks(q = {block[0]}, kv = {block[1]})" in text
    (printed,) = parse_text(text)
    assert block[0] % printed.schedule.tile_q == 0 and block[1] % printed.schedule.tile_kv == 0
    mods = Modifications(blocks=block)
    picked = tuned_spec("sm_90a", DType.BF16, d, Mask.CAUSAL if causal else Mask.NONE, d, None, None, 4096, mods)[0]
    assert printed.kernel_name == picked.kernel_name
    lower(picked)   # builds


def test_keywords_become_the_modification_and_refuse_bad_tables():
    table = np.ones((2, 4, 8, 8), dtype=np.bool_)
    mods, aux = modifications(block_mask=table)
    assert mods == Modifications(blocks=(128, 128)) and aux["block_mask"].dtype == np.int32
    assert modifications(block_mask=table, block_size=(256, 64))[0].blocks == (256, 64)
    assert modifications(block_mask=table, block_size=64)[0].blocks == (64, 64)
    for kwargs, words in ((dict(block_mask=table.astype(np.float32)), "int or bool tensor"),
                          (dict(block_mask=table[0]), "4-d"),
                          (dict(block_mask=table, block_size=100), "multiples of 16"),
                          (dict(block_mask=table, block_size=(128, 128, 1)), "block_size is an int or a"),
                          (dict(block_mask=table, block_size=True), "block_size is an int or a"),
                          (dict(block_size=128), "pass block_mask too")):
        with pytest.raises(RuntimeInputError, match=words):
            modifications(**kwargs)


def test_table_shapes_are_checked_against_the_launch():
    mods = Modifications(blocks=(128, 128))
    for shape in ((2, 4, 8, 8), (1, 4, 8, 8), (2, 1, 8, 8), (1, 1, 8, 8)):
        check_launch(mods, {"block_mask": np.ones(shape, np.int32)}, 2, 4, 1000, 1000)
    for shape in ((2, 4, 7, 8), (2, 4, 8, 7), (3, 4, 8, 8), (2, 2, 8, 8), (2, 4, 8, 9)):
        with pytest.raises(RuntimeInputError, match=r"block_mask must be \(batch or 1, heads or 1, 8, 8\)"):
            check_launch(mods, {"block_mask": np.ones(shape, np.int32)}, 2, 4, 1000, 1000)


def test_api_passes_the_table_with_broadcast_strides(device):
    q, k = device.tensor((2, 4, 1000, 128)), device.tensor((2, 2, 1300, 128))
    for shape, strides in (((2, 4, 8, 11), [352, 88]), ((1, 4, 8, 11), [0, 88]), ((2, 1, 8, 11), [88, 0]),
                           ((1, 1, 8, 11), [0, 0])):
        table = device.index(np.ones(shape, dtype=np.int32))
        tiledsl.attention(q, k, k, block_mask=table)
        name, *_, values = device.last()
        assert "_blk128x128_" in name and values[-4:] == [table.data_ptr(), *strides, 11]
    with pytest.raises(RuntimeInputError, match=r"block_mask must be \(batch or 1, heads or 1, 8, 11\)"):
        tiledsl.attention(q, k, k, block_mask=device.index(np.ones((2, 4, 8, 10), dtype=np.int32)))
    with pytest.raises(RuntimeInputError, match="block_mask must be int32"):
        kernel = tiledsl.compile(tuned_spec("sm_90a", DType.BF16, 128, Mask.NONE, 128, None, None, 1000,
                                            Modifications(blocks=(128, 128)))[0])
        kernel(q, k, k, aux={"block_mask": device.tensor((2, 4, 8, 11), "int64")})


# ---- the warp-specialized backward --------------------------------------------------------------------------

def backward_spec(d=128, mask=Mask.CAUSAL, deterministic=False, blocks=(128, 128), **mods):
    from tiledsl.dispatch.backward import chosen_backward_spec
    return chosen_backward_spec("sm_90a", DType.BF16, d, mask, d, deterministic=deterministic,
                                mods=Modifications(blocks=blocks, **mods))


def test_the_ws_backward_builds_blocks():
    from tiledsl.layout.backward_ws import STEP_BITS, WS_BUILT_MODS, backward_ws_layout
    assert "blocks" in WS_BUILT_MODS
    lay = backward_ws_layout(backward_spec())
    bits = next(b for b in lay.main.buffers if b.name == "step bits")
    assert bits.bytes == 16 + STEP_BITS // 8 and bits.offset % 16 == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_backward_walks_the_marked_steps(deterministic):
    from tiledsl.lower.backward import lower_backward
    source = render(lower_backward(backward_spec(deterministic=deterministic)))
    main = source.split("_main(")[1]
    setup, roles = main.split("    __syncthreads();\n", 1)
    assert "mark_visible_steps<C>(block_mask" in setup and "steps = marked_step_count(shared.step_bits())" in roles
    producer, consumer = roles.split("registers_increase")
    copier, writer = producer.split("dQ_i -> dQ_accum")
    assert "step = next_marked_step(shared.step_bits(), step + 1);" in copier
    assert copier.index("publish_step(shared.step_bits(), slot, step)") < copier.index("mbarrier_arrive_expect_tx(full")
    assert "step = next_marked_step(shared.step_bits(), step + 1);" in writer
    assert ("const int turn = turn_in_row;" in writer) and ("visible_kv_tiles_before<C>" in writer)
    assert "next_marked_step" not in consumer and "const int step = published_step(shared.step_bits(), slot);" in \
        consumer
    # the consumers wait for the slot once, where they read its step
    assert consumer.count("mbarrier_wait(bar_at(bars, C::Q_FULL_BAR + slot), phase);") == 1
    code = "\n".join(line.split("//")[0] for line in consumer.splitlines())
    assert "block_mask" not in code   # no per-element read of the table


def test_deterministic_block_sparse_backward_takes_more_producer_registers():
    from tiledsl.dispatch.backward import ORDERED_BLOCKS_REGS
    b = backward_spec(deterministic=True).backward
    assert (b.producer_regs, b.consumer_regs) == ORDERED_BLOCKS_REGS
    b = backward_spec().backward
    assert (b.producer_regs, b.consumer_regs) == (24, 240)


def test_a_gradient_needs_backward_tiles_that_divide_the_blocks(device):
    from tiledsl.dispatch.backward import modified_backward_refusal
    assert modified_backward_refusal("sm_90a", 128, 128, Modifications(blocks=(128, 128))) == ""
    why = modified_backward_refusal("sm_90a", 64, 64, Modifications(blocks=(64, 64)))
    assert "must divide the blocks" in why
    q = device.tensor((1, 2, 256, 64), requires_grad=True)
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications .blocks.*must divide"):
        tiledsl.attention(q, q, q, block_mask=device.index(np.ones((1, 1, 4, 4), dtype=np.int32)), block_size=64)
    assert len(device.launches) == launches   # refused before the forward ran


def test_an_autograd_step_passes_the_table_to_the_backward(device):
    q, k, v = (device.tensor((2, 4, 300, 128), requires_grad=True) for _ in range(3))
    table = device.index(np.ones((1, 4, 3, 3), dtype=np.int32))
    o = tiledsl.attention(q, k, v, causal=True, block_mask=table)
    assert "_blk128x128_" in device.last()[0]
    dq, dk, dv, *nones = device.backward(o, device.tensor(o.shape))
    assert nones == [None] * 8   # kv_lens, slopes, sinks, document ids and bounds, the table, the aux, the scalars
    main, *_, values = device.last(2)
    assert main.endswith("_main") and "_blk128x128_" in main and values[-4:] == [table.data_ptr(), 0, 9, 3]


def test_the_backward_refuses_more_steps_than_its_bits(device):
    from tiledsl.dispatch.backward import attention_backward
    from tiledsl.layout.backward_ws import STEP_BITS
    q_len = STEP_BITS * 64 // 2 + 64   # d128: 64-query tiles; two query heads per kv head
    q, o = device.tensor((1, 2, q_len, 128)), device.tensor((1, 2, q_len, 128))
    k = device.tensor((1, 1, 256, 128))
    lse = device.tensor((1, 2, q_len), "float32")
    table = device.index(np.ones((1, 1, -(-q_len // 128), 2), dtype=np.int32))
    with pytest.raises(RuntimeInputError, match=f"block_mask: a kv tile walks {STEP_BITS + 2} .* at most {STEP_BITS}"):
        attention_backward(q, k, k, o, lse, o, block_mask=table)


def test_deterministic_dq_refuses_documents_with_blocks_before_anything_runs(device):
    """Ordered dQ's turns: the documents' kernel starts a q tile's semaphore past every kv tile before its first
    document, the writer counts block-visible tiles only; refused in both the backward call and the autograd
    forward (which asks first), and deterministic=False still takes both."""
    from tiledsl.dispatch.backward import attention_backward, modified_backward_refusal
    mods = Modifications(blocks=(128, 128), document=Documents.IDS)
    assert modified_backward_refusal("sm_90a", 128, 128, mods) == ""
    assert "documents or blocks(...), not both" in modified_backward_refusal("sm_90a", 128, 128, mods, True)
    q, o = device.tensor((1, 2, 256, 128)), device.tensor((1, 2, 256, 128))
    lse = device.tensor((1, 2, 256), "float32")
    table, ids = device.index(np.ones((1, 1, 2, 2), dtype=np.int32)), device.index(np.zeros((1, 256), dtype=np.int32))
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match=r"deterministic dQ takes documents or blocks\(\.\.\.\), not both"):
        attention_backward(q, q, q, o, lse, o, deterministic=True, block_mask=table, document_ids=ids)
    qg = device.tensor((1, 2, 256, 128), requires_grad=True)
    with pytest.raises(RuntimeInputError, match="no gradient through the modifications.*not both"):
        tiledsl.attention(qg, qg, qg, deterministic=True, block_mask=table, document_ids=ids)
    assert len(device.launches) == launches   # refused before any kernel ran
    attention_backward(q, q, q, o, lse, o, block_mask=table, document_ids=ids)
    assert len(device.launches) > launches


def _backward_cases() -> list:
    """(d, mask, deterministic, ALiBi and sinks) of the block-sparse backward kernels the API runs. Known spills,
    listed exactly (strict: a fix or a new spill fails): ALiBi with blocks on d64's 128-query consumers, the slope
    read after the step's slot (its q tile is known only then) instead of before the wait (2-8 bytes), except
    causal non-deterministic."""
    spills = pytest.mark.xfail(strict=True, reason="ALiBi with blocks spills on d64's 128-query consumers")
    cases = []
    for d in (64, 128, 256):
        for mask in (Mask.NONE, Mask.CAUSAL):
            for deterministic in (False, True):
                for alibi in (False, True):
                    known = alibi and d == 64 and (deterministic or mask is Mask.CAUSAL)
                    case = (d, mask, deterministic, alibi)
                    cases.append(pytest.param(*case, marks=spills) if known else case)
    return cases


@pytest.mark.skipif(__import__("tiledsl.codegen.nvcc", fromlist=["nvcc_path"]).nvcc_path() is None,
                    reason="nvcc is not on PATH")
@pytest.mark.parametrize("d, mask, deterministic, alibi", _backward_cases())
def test_the_block_sparse_backward_compiles_without_spills(d, mask, deterministic, alibi):
    from tiledsl.codegen import nvcc
    from tiledsl.lower.backward import lower_backward
    from tiledsl.mods.model import AlibiSlopes
    extra = {"alibi": AlibiSlopes.GIVEN, "sinks": True} if alibi else {}
    plan = lower_backward(backward_spec(d, mask, deterministic, **extra))
    res = nvcc.resources(render(plan), plan.kernel_names["main"])
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{plan.kernel_name}\n{res.report}"
