"""Runtime for the FA1 family: one thread block per (batch, head), and a per-call workspace in HBM
for the running state that FA1 round-trips at every kv step.

The workspace holds O (fp32, normalised) shaped (batch, heads, q_len, dv) and m, l (fp32) shaped
(batch, heads, q_len). It is never initialised: the kernel starts each q tile from the empty state
on the first kv tile it sees, and rows that see no key are written directly (O = 0, LSE = -inf).
"""
from __future__ import annotations

from .inputs import Shapes
from .kernel import Kernel
from .launch import CallBuilder
from .tensors import TensorView


class Fa1Kernel(Kernel):
    """A compiled FA1 kernel; called like any Kernel: `o, lse = kernel(q, k, v)`."""

    def grid(self, shapes: Shapes) -> tuple[int, int, int]:
        """kv outer parallelises over batch * heads only: FA1's defining limitation."""
        return (shapes.batch * shapes.heads, 1, 1)

    def add_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                     lse: TensorView, kv_lens: TensorView | None, shapes: Shapes) -> None:
        if shapes.batch * shapes.heads == 0 or shapes.q_len == 0:
            return
        # The workspace (O fp32 (batch, heads, q_len, dv), m and l fp32 (batch, heads, q_len)) is
        # allocated per call from the inputs' framework on the launch stream: both frameworks' pools
        # hand freed memory only to later work on the same stream, so dropping it after the launch is
        # safe (and torch's allocator is capture-aware).
        rows = (shapes.batch, shapes.heads, shapes.q_len)
        workspace = (b.allocate("o_partial", rows + (self.spec.problem.head_dim_v,), "float32"),
                     b.allocate("m", rows, "float32"), b.allocate("l", rows, "float32"))
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes, like=b.like,
                                   **dict(zip(("o_state", "m_state", "l_state"), workspace)))
        launch = self.plan.launch
        b.launch(self.function(b.device_id), self.grid(shapes), launch.threads, launch.smem_bytes, args, self.name)
