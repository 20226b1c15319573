"""The warm launch path without a GPU (tests/host_stubs.py: fake torch tensors, a fake cuLaunchKernel that
records every launch and its parameter values; everything between the public API and the launch is the
real code).

After the first call of a configuration, no call parses DSL, builds a scheduler graph, renders a
template, compiles or encodes a TMA map from scratch: for attention (prefill, decode, FP8 KV),
paged_attention (decode and chunked prefill), varlen_attention and the backward. And the prepared
launch is the right one: each call's own pointers reach the kernel's parameters, a new signature
prepares a new launch, a misaligned tensor is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import tiledsl
from tests.host_stubs import stub_device
from tiledsl.errors import RuntimeInputError

GUARDED = ("parse_text", "load_specs", "parse_file", "build_graph", "render", "compile_cubin", "cached_cubin")


@pytest.fixture
def device(tmp_path):
    counts: dict = {}
    with stub_device(tmp_path, counts) as dev:
        dev.counts = counts
        yield dev


def guarded_calls(dev) -> dict:
    return {name: n for name, n in dev.counts.items() if name in GUARDED and n}


def warm(dev, call, fresh):
    """Run `call(*fresh())` once cold, then twice on fresh tensors of the same signature: (the cold
    call's guarded entry-point counts, the warm calls' counts, the last launch, the last tensors)."""
    call(*fresh())
    cold = guarded_calls(dev)
    assert cold, "the first call should have built its kernel"
    dev.counts.clear()
    for _ in range(2):
        tensors = fresh()
        launches = len(dev.launches)
        call(*tensors)
        assert len(dev.launches) > launches, "a warm call launched nothing"
    return cold, guarded_calls(dev), dev.last(), tensors


def addresses(*tensors):
    return {t.data_ptr() for t in tensors if t is not None}


# ---- the warm path reaches no front end, graph, renderer or compiler ---------------------------------------

@pytest.mark.parametrize("d, dtype", [(64, "bfloat16"), (128, "float16"), (96, "bfloat16")],
                         ids=["hopper-d64", "hopper-d128", "fa2-d96"])
def test_attention_prefill(device, d, dtype):
    def fresh():
        return (device.tensor((2, 8, 200, d), dtype), device.tensor((2, 2, 300, d), dtype),
                device.tensor((2, 2, 300, d), dtype))
    cold, hot, (name, *_, values), (q, k, v) = warm(device, lambda *t: tiledsl.attention(*t, causal=True), fresh)
    assert hot == {}
    if d == 96:   # pointers as plain parameters: q, k, v are the first three
        assert values[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    else:         # TMA maps: each map's address word is rewritten for the new tensor
        assert "encode" not in device.counts
        assert values[0] == q.data_ptr()


def test_attention_decode_and_kv_lens(device):
    lens = device.index([100, 3000])

    def fresh():
        return device.tensor((2, 32, 1, 128)), device.tensor((2, 8, 4096, 128)), device.tensor((2, 8, 4096, 128))
    cold, hot, (name, grid, *_, values), (q, k, v) = warm(
        device, lambda *t: tiledsl.attention(*t, kv_lens=lens, validate=False), fresh)
    assert hot == {} and name.startswith("decode_") and grid[0] > 1   # split-KV
    assert values[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()] and lens.data_ptr() in values


def test_attention_fp8_kv(device):
    def fresh():
        return (device.tensor((2, 32, 1, 128)), device.tensor((2, 8, 2048, 128), "float8_e4m3fn"),
                device.tensor((2, 8, 2048, 128), "float8_e4m3fn"))
    scale = device.tensor((8,), "float32")
    cold, hot, (name, *_, values), (q, k, v) = warm(
        device, lambda *t: tiledsl.attention(*t, k_scale=scale, v_scale=0.5), fresh)
    assert hot == {} and ("e4m3" in name or "fp8" in name)
    assert values[:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()] and scale.data_ptr() in values


def paged_inputs(device, batch=3, q_len=1, pages_per_seq=8, page=16):
    table = device.index(np.arange(batch * pages_per_seq).reshape(batch, pages_per_seq))
    lens = device.index([pages_per_seq * page - 5 * b for b in range(batch)])
    caches = [device.tensor((batch * pages_per_seq, page, 8, 128)) for _ in range(2)]
    return table, lens, caches


@pytest.mark.parametrize("q_len", [1, 4, 64], ids=["decode", "decode-4", "chunked-prefill"])
def test_paged_attention(device, q_len):
    table, lens, (k_cache, v_cache) = paged_inputs(device)

    def fresh():
        return (device.tensor((3, q_len, 32, 128)),)
    call = lambda q: tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=True)   # noqa: E731
    cold, hot, (name, *_, values), (q,) = warm(device, call, fresh)
    assert hot == {}
    assert values[0] == q.data_ptr() and {table.data_ptr(), lens.data_ptr()} <= set(values)


def test_varlen_attention_with_max_seqlens(device):
    cu = device.index([0, 100, 350, 351])

    def fresh():
        return device.tensor((351, 16, 128)), device.tensor((351, 4, 128)), device.tensor((351, 4, 128))
    call = lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, causal=True)   # noqa: E731
    cold, hot, (name, *_, values), (q, k, v) = warm(device, call, fresh)
    assert hot == {} and "varlen" in name and values[0] == q.data_ptr()


def test_backward(device):
    def fresh():
        q, k, v, o, do = (device.tensor((2, 4, 300, 64)) for _ in range(5))
        return q, k, v, o, device.tensor((2, 4, 300), "float32"), do
    call = lambda *t: tiledsl.attention_backward(*t, causal=True)   # noqa: E731
    cold, hot, last, tensors = warm(device, call, fresh)
    assert hot == {}
    q, k, v, o, lse, do = tensors
    (pre, *_, pre_values), (main, *_, main_values), (convert, *_, convert_values) = (device.last(b) for b in (3, 2, 1))
    assert pre.endswith("preprocess") and main.endswith("main") and convert.endswith("convert")
    assert pre_values[:2] == [o.data_ptr(), do.data_ptr()]
    assert main_values[:5] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr()]
    assert convert_values[0] == pre_values[3] and convert_values[0] == main_values[6]   # one dQ accumulator


# ---- the prepared launch is the call's own ---------------------------------------------------------------

def test_a_new_signature_prepares_a_new_launch_and_each_call_gets_its_outputs(device):
    q, k = device.tensor((1, 8, 128, 64)), device.tensor((1, 8, 128, 64))
    o1 = tiledsl.attention(q, k, k)
    o2 = tiledsl.attention(q, k, k)
    assert o1.data_ptr() != o2.data_ptr() and device.last()[5][3] == o2.data_ptr()   # out is the 4th parameter
    longer = device.tensor((1, 8, 256, 64))
    tiledsl.attention(longer, k, k)
    grid_long = device.last()[1]
    tiledsl.attention(q, k, k)
    assert grid_long != device.last()[1]


def test_a_misaligned_tensor_is_refused_on_the_warm_path(device):
    q, k = device.tensor((1, 8, 128, 96)), device.tensor((1, 8, 128, 96))
    tiledsl.attention(q, k, k)
    shifted = device.tensor((1, 8, 128, 96))
    shifted._address += 8
    with pytest.raises(RuntimeInputError, match="q must start at a 16-byte aligned address"):
        tiledsl.attention(shifted, k, k)


def test_host_validation_reads_the_indices_and_refuses_a_bad_one(device):
    table, lens, (k_cache, v_cache) = paged_inputs(device)
    q = device.tensor((3, 1, 32, 128))
    tiledsl.paged_attention(q, k_cache, v_cache, table, lens, validate=True)
    bad = device.index(np.where(np.arange(24).reshape(3, 8) == 13, 999, np.arange(24).reshape(3, 8)))
    with pytest.raises(RuntimeInputError, match=r"block_table\[1, 5\] = 999 is out of range"):
        tiledsl.paged_attention(q, k_cache, v_cache, bad, lens, validate=True)
    tiledsl.paged_attention(q, k_cache, v_cache, bad, lens, validate=False)   # not read on the host: launched

