"""The warm launch path without a GPU (tests/host_stubs.py: fake torch tensors, a fake cuLaunchKernel that
records every launch and its parameter values; everything between the public API and the launch is the
real code).

After the first call of a configuration, no call parses DSL, builds a scheduler graph, renders a
template, compiles or encodes a TMA map from scratch: for attention (prefill, decode, FP8 KV),
paged_attention (decode and chunked prefill), varlen_attention, the backward and a training step through
autograd (EagerAttention on tests/host_stubs.py's fake autograd.Function). And the prepared
launch is the right one: each call's own pointers reach the kernel's parameters, a new signature
prepares a new launch, a misaligned tensor is refused by name."""
from __future__ import annotations

import itertools

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


@pytest.mark.parametrize("mods", ["softcap", "sinks", "softcap+sinks"])
def test_paged_attention_with_modifications(device, mods):
    """softcap alone takes no aux tensor (the scales' slots still come first); sinks are read by pointer each call."""
    table, lens, (k_cache, v_cache) = paged_inputs(device)
    sinks = device.tensor((32,), "float32")
    keywords = dict(softcap=30.0) if "softcap" in mods else {}
    keywords |= dict(sinks=sinks) if "sinks" in mods else {}

    def fresh():
        return (device.tensor((3, 1, 32, 128)),)
    call = lambda q: tiledsl.paged_attention(q, k_cache, v_cache, table, lens, **keywords)   # noqa: E731
    cold, hot, (name, *_, values), (q,) = warm(device, call, fresh)
    assert hot == {}
    assert values[0] == q.data_ptr() and {table.data_ptr(), lens.data_ptr()} <= set(values)
    assert (sinks.data_ptr() in values) == ("sinks" in mods)


@pytest.mark.parametrize("q_len", [1, 256], ids=["decode", "prefill"])
def test_a_warm_modified_call_only_launches(device, monkeypatch, q_len):
    """attention with softcap / sinks: the first call of a signature checks the aux tensors and picks the kernel;
    a warm call reads the pointers (the sinks' too) and launches."""
    import tiledsl.dispatch.modified as modified
    checks = []
    real = modified.check_launch
    monkeypatch.setattr(modified, "check_launch", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    sinks = device.tensor((32,), "float32")
    k, v = device.tensor((2, 8, 512, 128)), device.tensor((2, 8, 512, 128))

    def fresh():
        return (device.tensor((2, 32, q_len, 128)),)
    call = lambda q: tiledsl.attention(q, k, v, softcap=30.0, sinks=sinks)   # noqa: E731
    cold, hot, (name, *_, values), (q,) = warm(device, call, fresh)
    assert hot == {} and len(checks) == 1
    assert values[0] == q.data_ptr() and sinks.data_ptr() in values


def test_varlen_attention_with_max_seqlens(device):
    cu = device.index([0, 100, 350, 351])

    def fresh():
        return device.tensor((351, 16, 128)), device.tensor((351, 4, 128)), device.tensor((351, 4, 128))
    call = lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, causal=True)   # noqa: E731
    cold, hot, (name, *_, values), (q, k, v) = warm(device, call, fresh)
    assert hot == {} and "varlen" in name and values[0] == q.data_ptr()


def test_a_varlen_kernel_refuses_bind_and_names_prepare_varlen(device):
    """bind() reads batched arguments; a packed kernel says where its replayable launch comes from."""
    from tiledsl.dispatch.kernels import kernel_for
    from tiledsl.serving.varlen import varlen_spec
    from tiledsl.spec import DType, Mask
    kernel = kernel_for(varlen_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL))
    q, k = device.tensor((351, 16, 128)), device.tensor((351, 4, 128))
    with pytest.raises(RuntimeInputError, match="has no bind\\(\\); prepare_varlen"):
        kernel.bind(q, k, k)


