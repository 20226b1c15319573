"""Runtime for the FA1 family: one thread block per (batch, head), and a per-call workspace in HBM
for the running state that FA1 round-trips at every kv step.

The workspace holds O (fp32, normalised) shaped (batch, heads, q_len, dv) and m, l (fp32) shaped
(batch, heads, q_len). It is never initialised: the kernel starts each q tile from the empty state
on the first kv tile it sees, and rows that see no key are written directly (O = 0, LSE = -inf).
"""
from __future__ import annotations

import contextlib

from .runtime import Kernel, Shapes, _cupy
from .tensors import TensorView


class Fa1Kernel(Kernel):
    """A compiled FA1 kernel; called like any Kernel: `o, lse = kernel(q, k, v)`."""

    def grid(self, shapes: Shapes) -> tuple[int, int, int]:
        """kv outer parallelises over batch * heads only: FA1's defining limitation."""
        return (shapes.batch * shapes.heads, 1, 1)

    def workspace(self, shapes: Shapes, device_id: int):
        """(O fp32 (batch, heads, q_len, dv), m fp32 (batch, heads, q_len), l fp32 (batch, heads, q_len))."""
        cupy = _cupy()
        rows = (shapes.batch, shapes.heads, shapes.q_len)
        with cupy.cuda.Device(device_id):
            return (cupy.empty(rows + (self.spec.problem.head_dim_v,), dtype=cupy.float32),
                    cupy.empty(rows, dtype=cupy.float32), cupy.empty(rows, dtype=cupy.float32))

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        import numpy as np
        cupy = _cupy()
        if shapes.batch * shapes.heads == 0 or shapes.q_len == 0:
            return
        fn = self.function()
        grid = self.grid(shapes)
        # Allocated on the stream that runs the kernel: CuPy's pool hands freed memory only to later
        # work on the same stream, so dropping the workspace when this returns is safe.
        with cupy.cuda.Device(q.device_id), (stream if stream is not None else contextlib.nullcontext()):
            o_state, m_state, l_state = self.workspace(shapes, q.device_id)
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes) + (
            np.uintp(o_state.data.ptr), np.uintp(m_state.data.ptr), np.uintp(l_state.data.ptr))
        self.launch_function(fn, grid, args, q.device_id, stream)
