"""The float64 reference of the backward: the backward graph (schedule/backward.py) executed in NumPy.

`reference_backward` walks the graph kernel by kernel, trip by trip, with the backward schedule's
own tiles, loop order, tile skipping and dQ accumulation, and returns (dQ, dK, dV). It reuses the
forward executor's loops, loads, S and mask (reference._Executor); the ops that are the
backward's own are methods here, one per OpKind.

A workspace written by `accumulate` collects its partials while a kernel runs and adds them when
it ends: `atomic` in a shuffled order (atomics land in whatever order blocks finish, so the sum
may differ in its last bits from run to run), `ordered` in kv tile order (bit-identical every run).
"""
from __future__ import annotations

import numpy as np

from ..schedule.backward import build_backward_graph
from ..schedule.ops import OpKind
from ..schedule.passes import emission_order
from .forward import check_inputs, Executor, naive_attention
from ..mods.model import AUX_SINKS
from ..mods.numeric import dropout_keep, score_derivative
from ..spec import KernelSpec


def reference_backward(spec: KernelSpec, q, k, v, do, o=None, lse=None, kv_lens=None, rng=None, aux=None):
    """(dQ, dK, dV) of `spec`'s attention for the output gradient `do`, by `spec.backward`'s
    schedule in float64, and dsink (heads,) fourth when the spec has `sinks = per_head`. o and lse
    are the forward's (computed with naive_attention when None, or with the forward's graph when the
    spec modifies scores or masks); rng seeds the order of atomic adds; `aux` as reference_attention's."""
    q, k, v, lens = check_inputs(q, k, v, kv_lens)
    p = spec.problem
    if (o is None or lse is None) and p.mods.active:
        from .forward import reference_attention
        o, lse = reference_attention(spec, q, k, v, kv_lens=lens, aux=aux)
    elif o is None or lse is None:
        o, lse = naive_attention(q, k, v, p.mask, p.window_left, p.window_right, p.scale, kv_lens=lens)
    do, o, lse = (np.asarray(x, dtype=np.float64) for x in (do, o, lse))
    if do.shape != o.shape or o.shape != q.shape[:3] + (v.shape[3],) or lse.shape != q.shape[:3]:
        raise ValueError(f"do {do.shape}, o {o.shape}, lse {lse.shape} do not match q {q.shape} and v {v.shape}")
    graph = build_backward_graph(spec)
    graph.order = tuple(emission_order(graph))
    return _BackwardExecutor(graph, q, k, v, lens, do, o, lse, np.random.default_rng(rng), aux).run()