def test_backward(device):
    def fresh():
        q, k, v, o, do = (device.tensor((2, 4, 300, 64)) for _ in range(5))
        return q, k, v, o, device.tensor((2, 4, 300), "float32"), do
    default = lambda *t: tiledsl.attention_backward(*t, causal=True)   # noqa: E731  (warp-specialized on sm_90a)
    assert warm(device, default, fresh)[1] == {}
    assert device.last(2)[0].endswith("tma_reduce_backward_main")
    # the wgmma backward's parameter order (the warp-specialized one's: test_backward_ws_cpu.py)
    call = lambda *t: tiledsl.attention_backward(*t, causal=True, warp_specialized=False)   # noqa: E731
    cold, hot, last, tensors = warm(device, call, fresh)
    assert hot == {}
    q, k, v, o, lse, do = tensors
    (pre, *_, pre_values), (main, *_, main_values), (convert, *_, convert_values) = (device.last(b) for b in (3, 2, 1))
    assert pre.endswith("preprocess") and main.endswith("main") and convert.endswith("convert")
    assert pre_values[:2] == [o.data_ptr(), do.data_ptr()]
    assert main_values[:5] == [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr()]
    assert convert_values[0] == pre_values[3] and convert_values[0] == main_values[6]   # one dQ accumulator


@pytest.mark.parametrize("warp_specialized", [True, False], ids=["ws", "wgmma"])
def test_autograd_step(device, monkeypatch, warp_specialized):
    """A training step through tiledsl.attention (EagerAttention) and its backward: warm steps reach no front
    end, graph, renderer or compiler, and the backward's launches read that step's O, LSE and dO."""
    from tiledsl.dispatch import backward
    monkeypatch.setattr(backward, "BACKWARD_WS", warp_specialized)
    outputs = []

    def fresh():
        return tuple(device.tensor((2, 4, 300, 64), requires_grad=True) for _ in range(3))

    def step(q, k, v):
        o, lse = tiledsl.attention(q, k, v, causal=True, return_lse=True)
        do = device.tensor(o.shape)
        outputs[:] = [o, lse, do, device.backward(o, do)]

    assert warm(device, step, fresh)[1] == {}
    o, lse, do, (dq, dk, dv, *no_grads) = outputs
    assert no_grads == [None, None]   # kv_lens and the scalars
    (pre, *_, pre_values), (main, *_, main_values), (convert, *_, convert_values) = (device.last(b) for b in (3, 2, 1))
    assert pre.endswith("preprocess") and convert.endswith("convert")
    assert main.endswith("tma_reduce_backward_main" if warp_specialized else "wgmma_atomic_backward_main")
    assert pre_values[:2] == [o.data_ptr(), do.data_ptr()]
    if warp_specialized:   # the preprocess copies the LSE into whole q tiles; dK, dV after the five maps
        assert pre_values[2] == lse.data_ptr() and [dk.data_ptr(), dv.data_ptr()] == main_values[9:11]
    else:
        assert main_values[4] == lse.data_ptr() and [dk.data_ptr(), dv.data_ptr()] == main_values[7:9]
    assert convert_values[1] == dq.data_ptr()


def test_the_backward_after_a_forward_takes_that_forwards_shapes(device):
    """EagerAttention's backward finds its launches by the forward's prepared call: two key counts under the
    same queries (so O, the LSE and dO alike), stepped in turn, each get their own main-kernel grid."""
    grids = {}
    for kv_len in (300, 128, 300, 128):
        q = device.tensor((2, 4, 128, 64), requires_grad=True)
        k, v = (device.tensor((2, 4, kv_len, 64), requires_grad=True) for _ in range(2))
        o = tiledsl.attention(q, k, v)
        device.backward(o, device.tensor(o.shape))
        grids.setdefault(kv_len, set()).add(device.last(2)[1])
    assert len(grids[300]) == len(grids[128]) == 1 and grids[300] != grids[128]


