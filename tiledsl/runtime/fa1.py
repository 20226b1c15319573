"""Runtime for the FA1 family: one thread block per (batch, head), and a per-call workspace in HBM
for the running state that FA1 round-trips at every kv step.

The workspace holds O (fp32, normalised) shaped (batch, heads, q_len, dv) and m, l (fp32) shaped
(batch, heads, q_len). It is never initialised: the kernel starts each q tile from the empty state
on the first kv tile it sees, and rows that see no key are written directly (O = 0, LSE = -inf).
"""
from __future__ import annotations

from .kernel import Kernel
from .inputs import Shapes
from .device import allocate, data_pointer
from .tensors import TensorView


class Fa1Kernel(Kernel):
    """A compiled FA1 kernel; called like any Kernel: `o, lse = kernel(q, k, v)`."""

    def grid(self, shapes: Shapes) -> tuple[int, int, int]:
        """kv outer parallelises over batch * heads only: FA1's defining limitation."""
        return (shapes.batch * shapes.heads, 1, 1)

    def workspace(self, shapes: Shapes, like, stream):
        """(O fp32 (batch, heads, q_len, dv), m fp32 (batch, heads, q_len), l fp32 (batch, heads, q_len)),
        in `like`'s framework on `stream` (runtime.allocate)."""
        rows = (shapes.batch, shapes.heads, shapes.q_len)
        return (allocate(like, rows + (self.spec.problem.head_dim_v,), "float32", stream),
                allocate(like, rows, "float32", stream), allocate(like, rows, "float32", stream))

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        import numpy as np
        if shapes.batch * shapes.heads == 0 or shapes.q_len == 0:
            return
        fn = self.function()
        grid = self.grid(shapes)
        # Allocated on the stream that runs the kernel: both frameworks' pools hand freed memory only
        # to later work on the same stream, so dropping the workspace when this returns is safe (and
        # torch's allocator is capture-aware, so the launch can be captured in a CUDA graph).
        workspace = self.workspace(shapes, q.owner, stream)
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes) + tuple(np.uintp(data_pointer(w))
                                                                             for w in workspace)
        self.launch_function(fn, grid, args, q.device_id, stream)