class _BackwardExecutor(Executor):
    def __init__(self, graph, q, k, v, kv_lens, do, o, lse, rng, aux=None):
        graph.sizes.setdefault("kv_groups", 1)
        super().__init__(graph, q, k, v, kv_lens, splits=None, aux=aux)
        self.do, self.o, self.lse, self.rng = do, o, lse, rng
        self.group = q.shape[1] // k.shape[1]
        shapes = {"D": q.shape[:3], "dQ": q.shape, "dK": k.shape, "dV": v.shape}   # k, v: kv heads
        shapes |= {f"{t}_accum": shapes[t] for t in ("dQ", "dK", "dV")}             # fp32 workspaces
        shapes["dsink"] = (q.shape[1],)
        self.hbm = {name: np.zeros(shape) for name, shape in shapes.items()}
        self.pending: list[tuple[float, str, slice, np.ndarray]] = []   # (order, workspace, rows, partial)

    def run(self):
        self.scope(None, {}, {})
        grads = self.hbm["dQ"], self.hbm["dK"], self.hbm["dV"]
        return grads + (self.hbm["dsink"],) if self.mods.sinks else grads

    def scope(self, loop, at, env):
        for name in self.g.children(loop):
            op = self.g.op(name)
            if op.kind is not OpKind.LOOP:
                getattr(self, op.kind.value)(op, at, env)
                continue
            for trip in self.trips(op, at):
                inner = {**at, **trip}
                block = dict(env) if op.grid else env
                if op.grid:   # a block's on-chip accumulators start at zero
                    self.init_block(op, inner, block)
                self.scope(name, inner, block)
            if loop is None:   # a kernel ends: its workspace adds have all landed
                self.flush()

    def init_block(self, op, at, env):
        rows = at[op.var][1] - at[op.var][0]
        B, H = self.q.shape[:2]
        for name, value in op.init:
            cols = self.v.shape[3] if name == "dV" else self.q.shape[3]
            env[name] = np.full((B, H, rows, cols), float(value))

    def flush(self):
        if any(order is None for order, *_ in self.pending):   # atomic: any order
            self.pending = [self.pending[i] for i in self.rng.permutation(len(self.pending))]
        else:
            self.pending.sort(key=lambda item: item[0])
        for _, tensor, rows, value in self.pending:
            self.add_to(tensor, rows, value)
        self.pending = []

    def add_to(self, tensor, rows, value):
        """hbm[tensor][..., rows, :] += value (B, H, rows, cols); a kv-head tensor sums its group's heads."""
        target = self.hbm[tensor]
        if target.shape[1] == value.shape[1]:
            target[:, :, rows] += value
            return
        for h in range(value.shape[1]):
            target[:, h // self.group, rows] += value[:, h]

    # -- ops, one method per OpKind (the shared ones are reference._Executor's)
    def load_o(self, op, at, env):
        env["O"] = self.o[:, :, slice(*at["q"])]

    def load_do(self, op, at, env):
        env["dO"] = self.do[:, :, slice(*at["q"])]

    def rowsum_d(self, op, at, env):
        env["D"] = (env["dO"] * env["O"]).sum(axis=-1)

    def load_lse_d(self, op, at, env):
        rows = slice(*at["q"])
        env["LSE"], env["D"] = self.lse[:, :, rows], self.hbm["D"][:, :, rows]

    def recompute_p(self, op, at, env):
        seen = np.isfinite(env["LSE"])[..., None]
        env["P"] = np.where(seen, np.exp(env["S"] - np.where(seen, env["LSE"][..., None], 0.0)), 0.0)

    def _grad(self, op, env, name, value):
        if op.variant == "accumulate":
            env[name] = env[name] + value
        else:
            env[f"{name}_part"] = value

    def mma_dv(self, op, at, env):
        kept = env["P"] * env["Z"] if "Z" in env else env["P"]
        self._grad(op, env, "dV", np.swapaxes(kept, -1, -2) @ env["dO"])

    def mma_dp(self, op, at, env):
        env["dP"] = env["dO"] @ np.swapaxes(env["V"], -1, -2)

    def softmax_grad(self, op, at, env):
        dp = env["dP"] * env["Z"] if "Z" in env else env["dP"]
        env["dS"] = env["P"] * (dp - env["D"][..., None])

    def dropout(self, op, at, env):
        """The forward's keep mask, regenerated from the same counters (scaled by 1 / (1 - p))."""
        env["Z"] = dropout_keep(self.mods, self.grid(at), self.aux)

    def score_mod_grad(self, op, at, env):
        env["dS"] = env["dS"] * score_derivative(self.mods, env["S_raw"], self.grid(at), self.aux)

    def sink_grad(self, op, at, env):
        rows = slice(*at["q"])
        sink = self.aux[AUX_SINKS][None, :, None]
        weight = np.exp(sink - self.lse[:, :, rows])   # the sink's probability in each row
        self.hbm["dsink"] -= (weight * env["D"]).sum(axis=(0, 2))

    def mma_dk(self, op, at, env):
        self._grad(op, env, "dK", self.scale * (np.swapaxes(env["dS"], -1, -2) @ env["Q"]))

    def mma_dq(self, op, at, env):
        self._grad(op, env, "dQ", self.scale * (env["dS"] @ env["K"]))

    def stage(self, op, at, env):
        """Registers -> shared memory for another warpgroup or the dQ writer: one NumPy thread keeps the value."""

    def accumulate(self, op, at, env):
        ordered = op.variant == "ordered"
        for access in op.hbm:
            grad = access.tensor.removesuffix("_accum")
            self.pending.append((at["kv"][0] if ordered else None, access.tensor, slice(*at[access.rows]),
                                 env[f"{grad}_part"]))

    def store_grad(self, op, at, env):
        access = op.hbm[0]
        rows = slice(*at[access.rows])
        if access.tensor in ("dK", "dV"):
            self.add_to(access.tensor, rows, env[access.tensor])
        else:
            self.hbm[access.tensor][:, :, rows] = env[access.tensor]

    def convert_grad(self, op, at, env):
        reads = [a for a in op.hbm if a.mode == "read"]
        for a in reads:
            rows = slice(*at[a.rows])
            self.hbm[a.tensor.removesuffix("_accum")][:, :, rows] = self.hbm[a.tensor][:, :, rows]