@pytest.mark.parametrize("warp_specialized", [True, False], ids=["ws", "wgmma"])
def test_the_backward_takes_its_scratch_in_one_allocation_per_call(device, warp_specialized):
    """The backward's workspace parts (D and dQ_accum; LSE rows too for the warp-specialized one) are one
    allocation per call, each part 256-byte aligned after the one before; dQ, dK, dV are the others."""
    from tiledsl.dispatch import backward
    from tiledsl.runtime.launch import WORKSPACE_ALIGNMENT
    batch, heads, q_len, d = 2, 4, 300, 64
    q, k, v, o, do = (device.tensor((batch, heads, q_len, d)) for _ in range(5))
    lse = device.tensor((batch, heads, q_len), "float32")
    bases = set()
    for _ in range(2):
        tiledsl.attention_backward(q, k, v, o, lse, do, causal=True, warp_specialized=warp_specialized)
        pre = device.last(3)[5]
        parts = pre[3:6] if warp_specialized else pre[2:4]
        tile = backward.BACKWARD_WS_TUNED[d].tile_q
        rows = batch * heads * (-(-q_len // tile) * tile if warp_specialized else q_len)   # whole q tiles (ws)
        sizes = (rows * 4, rows * 4) if warp_specialized else (rows * 4,)
        up = lambda n: -(-n // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT   # noqa: E731
        assert [b - a for a, b in itertools.pairwise(parts)] == [up(n) for n in sizes]
        assert all(p % WORKSPACE_ALIGNMENT == 0 for p in parts)
        bases.add(parts[0])
    assert len(bases) == 2   # each call's own, from the allocator
    assert len(next(reversed(backward._calls.values())).allocations) == 4   # dq, dk, dv, the workspace


@pytest.mark.parametrize("d, dv", [(40, 40), (72, 40), (64, 24)])
def test_head_dims_of_multiples_of_8_run_zero_padded_to_16(device, monkeypatch, d, dv):
    """attention_backward pads a head dim that is a multiple of 8 but not of 16 (dispatch/backward.PaddedBackward):
    the kernels get padded copies, the padded problem keeps the unpadded head dim's softmax scale, the gradients
    come back contiguous in the inputs' shapes, and a warm call reaches no front end or compiler."""
    from tiledsl.dispatch import backward
    from tiledsl.spec import default_softmax_scale
    chosen = []
    real = backward.chosen_backward_spec

    def record(arch, dtype, head_dim, mask, head_dim_v=None, window=None, scale=None, *rest):
        chosen.append((head_dim, head_dim_v, scale))
        return real(arch, dtype, head_dim, mask, head_dim_v, window, scale, *rest)
    monkeypatch.setattr(backward, "chosen_backward_spec", record)

    def fresh():
        q, k = (device.tensor((2, 4, 300, d)) for _ in range(2))
        v, o, do = (device.tensor((2, 4, 300, dv)) for _ in range(3))
        return q, k, v, o, device.tensor((2, 4, 300), "float32"), do
    outputs = []
    call = lambda *t: outputs.append(tiledsl.attention_backward(*t, causal=True))   # noqa: E731
    _, hot, _, (q, k, v, o, lse, do) = warm(device, call, fresh)
    up = lambda n: -(-n // 16) * 16   # noqa: E731
    assert hot == {} and chosen == [(up(d), up(dv), default_softmax_scale(d))]
    for grad, like in zip(outputs[-1], (q, k, v)):
        assert grad.shape == like.shape and grad.stride() == like.stride()
    (*_, pre_values), (main, *_, main_values) = device.last(3), device.last(2)
    assert main.endswith("backward_main") and main_values[4] == lse.data_ptr()   # the mma.sync module's order
    assert not {o.data_ptr(), do.data_ptr()} & set(pre_values[:2]) and v.data_ptr() != main_values[2]
    assert (main_values[:2] == [q.data_ptr(), k.data_ptr()]) == (d % 16 == 0)   # only what needs it is copied
    with pytest.raises(RuntimeInputError, match="head dims must be multiples of 8, got q 36"):
        tiledsl.attention_backward(*(device.tensor((2, 4, 300, 36)) for _ in range(4)), lse,
                                   device.tensor((2, 4, 300, 36)))


def test_a_new_shape_of_a_known_configuration_prepares_without_the_front_end_or_a_graph(device):
    """Serving changes batch and lengths every step: a new signature re-checks and re-packs, but the
    kernel (and, for paged calls, the decode spec's pick) is found, not rebuilt."""
    table, lens, (k_cache, v_cache) = paged_inputs(device)
    calls = [lambda b, n: tiledsl.attention(device.tensor((b, 8, n, 128)), device.tensor((b, 8, n, 128)),
                                            device.tensor((b, 8, n, 128)), causal=True),
             lambda b, n: tiledsl.attention(device.tensor((b, 32, 1, 128)), device.tensor((b, 8, n, 128)),
                                            device.tensor((b, 8, n, 128))),
             lambda b, n: tiledsl.paged_attention(device.tensor((b, 1, 32, 128)), k_cache, v_cache, table[:b],
                                                  lens[:b], validate=False)]
    for call in calls:
        call(2, 256)
    device.counts.clear()
    for call in calls:
        call(3, 512)
    assert guarded_calls(device) == {}


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


# ---- plan / run ---------------------------------------------------------------------------------------------

def planned(device, q_len=1, **options):
    decode = tiledsl.PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=24,
                                    dtype="bfloat16", device=device.torch.device("cuda", 0), max_batch=4,
                                    max_pages=8, **options)
    table = np.arange(24, dtype=np.int32).reshape(3, 8)[:, ::-1].copy()
    lens = np.array([128, 100, 1], np.int32)
    return decode, table, lens


@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "chunked-prefill"])
def test_plan_uploads_once_and_run_reads_the_uploaded_metadata_without_allocating(device, q_len, monkeypatch):
    decode, table, lens = planned(device, causal=True)
    k_cache, v_cache = device.tensor((24, 16, 8, 128)), device.tensor((24, 16, 8, 128))
    copies = []
    real_copy = type(decode.metadata.device).copy_
    monkeypatch.setattr(type(decode.metadata.device), "copy_", lambda self, src, non_blocking=False: (
        copies.append(non_blocking), real_copy(self, src, non_blocking))[1])
    decode.plan(table, lens, q_len=q_len)
    assert copies == [True]                                          # one non-blocking copy
    assert (decode.metadata.device.host[:3] == lens).all() and (decode.metadata.device.host[4:28] == table.ravel()).all()
    q, out = device.tensor((3, q_len, 32, 128)), device.tensor((3, q_len, 32, 128))
    assert decode.run(q, k_cache, v_cache, out=out) is out           # the first run prepares
    made = []
    real_empty = device.torch.empty
    monkeypatch.setattr(device.torch, "empty", lambda *a, **kw: made.append(a) or real_empty(*a, **kw))
    device.counts.clear()
    for layer in range(3):
        q, out = device.tensor((3, q_len, 32, 128)), device.tensor((3, q_len, 32, 128))
        decode.run(q, k_cache, v_cache, out=out)
        name, grid, threads, smem, stream, values = device.last()
        assert values[0] == q.data_ptr() and out.data_ptr() in values
        assert decode.metadata.device.data_ptr() in values          # kv_lens: the wrapper's buffer, first
    assert made == [] and guarded_calls(device) == {}
    decode.plan(table[::-1].copy(), lens[::-1].copy(), q_len=q_len)  # the next step: same shapes, new contents
    decode.run(q, k_cache, v_cache, out=out)
    assert made == [] and (decode.metadata.device.host[:3] == lens[::-1]).all()


def test_plan_checks_the_host_metadata_by_name(device):
    decode, table, lens = planned(device)
    bad = table.copy()
    bad[2, 0] = 24
    with pytest.raises(RuntimeInputError, match=r"block_table\[2, 0\] = 24 is out of range"):
        decode.plan(bad, lens)
    with pytest.raises(RuntimeInputError, match=r"kv_lens\[1\] = 129 is over the cache"):
        decode.plan(table, np.array([1, 129, 1], np.int32))
    with pytest.raises(RuntimeInputError, match="reading a GPU tensor would sync"):
        decode.plan(device.index(table), lens)
    with pytest.raises(RuntimeInputError, match="call plan"):
        decode.run(device.tensor((3, 1, 32, 128)), device.tensor((24, 16, 8, 128)), device.tensor((24, 16, 8, 128)))
    decode.plan(table, lens)
    with pytest.raises(RuntimeInputError, match="k_cache holds 20 pages"):
        decode.run(device.tensor((3, 1, 32, 128)), device.tensor((20, 16, 8, 128)), device.tensor((20, 16, 8, 128)))


def test_planned_decode_splits_for_the_longest_sequence_not_the_table(device):
    decode, table, lens = planned(device)
    q, cache = device.tensor((3, 1, 32, 128)), device.tensor((24, 16, 8, 128))
    decode.plan(table, np.array([4, 2, 1], np.int32))
    decode.run(q, cache, cache)
    short = device.last()[1]
    decode.plan(table, lens, max_kv_len=128)
    decode.run(q, cache, cache)
    assert short[0] <= device.last()[1][0]


def test_varlen_plan_and_run(device):
    varlen = tiledsl.VarlenAttention(num_heads=16, num_kv_heads=4, head_dim=128, dtype="bfloat16",
                                     device=device.torch.device("cuda", 0), max_batch=4, causal=True)
    cu = np.array([0, 100, 350, 351], np.int32)
    varlen.plan(cu, cu)
    for _ in range(2):
        q, k, out = device.tensor((351, 16, 128)), device.tensor((351, 4, 128)), device.tensor((351, 16, 128))
        assert varlen.run(q, k, k, out=out) is out
        assert device.last()[5][0] == q.data_ptr() and out.data_ptr() in device.last()[5]
    with pytest.raises(RuntimeInputError, match=r"cu_seqlens_q is not non-decreasing"):
        varlen.plan(np.array([0, 100, 50, 351], np.int32), cu)


# ---- the kernels' error word ---------------------------------------------------------------------------------

def test_a_reported_bad_entry_is_raised_once_naming_the_tensor_and_the_entry(device, monkeypatch):
    from tiledsl.runtime import device_errors
    host = np.zeros(device_errors.WORDS, np.int32)
    monkeypatch.setitem(device_errors._words, 0, (host, host))
    assert device_errors.take(0) is None
    host[:6] = [1, 1, 2, 7, 999, 24]    # block_table[2, 7] = 999, the cache has 24 pages
    with pytest.raises(RuntimeInputError, match=r"block_table\[2, 7\] = 999 is out of range: the cache has 24 pages "
                                                r"\(0\.\.23\).*NaN"):
        tiledsl.check_errors(0)
    assert (host == 0).all() and device_errors.take(0) is None   # raised once, then cleared
    host[:6] = [2, 2, 1, 0, 4097, 4096]
    with pytest.raises(RuntimeInputError, match=r"kv_lens\[1\] = 4097 is over the cache: block_table gives each "
                                                r"sequence 4096 keys"):
        device_errors.raise_pending(0)
    host[:6] = [4, 2, 0, 0, 5000, 4096]
    assert "kv_lens[0] = 5000 is over the 4096 keys k holds" in str(device_errors.take(0))


def test_long_calls_take_the_long_bucket_and_short_ones_keep_the_table(device):
    """d64 from LONG_KV keys on runs TUNED_LONG's 192 x 192 tiles; shorter key counts keep TUNED's; decode never."""
    from tiledsl.dispatch.tuned import LONG_KV
    for n, tile_kv in ((LONG_KV - 1, "kv128"), (LONG_KV, "kv192")):
        q = device.tensor((1, 2, 300, 64))
        tiledsl.attention(q, device.tensor((1, 2, n, 64)), device.tensor((1, 2, n, 64)), causal=True)
        assert f"q192_{tile_kv}_" in device.last()[0], (n, device.last()[0])
    tiledsl.attention(device.tensor((1, 2, 1, 64)), device.tensor((1, 2, 4096, 64)), device.tensor((1, 2, 4096, 64)))
    assert device.last()[0].startswith("decode_")


def test_attention_fp8_prefill_descales(device):
    def fresh():
        return tuple(device.tensor((1, 2, 300, 128), "float8_e4m3fn") for _ in range(3))
    descales = {name: device.tensor((1, 2), "float32") for name in ("q_descale", "k_descale", "v_descale")}
    cold, hot, (name, *_, values), (q, k, v) = warm(device, lambda *t: tiledsl.attention(*t, **descales), fresh)
    assert hot == {} and "e4m3" in name
    assert {d.data_ptr() for d in descales.values()} <= set(values)
    # a descale of another dtype is refused by the descale rule, before the tensor view (which knows no float64)
    for dtype in ("float64", "bfloat16"):
        with pytest.raises(RuntimeInputError, match=f"v_descale must be float32, got {dtype}"):
            tiledsl.attention(q, k, v, **{**descales, "v_descale": device.tensor((1, 2), dtype)})


def test_a_size_one_dimension_may_carry_any_stride():
    from tiledsl.runtime.launch import is_compact
    assert is_compact((1, 18), (0, 1)) and is_compact((1, 18), (18, 1)) and is_compact((2, 1, 3), (3, 99, 1))
    assert not is_compact((2, 18), (0, 1)) and not is_compact((2, 3), (1, 2))


def test_varlen_attention_fp8_passes_its_descales_and_writes_out_dtype(device):
    cu = device.index([0, 100, 350, 351])
    descales = {name: device.tensor((3, 4), "float32") for name in ("q_descale", "k_descale", "v_descale")}

    def fresh():
        return tuple(device.tensor((351, h, 128), "float8_e4m3fn") for h in (16, 4, 4))
    call = lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, causal=True,   # noqa: E731
                                                    out_dtype="float16", **descales)
    cold, hot, (name, *_, values), (q, k, v) = warm(device, call, fresh)
    assert hot == {} and "varlen" in name and "e4m3" in name and "ofp16" in name
    assert values[0] == q.data_ptr() and values[-3:] == [d.data_ptr() for d in descales.values()]
    assert str(call(q, k, v).dtype).endswith("float16")
    with pytest.raises(RuntimeInputError, match=r"k_descale must have shape \(sequences, kv_heads\) = \(3, 4\)"):
        tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, **{**descales, "k_descale": device.tensor((2, 4),
                                                                                                      "float32")})


