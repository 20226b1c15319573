"""The warp-specialized backward on the CPU: the `backward { warpgroups ... }` statements and their refusals at
the backward line, the layout (buffers on swizzle atoms, the kv-tile split, the dQ path, what does not fit), the
roles and barriers of the backward graph against the kernel's (arrival counts = the roles that arrive, transaction
bytes = the boxes the producer copies), the plan's consumer order, the runtime's launch arguments against the
kernel signatures, the dispatch switch, and with nvcc: the PTX instructions and no spills at 240 registers for
the bundled specs and every schedule attention_backward can pick."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.dispatch import backward as dispatch
from tiledsl.dispatch.backward import BACKWARD_WS_DETERMINISTIC, BACKWARD_WS_TUNED, chosen_backward_spec, ws_refusal
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.frontend.parse import load_spec, parse_text
from tiledsl.hw import SWIZZLE_ATOM
from tiledsl.layout.backward import backward_has_template, backward_layout
from tiledsl.lower.backward import lower_backward
from tiledsl.lower.backward_ws import CONSUMER_ORDER, DQ_OUT
from tiledsl.reference.backward import reference_backward
from tiledsl.runtime.kernel import Kernel
from tiledsl.runtime.launch import address_arg
from tiledsl.schedule.backward import build_backward_graph
from tiledsl.schedule.ops import OpKind, Role
from tiledsl.schedule.passes import emission_order
from tiledsl.spec import DqAccumulate, DType, Mask

from .test_backward_kernel_cpu import BACKWARD_SPECS, kernel
from .test_backward_reference import analytic_grads, assert_close

WS = "warpgroups producer 1 regs 24, consumer 2 regs 240"
WS_SPECS = [s for s in BACKWARD_SPECS if s.backward.warp_specialized]
THREADS = {"producer": 32, "consumer": 256}   # threads of a role that run one arrive op (lane 0 per warp: below)


def ws(tile_q=64, tile_kv=128, head_dim=128, stages=2, dq="tma_reduce", mask="causal", extra=""):
    return load_spec(kernel(f"tile q = {tile_q}, kv = {tile_kv}; {WS}; pipeline {stages} stages via tma; "
                            f"dq accumulate {dq}{extra}", head_dim, mask))


CONFIGS = [(64, 128, 128, 2, "tma_reduce"), (64, 128, 128, 2, "atomic"), (64, 128, 128, 2, "ordered"),
           (128, 128, 64, 2, "tma_reduce"), (128, 128, 64, 2, "ordered"), (64, 64, 256, 2, "atomic"),
           (64, 64, 256, 1, "tma_reduce"), (64, 64, 256, 1, "ordered")]


def test_bundled_ws_specs_exist_for_d64_d128_d256():
    assert sorted(s.problem.head_dim_qk for s in WS_SPECS) == [64, 128, 256]


def test_statements_set_the_family_and_name_it():
    spec = ws()
    b = spec.backward
    assert b.warp_specialized and (b.producer_regs, b.consumer_regs, b.warps) == (24, 240, 8)
    assert b.copy.value == "tma" and b.mma.value == "wgmma" and not backward_has_template(spec)
    assert spec.kernel_name.endswith("_bwd_kvq_q64_kv128_p1r24_c2r240_s2tma_tma_reduce")
    assert spec.config()["backward"]["consumer_warpgroups"] == 2
    defaults = load_spec(kernel("warpgroups producer 1, consumer 2; pipeline 2 stages"))
    assert defaults.backward.consumer_regs == 240 and defaults.backward.copy.value == "tma"
    plain = load_spec(kernel("tile q = 64, kv = 128; warps 8"))
    assert "consumer_warpgroups" not in plain.config()["backward"]   # unspecialized hashes keep their config


@pytest.mark.parametrize("backward,message,hint", [
    (f"order q, kv; {WS}", "kv outer", "order kv, q"),
    (f"mma mma.sync; {WS}", "runs on wgmma", "mma wgmma"),
    (f"pipeline 2 stages via cp.async; {WS}", "copies with TMA", "via tma"),
    (f"warps 16; {WS}", "warps follow the warpgroups", "remove `warps`"),
    (f"dq accumulate separate; {WS}", "mma.sync backward's q-outer dQ kernel", "ordered"),
    ("pipeline 2 stages via tma", "only when warp-specialized", "warpgroups"),
    ("dq accumulate tma_reduce", "dQ writer warp", "warpgroups"),
    ("warpgroups producer 1 regs 24, consumer 2 regs 256", "registers", "regs 240"),
    ("warpgroups producer 1, consumer 3", "producer 1, consumer 2", "consumer 2 regs 240"),
    (f"tile q = 64, kv = 96; {WS}", "tile kv = 96", "tile kv = 128"),
    (f"tile q = 128, kv = 64; {WS}", "tile q = 128", "tile q = 64"),
])
def test_refusals_name_the_backward_line(backward, message, hint):
    with pytest.raises(SpecError) as err:
        parse_text(kernel(backward), "k.tile")
    assert message in err.value.message and hint in (err.value.hint or ""), (err.value.message, err.value.hint)
    assert err.value.span.line >= 9   # inside the backward block


def test_head_dims_and_sizes_the_layout_refuses():
    with pytest.raises(SpecError, match="multiples of 64"):
        ws(head_dim=96)
    with pytest.raises(SpecError, match="multiples of 128"):
        ws(tile_kv=64, head_dim=192)
    with pytest.raises(SpecError, match="whole 64-column panels of K"):
        ws(tile_q=64, head_dim=64)
    with pytest.raises(SpecError, match="does not fit beside the ring") as err:
        ws(tile_kv=64, head_dim=256, stages=2, dq="ordered")
    assert "pipeline 1 stage" in err.value.hint
    with pytest.raises(SpecError, match="shared memory"):
        ws(tile_q=128, head_dim=64, stages=4)


@pytest.mark.parametrize("tile_q,tile_kv,head_dim,stages,dq", CONFIGS)
def test_layout_buffers_split_and_dq_path(tile_q, tile_kv, head_dim, stages, dq):
    lay = backward_layout(ws(tile_q, tile_kv, head_dim, stages, dq))
    assert lay.split == ("keys" if tile_kv == 128 else "columns")
    assert lay.dq_split == ("m" if tile_q == 128 else "n")
    staged = lay.dq_path != "consumer_red"
    assert lay.dq_path == ("writer_tma" if dq != "atomic" else "writer_red" if staged else "consumer_red")
    assert (head_dim, stages, dq) != (256, 2, "atomic") or not staged   # no staging beside a 2-slot d256 ring
    names = [b.name for b in lay.main.buffers]
    assert names[:4] == ["K", "V", "Q", "dO"] and ("P^T" in names) == (lay.split == "columns")
    assert ("dQ_i staging" in names) == staged and names[-1] == "mbarriers"
    for b in lay.main.buffers:
        if b.name not in ("LSE", "D", "mbarriers"):
            assert b.offset % SWIZZLE_ATOM == 0 and (b.stage_bytes or b.bytes) % SWIZZLE_ATOM == 0, b
    ends = sorted((b.offset, b.offset + b.bytes) for b in lay.main.buffers)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "buffers overlap"
    assert lay.main.smem_bytes == ends[-1][1] <= lay.main.smem_limit
    assert lay.role_peaks["consumer"] <= 240 and lay.main.threads == 384


def _arrivals(graph, name: str, lay) -> int:
    """Arrivals one phase of barrier `name` gets: the threads of the roles whose arrive ops name it (the
    consumers' q_empty arrive is one lane per warp: the template's `if (lane == 0)`)."""
    total = 0
    for n in graph.names(OpKind.ARRIVE):
        op = graph.op(n)
        if op.barrier != name:
            continue
        threads = lay.roles[op.role.value]["threads"]
        total += threads // 32 if name == "q_empty" else 1 if op.role is Role.PRODUCER else threads
    return total


@pytest.mark.parametrize("tile_q,tile_kv,head_dim,stages,dq", CONFIGS)
def test_barrier_balance(tile_q, tile_kv, head_dim, stages, dq):
    """Every mbarrier is initialised with the arrivals its arrive ops deliver per phase, and a full barrier's
    expected bytes are the boxes and bulk copies the producer issues on it (box rows x 128-byte panel rows)."""
    spec = ws(tile_q, tile_kv, head_dim, stages, dq)
    lay, graph, plan = backward_layout(spec), build_backward_graph(spec), lower_backward(spec)
    consts = {c.name: c.value for c in plan.constants}
    init = {"kv_full": 1, "q_full": 1, "q_empty": consts["Q_EMPTY_ARRIVALS"], "dq_full": consts["DQ_FULL_ARRIVALS"],
            "dq_empty": consts["DQ_EMPTY_ARRIVALS"]}
    for b in graph.barriers.values():
        if b.kind == "named":
            assert b.count == consts["CONSUMER_THREADS"] == lay.roles["consumer"]["threads"]
            continue
        assert init[b.name] == b.count == _arrivals(graph, b.name, lay), b
        assert b.arrive and b.wait
    copies = {}
    for c in plan.copies:
        copies[c.barrier] = copies.get(c.barrier, 0) + c.count * c.bytes
    rows = plan.box_rows
    d, dv = spec.problem.head_dim_qk, spec.problem.head_dim_v
    assert copies["kv_full"] == (d + dv) // 64 * rows["k"] * 128 == consts["KV_BYTES"] == graph.barriers[
        "kv_full"].tx_bytes
    assert copies["q_full"] == (d + dv) // 64 * rows["q"] * 128 + 2 * tile_q * 4 == consts["Q_TX_BYTES"] == \
        graph.barriers["q_full"].tx_bytes
    assert set(graph.barriers) == {"kv_full", "q_full", "q_empty", "ds_ready"} | (
        {"dq_full", "dq_empty"} if lay.staging else set())
    assert consts["STAGING"] == lay.staging and consts["STAGES"] == stages


@pytest.mark.parametrize("tile_q,tile_kv,head_dim,stages,dq", CONFIGS)
def test_consumer_loop_is_the_graphs_emission_order(tile_q, tile_kv, head_dim, stages, dq):
    spec = ws(tile_q, tile_kv, head_dim, stages, dq)
    plan, graph = lower_backward(spec), build_backward_graph(spec)
    order = [n for n in emission_order(graph) if graph.op(n).loops[-1:] == ("loop_q",)]
    consumer = [n for n in order if graph.op(n).role is Role.CONSUMER]
    assert [op.node for op in plan.loop_body] == consumer
    assert tuple(consumer) == CONSUMER_ORDER[plan.split] + DQ_OUT[plan.dq_path != "consumer_red"]
    roles = {graph.op(n).role for n in order}
    assert roles == {Role.PRODUCER, Role.CONSUMER} | ({Role.WRITER} if plan.staging else set())
    loads = [n for n in order if graph.op(n).kind in (OpKind.LOAD_Q, OpKind.LOAD_DO, OpKind.LOAD_LSE_D)]
    assert loads and all(graph.op(n).role is Role.PRODUCER and graph.op(n).via == "tma" for n in loads)
    waits = {graph.op(n).variant: graph.op(n).pending for n in consumer if graph.op(n).kind is OpKind.MMA_WAIT}
    assert waits == {"S": 1, "dP": 0, "grads": 0}   # dP^T stays in flight while S^T is masked and P^T computed


@pytest.mark.parametrize("mask", [Mask.NONE, Mask.CAUSAL, Mask.WINDOW])
def test_the_reference_runs_the_ws_graph_exactly(mask):
    from tiledsl.spec import BackwardSchedule, KernelSpec, Problem, Schedule
    b = replace(BACKWARD_WS_TUNED[128], dq=DqAccumulate.ORDERED)
    spec = KernelSpec("bwd", Problem(8, 8, mask=mask, window_left=3, window_right=1) if mask is Mask.WINDOW
                      else Problem(8, 8, mask=mask), Schedule(), backward=b)
    assert isinstance(b, BackwardSchedule) and build_backward_graph(spec).barriers == {}   # d8: no layout, math ops
    rng = np.random.default_rng(11)
    q, k, v, do = (rng.normal(size=s) for s in ((2, 4, 150, 8), (2, 2, 190, 8), (2, 2, 190, 8), (2, 4, 150, 8)))
    p = spec.problem
    assert_close(reference_backward(spec, q, k, v, do),
                 analytic_grads(q, k, v, do, p.mask, p.window_left, p.window_right, p.scale))
    spec = load_spec("specs/backward_ws_d64.tile")   # with its roles and barriers
    q, k, v, do = (rng.normal(size=s) for s in ((1, 2, 77, 64), (1, 1, 130, 64), (1, 1, 130, 64), (1, 2, 77, 64)))
    assert build_backward_graph(spec).barriers
    assert_close(reference_backward(spec, q, k, v, do), analytic_grads(q, k, v, do, Mask.CAUSAL, 0, 0, 64 ** -0.5))


def _first_kv_tile(q_tile, diag, br, bc, left):   # templates/backward_ws.cu.j2's first_kv_tile (window mask)
    key = q_tile * br + diag - left
    return key // bc if key > 0 else 0


def _visits(k0, q_len, seq_kv, br, bc, mask, left, right):   # the template's q_range region
    diag = seq_kv - q_len
    q_lo, q_hi = 0, (q_len if k0 < seq_kv else 0)
    if mask == "causal":
        q_lo = max(q_lo, k0 - diag)
    if mask == "window":
        q_lo, q_hi = max(q_lo, k0 - diag - right), min(q_hi, k0 + bc - diag + left)
    begin = q_lo // br
    tiles = (q_hi + br - 1) // br - begin if q_hi > q_lo else 0
    return set(range(begin, begin + tiles))


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_ordered_turns_count_the_kv_tiles_before(mask):
    """`ordered`: kv tile j adds to q tile i when the semaphore reads j - first_kv_tile(i); the kv tiles that
    visit a q tile must be contiguous from first_kv_tile, so every turn comes (no deadlock) exactly once."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        br, bc = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        q_len, kv_len = int(rng.integers(1, 900)), int(rng.integers(1, 900))
        seq_kv = int(rng.integers(0, kv_len + 1))
        left, right = int(rng.integers(0, 300)), int(rng.integers(0, 300))
        by_q: dict[int, list[int]] = {}
        for j in range(-(-kv_len // bc)):
            for i in _visits(j * bc, q_len, seq_kv, br, bc, mask, left, right):
                by_q.setdefault(i, []).append(j)
        for i, js in by_q.items():
            first = _first_kv_tile(i, seq_kv - q_len, br, bc, left) if mask == "window" else 0
            assert js == list(range(first, first + len(js))), (mask, br, bc, q_len, seq_kv, left, right, i, js)


def test_source_spells_the_roles_instructions():
    plan = lower_backward(ws(dq="ordered"))
    source = render(plan)
    main = source.split("// ---- main")[1].split("// ---- convert")[0]
    for text in ("registers_decrease<C::PRODUCER_REGS>", "registers_increase<C::CONSUMER_REGS>", "tma_load_4d(",
                 "bulk_load(", "tma_reduce_add_4d(", "load_acquire(semaphore)", "add_release(semaphore, 1)",
                 "named_barrier_sync(C::DS_BAR", "blockIdx.x % pairs"):
        assert text in main, text
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group" in source
    assert "mma_16816" not in main and "cp_async_16(" not in main and "ldmatrix" not in main
    red = render(lower_backward(ws(dq="atomic")))
    assert "WRITER_TMA = false" in red and "WRITER_THREADS = 96" in red


ERROR_WORD = address_arg(0x7000)   # the error word's stand-in (runtime/device_errors.py allocates the real one)


def _launch_args(spec, q_len=200, kv_len=333, heads=4, kv_heads=2, monkeypatch=None):
    """The launches WsBackwardKernel.build_call records, with the GPU parts (views, maps, functions) stood in for."""
    from tiledsl.runtime import backward_ws as runtime
    from tiledsl.runtime.backward import compile_backward
    from tiledsl.runtime.tensors import TensorView
    kernel = compile_backward(spec)
    p = spec.problem

    def tv(name, shape, dtype=p.dtype, slot=-1):
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        return TensorView(name, 0 if slot >= 0 else 1 << 20, shape, strides, dtype, 0, None, slot)
    shapes = {"q": (2, heads, q_len, p.head_dim_qk), "k": (2, kv_heads, kv_len, p.head_dim_qk),
              "v": (2, kv_heads, kv_len, p.head_dim_v), "o": (2, heads, q_len, p.head_dim_v),
              "lse": (2, heads, q_len), "do": (2, heads, q_len, p.head_dim_v)}
    views = [tv(n, s, DType.FP32 if n == "lse" else p.dtype, i) for i, (n, s) in enumerate(shapes.items())] + [None]

    class Builder:   # runtime/launch.CallBuilder's part that build_call uses
        tensors, name, device_id, like = (None,) * 7, kernel.name, 0, None

        def __init__(self):
            self.launches, self.slots = [], 7

        def allocate(self, name, shape, dtype):
            self.slots += 1
            return tv(name, tuple(shape), dtype, self.slots - 1)
        new_output = workspace = allocate

        def launch(self, fn, grid, threads, smem, args, label):
            self.launches.append((fn, grid, threads, smem, args))
    monkeypatch.setattr(kernel, "check", lambda b: (views, (2, heads, kv_heads, q_len, kv_len)))
    monkeypatch.setattr(kernel, "functions", lambda device_id=None: {r: r for r in kernel.plan.kernel_names})
    monkeypatch.setattr(runtime, "map_arg", lambda t, rows, element="uint16": ("map", t.name, rows, element))
    monkeypatch.setattr(Kernel, "error_word_arg", staticmethod(lambda device_id, like: ERROR_WORD))
    builder = Builder()
    kernel.build_call(builder, validate=False)
    return kernel, builder.launches


@pytest.mark.parametrize("tile_q,tile_kv,head_dim,stages,dq", CONFIGS[:1] + CONFIGS[2:3] + CONFIGS[5:6])
def test_launch_arguments_match_the_kernel_signatures(tile_q, tile_kv, head_dim, stages, dq, monkeypatch):
    spec = ws(tile_q, tile_kv, head_dim, stages, dq)
    kernel, calls = _launch_args(spec, monkeypatch=monkeypatch)
    assert [c[0] for c in calls] == ["preprocess", "main", "convert"]
    for role, grid, threads, smem, args in calls:
        name = kernel.plan.kernel_names[role]
        signature = re.search(rf"{name}\((.*?)\) {{", kernel.source, re.S).group(1)
        assert len(args) == signature.count(",") + 1, (role, len(args), signature)
    _, (q_tiles, pairs, _), pre_threads, _, pre = calls[0]
    assert q_tiles * kernel.plan.pre_rows >= 200 and pairs == 8 and pre_threads == kernel.plan.pre_threads
    _, main_grid, threads, smem, main = calls[1]
    assert main_grid == (-(-333 // tile_kv) * 2 * 2, 1, 1) and threads == 384 and smem == kernel.plan.launch.smem_bytes
    assert main[0] == ("map", "q", tile_q, "uint16") and main[1] == ("map", "k", tile_kv, "uint16")
    assert main[3] == ("map", "do", tile_q, "uint16")
    assert main[4] == (("map", "dq_accum", tile_q, "float32") if dq != "atomic" else main[0])
    assert (main[8].slot >= 0) == (dq == "ordered")   # semaphores only for `ordered`
    assert [a.kind for a in main[5:13]] == ["u64"] * 8 and [a.kind for a in main[13:19]] == ["i32"] * 6
    assert main[12] is ERROR_WORD   # after kv_lens: the kernel bounds it (lower/plan.bounds_indices)


def test_dispatch_takes_it_by_default_on_hopper_and_refuses_clearly():
    assert dispatch.BACKWARD_WS is True
    for d in (64, 128, 256):
        for det in (False, True):
            default = chosen_backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL, None, None, None, det)
            assert default.backward == (BACKWARD_WS_DETERMINISTIC if det else BACKWARD_WS_TUNED)[d]
    assert not chosen_backward_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, mma="wgmma").backward.warp_specialized
    assert not chosen_backward_spec("sm_90a", DType.BF16, 96, Mask.CAUSAL).backward.warp_specialized
    assert not chosen_backward_spec("sm_80", DType.BF16, 128, Mask.CAUSAL).backward.warp_specialized
    for d in (64, 128, 256):
        for det in (False, True):
            spec = chosen_backward_spec("sm_90a", DType.BF16, d, Mask.CAUSAL, None, None, None, det, None, True)
            assert spec.backward == (BACKWARD_WS_DETERMINISTIC if det else BACKWARD_WS_TUNED)[d]
            assert (spec.backward.dq is DqAccumulate.ORDERED) == det
    assert "sm_90a" in ws_refusal("sm_80", 128, None, False)
    assert "head dims" in ws_refusal("sm_90a", 96, None, False)
    with pytest.raises(RuntimeInputError, match="head dims"):
        chosen_backward_spec("sm_90a", DType.BF16, 192, Mask.NONE, None, None, None, False, None, True)


def _ptxas(spec):
    plan = lower_backward(spec)
    return plan, nvcc.resources(render(plan), plan.kernel_names["main"])


needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")


@needs_nvcc
def test_ptx_holds_setmaxnreg_bulk_copies_and_wgmma(tmp_path):
    plan = lower_backward(load_spec("specs/backward_ws_d128.tile"))
    path, _ = nvcc.compile_to(render(plan), plan.kernel_name, "ptx", tmp_path)
    ptx = path.read_text()
    for instruction in ("setmaxnreg.dec.sync.aligned.u32 24", "setmaxnreg.inc.sync.aligned.u32 240",
                        "cp.async.bulk.tensor.4d.shared::cluster.global", "cp.async.bulk.shared::cluster.global",
                        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add", "wgmma.mma_async.sync.aligned.m64n64k16",
                        "wgmma.mma_async.sync.aligned.m64n128k16", "mbarrier.try_wait.parity", "fence.proxy.async"):
        assert instruction in ptx, instruction


@needs_nvcc
def test_no_spills_for_the_bundled_specs_and_the_dispatch_table():
    specs = list(WS_SPECS)
    for d in BACKWARD_WS_TUNED:
        for mask, window in ((Mask.NONE, None), (Mask.CAUSAL, None), (Mask.WINDOW, (100, 20))):
            for det in (False, True):
                specs.append(chosen_backward_spec("sm_90a", DType.BF16, d, mask, None, window, None, det, None, True))
    with ThreadPoolExecutor(2) as pool:
        for plan, res in pool.map(_ptxas, specs):
            assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, (plan.kernel_name,
                                                                                              res.report[-600:])


def _accumulator(nt_tiles: int):
    """(thread, n-tile, element) -> (row, column) of a warpgroup's m64 x 8*nt_tiles wgmma accumulator (the
    m16n8 layout repeated over n: warp w holds rows 16w.., lane l rows l/4 and l/4 + 8, columns 2(l%4), +1)."""
    for t in range(128):
        w, lane = divmod(t, 32)
        for nt in range(nt_tiles):
            for e in range(4):
                yield t, nt, e, w * 16 + (lane >> 2) + 8 * (e >> 1), nt * 8 + (lane & 3) * 2 + (e & 1)


def _panel_offset(row, chunk, rows):   # templates/wgmma.cuh.j2
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


@pytest.mark.parametrize("tile_q,tile_kv,head_dim", [(64, 128, 128), (128, 128, 64), (64, 64, 256)])
def test_staging_covers_every_element_once_where_the_operands_read_it(tile_q, tile_kv, head_dim):
    """Mirrors of the template's stage_fragments (dS^T, P^T) and stage_dq: across both consumers each element is
    written once, at its place in the panel layout the wgmma descriptors read (dS^T) and in the TMA reduce box
    layout (dQ_i: 32 fp32 columns x tile q rows, 16-byte chunks XOR-swizzled by row % 8)."""
    plan = lower_backward(ws(tile_q, tile_kv, head_dim, 1 if head_dim == 256 else 2,
                             "tma_reduce"))
    c = {k.name: k.value for k in plan.constants}
    seen = {}
    for consumer in (0, 1):
        key0, col0 = consumer * c["CONSUMER_KEYS"], consumer * c["CONSUMER_COLS"]
        for t, nt, e, row, col in _accumulator(c["S_COLS"] // 8):
            key, q = key0 + row, col0 + col
            kk, j = nt // 2, (nt % 2) * 2 + (e >> 1)   # pack_fragments: frag[kk][j] holds (e & 1) as its halves
            lane = t % 32
            address = _panel_offset(key0 + (t // 32) * 16 + (lane >> 2) + 8 * (j & 1), col0 // 8 + 2 * kk + (j >> 1),
                                    tile_kv) + (lane & 3) * 4 + (e & 1) * 2
            assert address == _panel_offset(key, q // 8, tile_kv) + (q % 8) * 2
            assert (key, q) not in seen
            seen[key, q] = address
    assert len(seen) == tile_kv * tile_q and len(set(seen.values())) == len(seen)
    stage = {}
    for consumer in (0, 1):
        rows0, cols0 = consumer * c["DQ_CONSUMER_ROWS"], consumer * c["DQ_CONSUMER_COLS"]
        for t, nt, e, row, col in _accumulator(c["DQ_COLS"] // 8):
            r, q = rows0 + row, cols0 + col
            chunk = (q & 31) >> 2
            address = (q >> 5) * c["STAGE_BOX_BYTES"] + r * 128 + ((chunk ^ (r & 7)) << 4) + (q & 3) * 4
            assert (r, q) not in stage and 0 <= address < c["STAGE_BYTES"]
            stage[r, q] = address
    assert len(stage) == tile_q * head_dim and sorted(stage.values()) == list(range(0, c["STAGE_BYTES"], 4))
