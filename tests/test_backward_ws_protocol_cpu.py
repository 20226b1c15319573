"""A CPU model of the warp-specialized backward's synchronisation (templates/backward_ws.cu.j2), run to the end
for every schedule the layout accepts: one block's twelve warps, each a coroutine of the waits and arrivals its
code performs, over the setmaxnreg register pool, the mbarriers (arrival counts, transaction bytes, phase parity)
and the named barriers. A schedule whose warps can all block at once hangs on the GPU; the model says which warp
waits on what.

The warps' programs follow the template line by line (the consumers' q loop is the plan's loop_body, in its
order); the arrivals per warp are the template's (lane 0 of each consumer warp on q_empty, every consumer thread
on dq_full, every writer thread on dq_empty, the copy thread's arrive.expect_tx on the full barriers), and the
counts the barriers are initialised with are the plan's constants. test_the_model_reads_the_template_it_models
pins the statements the model assumes.

The register pool: a block launches with ptxas's count under __launch_bounds__(THREADS, 1) per thread, and
setmaxnreg only moves those registers between its warps (PTX ISA: a per-CTA pool; .inc blocks until the pool
holds enough). test_entry_registers_are_ptxas_count checks that count against ptxas."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tiledsl.codegen import nvcc
from tiledsl.codegen.render import render
from tiledsl.device_limits import H200, entry_registers
from tiledsl.errors import SpecError
from tiledsl.hw import WARP_THREADS, WARPGROUP_THREADS
from tiledsl.layout.backward import backward_layout
from tiledsl.lower.backward import lower_backward
from tiledsl.lower.backward_ws import lower_backward_ws

from .test_backward_ws_cpu import CONFIGS, ws

WARPS_PER_WARPGROUP = WARPGROUP_THREADS // WARP_THREADS


class Hang(AssertionError):
    """Every unfinished warp waits on something no other warp will deliver."""


class ProtocolError(AssertionError):
    """A barrier used in a way the hardware leaves undefined or that lets a wait pass early."""


@dataclass
class Mbarrier:
    name: str
    count: int           # arrivals that complete a phase (mbarrier.init)
    pending: int = 0
    tx: int = 0          # transaction bytes still expected in the current phase
    completed: int = 0   # phases completed so far; the current phase's parity is completed & 1

    def __post_init__(self):
        self.pending = self.count

    def arrive(self, n: int, tx: int = 0):
        if n > self.pending:
            raise ProtocolError(f"{self.name}: {n} arrivals with {self.pending} left in phase {self.completed}")
        self.pending -= n
        self.tx += tx
        self._complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count
        elif self.tx < 0:
            raise ProtocolError(f"{self.name}: {-self.tx} bytes more than expected in phase {self.completed}")


@dataclass
class NamedBarrier:
    id: int
    count: int = 0       # threads of the current generation (bar.sync's second operand)
    arrived: int = 0
    generation: int = 0


@dataclass
class Block:
    """One block's shared synchronisation state."""
    pool: int                                   # registers released by setmaxnreg.dec, not yet taken
    mbarriers: dict
    named: dict


def _slot(s, n):
    return s % n