def test_planned_varlen_fp8_run_takes_the_layers_descales(device):
    varlen = tiledsl.VarlenAttention(num_heads=16, num_kv_heads=4, head_dim=128, dtype="float8_e4m3fn",
                                     device=device.torch.device("cuda", 0), max_batch=4, causal=True,
                                     descale="per_tensor")
    cu = np.array([0, 100, 350, 351], np.int32)
    varlen.plan(cu, cu)
    q, k = device.tensor((351, 16, 128), "float8_e4m3fn"), device.tensor((351, 4, 128), "float8_e4m3fn")
    scales = [device.tensor((1,), "float32") for _ in range(3)]
    out = varlen.run(q, k, k, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    name, *_, values = device.last()
    assert "varlen_dst" in name and values[-3:] == [s.data_ptr() for s in scales]
    assert str(out.dtype).endswith("bfloat16")
    with pytest.raises(RuntimeInputError, match="descale is 'per_head'"):
        tiledsl.VarlenAttention(num_heads=16, num_kv_heads=4, head_dim=128, dtype="float8_e4m3fn", device="cuda",
                                max_batch=4, descale="per_block")
    with pytest.raises(RuntimeInputError, match="for FP8 attention"):
        tiledsl.VarlenAttention(num_heads=16, num_kv_heads=4, head_dim=128, dtype="bfloat16", device="cuda",
                                max_batch=4, out_dtype="float16")
