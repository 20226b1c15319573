"""tiledsl.distributed without a GPU: which block each rank computes at each step (the blocks of all steps
cover the full mask exactly once, both directions), zigzag's balance, shard / unshard, the float64 merge,
the generated merge kernel compiled by nvcc, explain-ring; and, where torch is installed, the ring protocol
itself with the float64 reference blocks, forward and backward against full attention to 1e-12: on a ring of
threads (a wide sweep) and on torch.distributed gloo with processes (zigzag and contiguous, causal and not,
GQA, uneven shards refused on every rank)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.ring_cases import Case, full_attention, global_inputs
from tiledsl.distributed import explain_ring, rank_chunks, shard, token_positions, unshard
from tiledsl.distributed.steps import BACKWARD, FORWARD, block, source_rank, step_blocks
from tiledsl.errors import RuntimeInputError

ROOT = Path(__file__).resolve().parent.parent
EXACT = 1e-12
SEED = int.from_bytes(os.urandom(4), "little")   # fresh inputs every run; the seed is in each failure message


# ---- which block, when --------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", [FORWARD, BACKWARD])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_the_blocks_of_all_steps_cover_the_mask_exactly_once(world, layout, causal, direction):
    tokens = 2 * world * 3
    local = tokens // world
    covered = np.zeros((tokens, tokens), int)
    for rank in range(world):
        mine = token_positions(rank, world, tokens, layout)
        seen_sources = set()
        for step in range(world):
            source = source_rank(rank, world, step, direction)
            seen_sources.add(source)
            b = block(rank, source, world, local, layout, causal)
            if step == 0:
                assert source == rank and b is not None and b.queries == local   # the diagonal: every row
            if b is None:
                continue
            theirs = token_positions(source, world, tokens, layout)
            for i in range(b.q_start, b.q_stop):
                for j in range(b.kv_start, b.kv_stop):
                    if not b.causal or j <= i:   # a causal block is causal in local order
                        covered[mine[i], theirs[j]] += 1
        assert seen_sources == set(range(world))
    want = np.tril(np.ones((tokens, tokens), int)) if causal else np.ones((tokens, tokens), int)
    assert (covered == want).all()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work_at_every_step_and_contiguous_does_not(world):
    local = 2 * 64
    for step in range(1, world):
        pairs = {b.pairs for b in step_blocks(world, local, "zigzag", True, step)}
        assert pairs == {local * local // 2}
    contiguous = [sum(b.pairs for s in range(world) if (b := step_blocks(world, local, "contiguous", True, s)[r]))
                  for r in range(world)]
    assert contiguous == sorted(contiguous) and contiguous[-1] > (2 * world - 1) * contiguous[0] // 2


def test_a_rank_holds_the_chunks_the_layout_names():
    assert [rank_chunks(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [rank_chunks(r, 3, "contiguous") for r in range(3)] == [(0,), (1,), (2,)]
    assert token_positions(1, 2, 8, "zigzag") == [2, 3, 4, 5]   # chunks 1 and 2 of 2 tokens
    assert token_positions(0, 2, 8, "zigzag") == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="ring layout must be one of 'zigzag', 'contiguous'"):
        rank_chunks(0, 2, "striped")


# ---- shard / unshard -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_then_unshard_gives_the_sequence_back(world, layout):
    x = np.random.default_rng(SEED).normal(size=(2, 3, 2 * world * 5, 4))
    shards = [shard(x, r, world, layout) for r in range(world)]
    for r, s in enumerate(shards):
        assert (s == x[:, :, token_positions(r, world, x.shape[2], layout)]).all()
    assert (unshard(shards, layout) == x).all()


def test_a_sequence_that_does_not_cut_evenly_is_refused_with_what_to_pad_to():
    x = np.zeros((1, 1, 30, 8))
    with pytest.raises(RuntimeInputError, match=r"30 tokens do not split into 8 equal chunks \(zigzag over 4 ranks"
                                                r".*pad the sequence to a multiple of 8"):
        shard(x, 0, 4)
    shard(x, 0, 3, "contiguous")   # 30 = 3 x 10 is fine contiguous
    with pytest.raises(RuntimeInputError, match="shards must have equal lengths"):
        unshard([x[:, :, :10], x[:, :, :12]], "contiguous")


# ---- the float64 merge ---------------------------------------------------------------------------------------

def test_merging_two_disjoint_key_sets_gives_full_attention():
    from tiledsl.distributed.merge import merge_float64
    from tiledsl.reference.forward import naive_attention
    rng = np.random.default_rng(SEED)
    q, k, v = rng.normal(size=(2, 4, 10, 16)), rng.normal(size=(2, 2, 30, 16)), rng.normal(size=(2, 2, 30, 8))
    o, lse = naive_attention(q, k, v)
    acc_o, acc_lse = naive_attention(q, k[:, :, :12], v[:, :, :12])
    part_o, part_lse = naive_attention(q[:, :, 3:], k[:, :, 12:], v[:, :, 12:])
    rest_o, rest_lse = naive_attention(q[:, :, :3], k[:, :, 12:], v[:, :, 12:])
    merge_float64(acc_o, acc_lse, part_o, part_lse, row_start=3)
    merge_float64(acc_o, acc_lse, rest_o, rest_lse, row_start=0)
    assert np.abs(acc_o - o).max() < EXACT and np.abs(acc_lse - lse).max() < EXACT
    blind_o, blind_lse = np.zeros((2, 4, 10, 8)), np.full((2, 4, 10), -np.inf)   # no keys yet: takes the other side
    merge_float64(blind_o, blind_lse, o, lse)
    assert np.abs(blind_o - o).max() < EXACT and np.abs(blind_lse - lse).max() < EXACT


# ---- the generated merge kernel ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,dv", [("bf16", 128), ("fp16", 64), ("bf16", 256), ("fp16", 40), ("bf16", 8)])
def test_the_merge_kernel_compiles_for_sm90a_without_spills(dtype, dv):
    from tiledsl.codegen import nvcc
    from tiledsl.distributed.merge import MergePlan, render_merge
    from tiledsl.spec import DType
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not on PATH")
    plan = MergePlan(DType(dtype), dv)
    source = render_merge(plan)
    assert source == render_merge(plan) and f"{plan.kernel_name}(" in source
    resources = nvcc.resources(source, plan.kernel_name)
    assert resources.spill_stores == 0 and resources.spill_loads == 0 and resources.registers <= 64
    assert plan.threads == plan.rows_per_block * plan.threads_per_row <= 256


def test_the_merge_kernel_refuses_what_it_was_not_built_for():
    from tiledsl.distributed.merge import MergePlan
    from tiledsl.spec import DType
    with pytest.raises(RuntimeInputError, match="head_dim_v must be a multiple of 8"):
        MergePlan(DType.BF16, 100)
    with pytest.raises(RuntimeInputError, match="O must be fp16 or bf16"):
        MergePlan(DType.FP32, 128)


# ---- explain-ring --------------------------------------------------------------------------------------------

def test_explain_prices_bytes_work_and_bounds():
    e = explain_ring(131072, 8, heads=32, kv_heads=8, head_dim=128, causal=True)
    local = 131072 // 8
    kv_bytes = 8 * local * 256 * 2
    assert [s.sent_bytes for s in e.forward] == [kv_bytes] * 7 + [0]
    assert [s.sent_bytes for s in e.backward] == [kv_bytes] + [kv_bytes + 2 * kv_bytes] * 6 + [2 * kv_bytes]
    assert len(set(e.pairs_per_rank)) == 1 and all(s.bound == "compute" for s in e.forward + e.backward)
    assert 0.5 < e.efficiency("forward") <= 1.0 and 0.5 < e.efficiency("backward") <= 1.0
    contiguous = explain_ring(131072, 8, heads=32, kv_heads=8, head_dim=128, causal=True, layout="contiguous")
    assert contiguous.efficiency("forward") < e.efficiency("forward") - 0.2   # the last rank sets the pace
    slow = explain_ring(131072, 8, heads=32, head_dim=128, causal=True, link_bytes_per_s=5e9)   # a slow link
    assert all(s.bound == "link" for s in slow.forward[:-1]) and slow.efficiency("forward") < 0.5
    text = e.text()
    assert "per-rank work" in text and "scaling efficiency" in text and "16384 x 16384 causal" in text


def test_explain_ring_cli_and_its_errors():
    run = lambda *a: subprocess.run([sys.executable, "-m", "tiledsl.cli", "explain-ring", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    done = run("--ranks", "2", "--seqlen", "65536", "--heads", "16", "--kv-heads", "4", "--json")
    assert done.returncode == 0, done.stderr
    import json
    assert json.loads(done.stdout)["ranks"] == 2
    bad = run("--ranks", "3", "--seqlen", "1000")
    assert bad.returncode == 2 and "pad the sequence to a multiple of 6" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("--ranks", "2", "--seqlen", "4096", "--link-gbps", "0")
    assert bad.returncode == 2 and "--link-gbps must be > 0" in bad.stderr


# ---- the protocol, float64 blocks (torch) --------------------------------------------------------------------

def _check(case, seed, ranks_out):
    """ranks_out: per rank a dict of o, lse, dq, dk, dv (its shards) -> every one within EXACT of full attention."""
    import torch
    from tiledsl.distributed import unshard
    o, lse, dq, dk, dv = full_attention(case, *global_inputs(torch, case, seed))
    want = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    for name, full in want.items():
        got = unshard([r[name] for r in ranks_out], case.layout)
        assert got.shape == full.shape and got.dtype == torch.float64, name
        error = float((got - full).abs().max() / full.abs().max())
        assert error < EXACT, f"{case.label()} seed {seed}: {name} off by {error:.3g} (max-norm relative)"


THREAD_CASES = [Case(w, layout, causal) for w in (1, 2, 3, 4) for layout in ("zigzag", "contiguous")
                for causal in (True, False)]
THREAD_CASES += [Case(2, "zigzag", True, batch=1, heads=3, kv_heads=1, tokens=40, head_dim=24, head_dim_v=24,
                      scale=0.3),
                 Case(5, "zigzag", True, tokens=50, head_dim=8, head_dim_v=16),
                 Case(3, "contiguous", False, heads=2, kv_heads=2, tokens=21)]


@pytest.mark.parametrize("case", THREAD_CASES, ids=Case.label)
def test_a_ring_of_threads_matches_full_attention_forward_and_backward(case):
    torch = pytest.importorskip("torch")
    from tiledsl.distributed import LocalRing, ring_attention
    q, k, v, do = global_inputs(torch, case, SEED)

    def rank_body(endpoint):
        r = endpoint.rank
        mine = [shard(x, r, case.world, case.layout) for x in (q, k, v)]
        for x in mine:
            x.requires_grad_()
        o, lse = ring_attention(*mine, group=endpoint, causal=case.causal, layout=case.layout, scale=case.scale,
                                return_lse=True)
        assert not lse.requires_grad
        o.backward(shard(do, r, case.world, case.layout))
        return {"o": o.detach(), "lse": lse, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    _check(case, SEED, LocalRing(case.world).run(rank_body, timeout_s=300))


def test_uneven_shards_and_bad_shards_are_refused_by_name():
    torch = pytest.importorskip("torch")
    from tiledsl.distributed import LocalRing, ring_attention

    def body(endpoint):
        n = 10 if endpoint.rank == 1 else 8
        x = torch.randn(1, 2, n, 16, dtype=torch.float64)
        with pytest.raises(RuntimeInputError) as err:
            ring_attention(x, x, x, group=endpoint, causal=True)
        return str(err.value)
    messages = LocalRing(3).run(body)
    assert len(set(messages)) == 1
    assert "differ in tokens (rank 0: 8, rank 1: 10, rank 2: 8)" in messages[0]
    assert "tiledsl.distributed.shard" in messages[0]
    single = LocalRing(1).endpoint(0)
    x = torch.randn(1, 2, 9, 16, dtype=torch.float64)
    with pytest.raises(RuntimeInputError, match="q has 9 tokens on rank 0; a zigzag shard holds two equal chunks"):
        ring_attention(x, x, x, group=single)
    with pytest.raises(RuntimeInputError, match=r"shapes disagree: q \(1, 2, 9, 16\), k \(1, 2, 8, 16\)"):
        ring_attention(x, x[:, :, :8], x[:, :, :8], group=single, layout="contiguous")
    with pytest.raises(RuntimeInputError, match="3 query heads are not a multiple of 2 kv heads"):
        ring_attention(x[:, :1].expand(1, 3, 9, 16), x, x, group=single, layout="contiguous")
    with pytest.raises(RuntimeInputError, match="k must be 4-d"):
        ring_attention(x, x[0], x, group=single, layout="contiguous")
    with pytest.raises(ValueError, match="ring layout must be one of"):
        ring_attention(x, x, x, group=single, layout="ring")
    with pytest.raises(RuntimeInputError, match="tiledsl's kernels need CUDA tensors"):
        ring_attention(x, x, x, group=single, layout="contiguous", blocks="kernels")


def test_without_an_initialized_process_group_the_error_says_what_to_do():
    torch = pytest.importorskip("torch")
    from tiledsl.distributed import ring_attention
    x = torch.randn(1, 1, 8, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ring_attention(x, x, x)


GLOO_CASES = {2: [Case(2, "zigzag", True), Case(2, "contiguous", True), Case(2, "zigzag", False),
                  Case(2, "contiguous", False, heads=2, kv_heads=1, tokens=30)],
              3: [Case(3, "zigzag", True, tokens=36), Case(3, "contiguous", True, tokens=36),
                  Case(3, "zigzag", False, tokens=36, head_dim=8, head_dim_v=8, scale=0.5)]}


@pytest.mark.parametrize("world", sorted(GLOO_CASES))
def test_the_ring_on_gloo_processes_matches_full_attention_and_refuses_uneven_shards(world, tmp_path):
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp

    from tests.ring_gloo_worker import run_rank
    cases = GLOO_CASES[world]
    mp.spawn(run_rank, args=(world, str(tmp_path / "init"), SEED, cases, str(tmp_path)), nprocs=world, join=True)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for i, case in enumerate(cases):
        _check(case, SEED + i, [s["results"][i] for s in saved])
    for s in saved:
        assert f"differ in tokens (rank 0: 10, {', '.join(f'rank {r}: 8' for r in range(1, world))})" in s["uneven"]


def test_the_kernel_engine_hands_the_kernels_what_they_take(monkeypatch):
    """KernelBlocks' plumbing on the CPU, its kernels replaced by float64 stand-ins that check their inputs the
    way the GPU entry points do (views with unit last stride, a contiguous fp32 LSE, nothing needing grad); the
    fp32 accumulators then hold the ring's answer to fp32 rounding."""
    torch = pytest.importorskip("torch")
    from tests import attention_reference as ref
    from tiledsl.dispatch import backward as dispatch_backward, tuned
    from tiledsl.distributed import LocalRing, blocks as engines, ring_backward, ring_forward

    def forward(q, k, v, causal=False, window=None, scale=None, kv_lens=None):
        assert window is None and kv_lens is None and not q.requires_grad and q.stride(-1) == 1
        o, lse = ref.attention(q, k, v, causal=causal, scale=scale)
        return o, lse.float()

    def attention_backward(q, k, v, o, lse, do, *, causal=False, window=None, scale=None, kv_lens=None,
                           deterministic=False):
        assert lse.dtype == torch.float32 and lse.is_contiguous() and o.shape == do.shape
        assert not any(x.requires_grad for x in (q, k, v, o, do))
        # the kernels recompute P from the LSE they are given: check the stand-in does the same
        return _recomputed_gradients(q, k, v, o, lse.double(), do, causal, scale)

    monkeypatch.setattr(tuned, "forward", forward)
    monkeypatch.setattr(dispatch_backward, "attention_backward", attention_backward)

    class StandIn(engines.KernelBlocks):
        """The kernel engine with the GPU merge kernel's contract checked and the float64 merge run instead."""
        name = "kernels on the CPU"

        def merge(self, o_acc, lse_acc, o, lse, row_start):
            assert o_acc.dtype == lse_acc.dtype == torch.float32 and o_acc.is_contiguous()
            engines.merge_float64(o_acc, lse_acc, o, lse.contiguous(), row_start)
    case = Case(3, "zigzag", True, heads=4, kv_heads=2, tokens=36)
    q, k, v, do = global_inputs(torch, case, SEED)
    o64, lse64, dq64, dk64, dv64 = full_attention(case, q, k, v, do)

    def body(endpoint):
        mine = [shard(x, endpoint.rank, case.world, case.layout) for x in (q, k, v, do)]
        o_acc, lse = ring_forward(*mine[:3], endpoint, causal=True, blocks=StandIn())
        assert o_acc.dtype == torch.float32
        grads = ring_backward(*mine[:3], o_acc.double(), lse, mine[3], endpoint, causal=True, blocks=StandIn())
        return o_acc, lse, *grads
    ranks = LocalRing(case.world).run(body)
    fp32 = 2.0 ** -17
    for i, want in enumerate((o64, lse64, dq64, dk64, dv64)):
        got = unshard([r[i] for r in ranks], case.layout)
        assert got.dtype == torch.float32 and ref.max_relative_error(got, want) < fp32, i


def _recomputed_gradients(q, k, v, o, lse, do, causal, scale):
    """FlashAttention's backward from the given O and LSE (what the GPU kernels compute), in float64."""
    import torch
    from tests import attention_reference as ref
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seen = ref.visible_keys(q.shape[2], k.shape[2], q.shape[0], causal)
    p = torch.exp((q @ kr.transpose(-1, -2)) * scale - lse.unsqueeze(-1)) * seen
    ds = p * (do @ vr.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    fold = lambda x: x.unflatten(1, (k.shape[1], group)).sum(2)   # noqa: E731
    return scale * ds @ kr, fold(scale * ds.transpose(-1, -2) @ q), fold(p.transpose(-1, -2) @ do)


def test_the_readme_torchrun_example_runs_on_gloo(tmp_path):
    """The README's context-parallel example, as written, under torchrun with two CPU ranks (gloo, float64 blocks)."""
    pytest.importorskip("torch")
    import re
    section = (ROOT / "README.md").read_text().split("\n## Context parallelism (several GPUs)\n", 1)[1]
    example = re.search(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S).group(1)
    script = tmp_path / "ring_example.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ring of 2: O (1, 4, 128, 32), dK of rank 0 (1, 2, 64, 32)" in done.stdout