def producer_warp(c: dict, copies: dict, warp: int, steps: int, writer_warps: int, staged: bool):
    """Warp `warp` of the producer warpgroup: warp 0's lane 0 issues every copy; warps 1..writer_warps are the
    dQ writer when dQ_i is staged; the rest only lower their registers."""
    yield ("bar_sync", 0, WARP_THREADS, c["THREADS"])                  # __syncthreads after mbarrier_init
    yield ("setmaxnreg", c["PRODUCER_REGS"])
    if warp == 0 and steps > 0:
        yield ("arrive", "kv_full", 1, c["KV_BYTES"])                   # arrive.expect_tx, then the copies
        yield ("complete_tx", "kv_full", copies["kv_full"])
        for s in range(steps):
            slot, rnd = _slot(s, c["STAGES"]), s // c["STAGES"]
            if rnd > 0:   # the consumers' (rnd - 1)-th release of the slot
                yield ("wait", f"q_empty{slot}", (rnd - 1) & 1, rnd)
            yield ("arrive", f"q_full{slot}", 1, c["Q_TX_BYTES"])
            yield ("complete_tx", f"q_full{slot}", copies["q_full"])
    if staged and 1 <= warp <= writer_warps and steps > 0:
        for s in range(steps):
            b = s % c["STAGING"]
            yield ("wait", f"dq_full{b}", (s // c["STAGING"]) & 1, s // c["STAGING"] + 1)
            yield ("arrive", f"dq_empty{b}", WARP_THREADS, 0)            # every writer thread, after __syncwarp


def consumer_warp(c: dict, loop_body, steps: int, kv_end: bool):
    """One warp of a consumer warpgroup: setmaxnreg.inc, kv_full, the zeroing barrier past kv_lens, then the
    plan's q loop."""
    yield ("bar_sync", 0, WARP_THREADS, c["THREADS"])
    yield ("setmaxnreg", c["CONSUMER_REGS"])
    if steps > 0:
        yield ("wait", "kv_full", 0, 1)
        if kv_end:
            yield ("bar_sync", c["DS_BAR"], WARP_THREADS, c["CONSUMER_THREADS"])
    for s in range(steps):
        slot, phase = _slot(s, c["STAGES"]), (s // c["STAGES"]) & 1
        for op in loop_body:
            if op.kind == "wait_q_full":
                yield ("wait", f"q_full{slot}", phase, s // c["STAGES"] + 1)
            elif op.kind == "sync_ds":
                yield ("bar_sync", c["DS_BAR"], WARP_THREADS, c["CONSUMER_THREADS"])
            elif op.kind == "arrive_q_empty":
                yield ("arrive", f"q_empty{slot}", 1, 0)                  # lane 0 of the warp
            elif op.kind == "wait_dq_empty" and s >= c["STAGING"]:
                b = s % c["STAGING"]
                yield ("wait", f"dq_empty{b}", ((s // c["STAGING"]) - 1) & 1, s // c["STAGING"])
            elif op.kind == "arrive_dq_full":
                yield ("arrive", f"dq_full{s % c['STAGING']}", WARP_THREADS, 0)   # every thread


def constants(plan) -> dict:
    return {x.name: x.value for x in plan.constants}


def run_block(plan, steps: int, kv_end: bool = False, entry: int | None = None) -> dict:
    """Runs one block of `plan` with `steps` q steps to the end; Hang or ProtocolError when it cannot.
    `entry`: registers per thread at launch (default: the launch bound's). Returns the final barrier phases."""
    c = constants(plan)
    entry = entry_registers(H200, c["THREADS"]) if entry is None else entry
    copies = {}
    for x in plan.copies:
        copies[x.barrier] = copies.get(x.barrier, 0) + x.count * x.bytes
    bars = {"kv_full": Mbarrier("kv_full", 1)}
    for s in range(c["STAGES"]):
        bars[f"q_full{s}"] = Mbarrier(f"q_full{s}", 1)
        bars[f"q_empty{s}"] = Mbarrier(f"q_empty{s}", c["Q_EMPTY_ARRIVALS"])
    for b in range(c["STAGING"]):
        bars[f"dq_full{b}"] = Mbarrier(f"dq_full{b}", c["DQ_FULL_ARRIVALS"])
        bars[f"dq_empty{b}"] = Mbarrier(f"dq_empty{b}", c["DQ_EMPTY_ARRIVALS"])
    block = Block(0, bars, {})
    staged = c["STAGING"] > 0
    writer_warps = c["WRITER_THREADS"] // WARP_THREADS
    warps = {f"producer warp {w}": producer_warp(c, copies, w, steps, writer_warps, staged)
             for w in range(WARPS_PER_WARPGROUP)}
    consumers = (c["THREADS"] - WARPGROUP_THREADS) // WARP_THREADS
    warps |= {f"consumer {w // WARPS_PER_WARPGROUP} warp {w % WARPS_PER_WARPGROUP}":
              consumer_warp(c, plan.loop_body, steps, kv_end) for w in range(consumers)}
    held = {name: entry for name in warps}   # registers per thread each warp holds
    request = {name: next(gen, None) for name, gen in warps.items()}
    ticket = {}                              # warp -> named barrier generation it waits for
    while any(r is not None for r in request.values()):
        progressed = False
        for name, r in request.items():
            if r is None:
                continue
            if _step(block, name, r, held, ticket):
                request[name] = next(warps[name], None)
                progressed = True
        if not progressed:
            waiting = "; ".join(f"{n}: {_describe(block, r, held[n])}" for n, r in request.items() if r is not None)
            raise Hang(f"{plan.kernel_name}, {steps} q steps{', kv_end' if kv_end else ''}: {waiting}")
    return {n: b.completed for n, b in bars.items()}


def _step(block: Block, warp: str, r: tuple, held: dict, ticket: dict) -> bool:
    """Performs `r` for `warp` if it can proceed now (True), else leaves it blocked (False)."""
    kind = r[0]
    if kind == "setmaxnreg":   # the pool is per block: .dec gives registers to it, .inc takes them or blocks
        want = r[1] - held[warp]
        if want > 0 and block.pool < want * WARP_THREADS:
            return False
        block.pool -= want * WARP_THREADS
        held[warp] = r[1]
        return True
    if kind == "arrive":
        block.mbarriers[r[1]].arrive(r[2], r[3])
        return True
    if kind == "complete_tx":
        block.mbarriers[r[1]].complete_tx(r[2])
        return True
    if kind == "wait":   # mbarrier.try_wait.parity: passes once the phase of that parity has completed
        bar, parity, needed = block.mbarriers[r[1]], r[2], r[3]
        passes = (bar.completed & 1) != parity
        if passes and bar.completed < needed:
            raise ProtocolError(f"{warp}: the wait on {bar.name} (parity {parity}) passes after {bar.completed} "
                                f"phases; it needs {needed}")
        if not passes and bar.completed >= needed:
            raise ProtocolError(f"{warp}: {bar.name} ran {bar.completed - needed + 1} phases past the wait's")
        return passes
    if kind == "bar_sync":
        _, bid, threads, count = r
        nb = block.named.setdefault(bid, NamedBarrier(bid))
        if warp not in ticket:   # arrive once, then wait for the generation to complete
            if nb.arrived and nb.count != count:
                raise ProtocolError(f"{warp}: bar.sync {bid}, {count} while its generation counts {nb.count}")
            nb.count = count
            ticket[warp] = nb.generation
            nb.arrived += threads
            if nb.arrived > count:
                raise ProtocolError(f"bar.sync {bid}: {nb.arrived} threads arrived for {count}")
            if nb.arrived == count:
                nb.generation, nb.arrived = nb.generation + 1, 0
        if nb.generation > ticket[warp]:
            del ticket[warp]
            return True
        return False
    raise ValueError(kind)


def _describe(block: Block, r: tuple, held: int) -> str:
    if r[0] == "setmaxnreg":
        return (f"setmaxnreg.inc {r[1]} (holds {held}; the pool has {block.pool // WARP_THREADS} per thread of "
                f"{r[1] - held} needed)")
    if r[0] == "wait":
        bar = block.mbarriers[r[1]]
        return f"wait {bar.name} parity {r[2]} ({bar.completed} phases, {bar.count - bar.pending}/{bar.count} arrived)"
    if r[0] == "bar_sync":
        nb = block.named.get(r[1])
        return f"bar.sync {r[1]}, {r[3]} ({nb.arrived if nb else 0} arrived)"
    return str(r)


# q steps of one block: none (a kv tile past kv_lens / above the causal diagonal), fewer than, as many as and
# more than the ring's slots and the staging buffers (seqlen 257: 3 q tiles of 128 or 5 of 64)
STEPS = (0, 1, 2, 3, 4, 5, 7)
REGISTERS = [(24, 240), (32, 232), (32, 240), (40, 232), (24, 248)]


def _spec(tile_q, tile_kv, head_dim, stages, dq, producer_regs, consumer_regs):
    spec = ws(tile_q, tile_kv, head_dim, stages, dq)
    return replace(spec, backward=replace(spec.backward, producer_regs=producer_regs, consumer_regs=consumer_regs))


@pytest.mark.parametrize("regs", REGISTERS, ids=lambda r: f"p{r[0]}c{r[1]}")
@pytest.mark.parametrize("tile_q,tile_kv,head_dim,stages,dq", CONFIGS + [(128, 128, 64, 1, "atomic"),
                                                                       (64, 128, 128, 3, "atomic")])
def test_every_schedule_the_layout_accepts_runs_to_the_end(tile_q, tile_kv, head_dim, stages, dq, regs):
    """Either the layout refuses the register split at the warpgroups line, or every block of it finishes: no
    setmaxnreg.inc waits on registers that were never released, no wait on a phase nobody completes."""
    spec = _spec(tile_q, tile_kv, head_dim, stages, dq, *regs)
    budget = 3 * entry_registers(H200, 3 * WARPGROUP_THREADS)
    try:
        plan = lower_backward(spec)
    except SpecError as err:
        assert regs[0] + 2 * regs[1] > budget, err.message   # refused only for the registers
        assert "setmaxnreg" in err.message and str(budget) in err.message, err.message
        assert "warpgroups" in spec.source_text.splitlines()[err.span.line - 1]
        return
    c = constants(plan)
    for steps in STEPS:
        for kv_end in (False, True):
            phases = run_block(plan, steps, kv_end)
            if steps:   # every q step filled and emptied its slot, and staged and drained its dQ_i
                assert sum(phases[f"q_full{s}"] for s in range(c["STAGES"])) == steps
                assert sum(phases[f"q_empty{s}"] for s in range(c["STAGES"])) == steps
                assert sum(phases.get(f"dq_empty{b}", 0) for b in range(c["STAGING"])) == (steps if c["STAGING"]
                                                                                         else 0)
    assert regs[0] + 2 * regs[1] <= budget


def test_the_atomic_writer_variant_hung_on_the_register_pool():
    """The bench's `ws_red` (d64, tile q 128, dq atomic, producer regs 32): 32 + 2 x 240 = 512 registers per
    thread of a warpgroup, and the block launched with 3 x 168 = 504. The layout refuses it; built as before, the
    model hangs where the GPU did, the second consumer warpgroup's setmaxnreg.inc."""
    spec = _spec(128, 128, 64, 2, "atomic", 32, 240)
    with pytest.raises(SpecError, match="setmaxnreg") as err:
        backward_layout(spec)
    assert "504" in err.value.message and "regs 24" in (err.value.hint or "")
    accepted = _spec(128, 128, 64, 2, "atomic", 24, 240)   # the same kernel at 24: what the pool holds
    plan = lower_backward(accepted)
    wide = replace(plan, constants=tuple(replace(x, value=32) if x.name == "PRODUCER_REGS" else x
                                         for x in plan.constants))
    with pytest.raises(Hang, match=r"consumer 1 warp \d: setmaxnreg.inc 240"):
        run_block(wide, 3)
    run_block(plan, 3)


def test_the_model_finds_a_wrong_arrival_count():
    """One arrival too many needed to free a ring slot (the GPU test's hang): the producer waits forever for
    the third q tile's slot, and so does everyone behind it."""
    spec = ws(128, 128, 64, 2, "tma_reduce")
    plan = lower_backward_ws(spec, lower_backward(spec).kernel_name, q_empty_arrivals=9)
    run_block(plan, 2)
    with pytest.raises(Hang, match="producer warp 0: wait q_empty0 parity 0"):
        run_block(plan, 3)


def test_the_model_finds_a_wrong_parity():
    """A wait whose parity names the phase being filled, not the one it needs, passes at once on the GPU (a
    race, not a hang): the model refuses it; and a barrier two phases past a wait aliases its parity."""
    block = Block(0, {"dq_empty0": Mbarrier("dq_empty0", 1)}, {})
    with pytest.raises(ProtocolError, match="passes after 0 phases"):
        _step(block, "consumer", ("wait", "dq_empty0", 1, 1), {}, {})
    assert not _step(block, "consumer", ("wait", "dq_empty0", 0, 1), {}, {})
    block.mbarriers["dq_empty0"].arrive(1)
    assert _step(block, "consumer", ("wait", "dq_empty0", 0, 1), {}, {})
    block.mbarriers["dq_empty0"].arrive(1)
    with pytest.raises(ProtocolError, match="phases past"):
        _step(block, "consumer", ("wait", "dq_empty0", 0, 1), {}, {})


def test_the_model_reads_the_template_it_models():
    """The statements the model's warps stand for, in the rendered source: if one changes, so must the model."""
    for dq in ("tma_reduce", "atomic"):
        src = render(lower_backward(ws(128, 128, 64, 2, dq)))
        for statement in (
                "registers_decrease<C::PRODUCER_REGS>();", "registers_increase<C::CONSUMER_REGS>();",
                "if (warp == 0 && lane == 0 && steps > 0) {",
                "if (round > 0) mbarrier_wait(bar_at(bars, C::Q_EMPTY_BAR + slot), (round - 1) & 1);",
                "mbarrier_arrive_expect_tx(full, C::Q_TX_BYTES);",
                "if (warp >= 1 && warp * 32 < 32 + C::WRITER_THREADS && steps > 0) {",
                "mbarrier_wait(bar_at(bars, C::DQ_FULL_BAR + b), (s / C::STAGING) & 1);",
                "__syncwarp();\n                mbarrier_arrive(bar_at(bars, C::DQ_EMPTY_BAR + b));",
                "mbarrier_wait(bar_at(bars, C::KV_FULL_BAR), 0);",
                "named_barrier_sync(C::DS_BAR, C::CONSUMER_THREADS);",
                "mbarrier_wait(bar_at(bars, C::Q_FULL_BAR + slot), phase);",
                "if (lane == 0) mbarrier_arrive(bar_at(bars, C::Q_EMPTY_BAR + slot));",
                ("if (s >= C::STAGING) mbarrier_wait(bar_at(bars, C::DQ_EMPTY_BAR + s % C::STAGING), "
                 "((s / C::STAGING) - 1) & 1);"),
                "mbarrier_arrive(bar_at(bars, C::DQ_FULL_BAR + s % C::STAGING));",
                "const int slot = (s) % C::STAGES", "const u32 phase = ((s) / C::STAGES) & 1;",
                "const u32 chunks = min(q_len - q0, C::BR) * (C::D / 4);",
                "for (u32 i = writer; i < chunks; i += C::WRITER_THREADS) {", "red_add4(rows + i * 4,"):
            assert statement in src, statement
        assert src.count("__syncthreads()") == 1 and src.count("bar.sync") == 1   # no other block barrier


@pytest.mark.parametrize("tile_q,head_dim", [(128, 64), (64, 128)])
def test_the_writers_chunks_are_the_rows_before_q_len_once(tile_q, head_dim):
    """The writer's red.global.add loop (one bound on chunk i, destination rows + 4 i): every element of the rows
    before q_len exactly once, from the staged element of the same row and column, none past q_len."""
    plan = lower_backward(ws(tile_q, 128, head_dim, 2, "atomic"))
    c = constants(plan)
    assert plan.dq_path == "writer_red"
    chunks_per_row = head_dim // 4
    for valid_rows in (1, 7, tile_q // 2 + 1, tile_q):   # q_len - q0 of a ragged or a whole tile
        chunks = min(valid_rows, tile_q) * chunks_per_row
        written = []
        for writer in range(c["WRITER_THREADS"]):
            for i in range(writer, chunks, c["WRITER_THREADS"]):
                row, col = i // chunks_per_row, (i % chunks_per_row) * 4
                written += [(row, col + e, 4 * i + e) for e in range(4)]
        assert sorted((r, k) for r, k, _ in written) == [(r, k) for r in range(valid_rows) for k in range(head_dim)]
        assert all(dst == r * head_dim + k for r, k, dst in written)


needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not on PATH")


@needs_nvcc
def test_entry_registers_are_ptxas_count():
    """ptxas gives the main kernel exactly the launch bound's registers per thread: the block's pool."""
    plan = lower_backward(ws(128, 128, 64, 2, "atomic"))
    res = nvcc.resources(render(plan), plan.kernel_names["main"])
    assert res.registers == entry_registers(H200, constants(plan)["THREADS"]) == 168, res.report[-400:]
