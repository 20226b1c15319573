"""Runtime of the decode family: one launch per call.

With one split each block writes the final O and LSE itself. With several, each split writes its
normalised O (fp32) and LSE to a workspace of (batch * heads * queries, splits, dv) floats, kept
on the kernel and grown on demand, and the last split of each (batch, kv head, row tile) to
finish merges them; it finds out through an int32 ticket counter per group, zeroed once here and
reset by the merging block. `split kv = auto` picks the count at launch for the device in hand;
the count and the reason are kept on the kernel (`last_splits`, `last_split_reason`).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import LaunchError, RuntimeInputError
from ..hw import MAX_GRID_YZ
from ..schedule.splits import choose_splits
from ..spec import AUTO
from .device import allocate, caller_stream, cupy_module, data_pointer, device_limits
from .inputs import Shapes
from .kernel import Kernel
from .tensors import TensorView


def constant(plan, name: str):
    """The value of the plan's constant `name`. Here, not in lower_decode, so that a decode kernel
    loaded from a warm record (runtime/warm.py) runs without importing the front end (lark, networkx)."""
    for c in plan.constants:
        if c.name == name:
            return c.value
    raise KeyError(name)
# Per-block start-up cost, in tile-times, for the wave model below: a block's first tile waits
# a full memory latency with nothing else of the block in flight.


class DecodeKernel(Kernel):
    """A compiled flash-decoding kernel: `o, lse = kernel(q, k, v, kv_lens=None)` with q
    (batch, heads, queries, d), k/v (batch, kv_heads, kv_len, d/dv), heads a multiple of kv_heads."""

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self.last_splits: int | None = None
        self.last_split_reason: str = ""
        self._workspace = None   # (o_part, lse_part, rows x splits, device), grown on demand
        self._counters = None    # (int32 ticket per (batch, kv head, row tile), count, device), zero between launches

    def __repr__(self) -> str:
        return f"<tiledsl.DecodeKernel {self.name}>"

    def splits_for(self, shapes: Shapes, device_id: int = 0) -> tuple[int, str]:
        """The split count of a launch: the spec's, or for `auto` choose_splits on this device."""
        chosen = self.spec.schedule.split_kv
        if chosen != AUTO:
            return int(chosen), f"split kv = {chosen} (from the spec)"
        tile_kv = constant(self.plan, "BC")
        row_tiles = self.row_tiles(shapes)
        sm_count = device_limits(device_id).sm_count
        return choose_splits(shapes.batch, shapes.kv_heads * row_tiles, shapes.kv_len, tile_kv,
                             sm_count, self.slots(device_id) // sm_count)

    def row_tiles(self, shapes: Shapes) -> int:
        rows = (shapes.heads // shapes.kv_heads) * shapes.q_len
        return -(-rows // constant(self.plan, "ROWS"))

    def check_inputs(self, q: TensorView, k: TensorView, v: TensorView, kv_lens: TensorView | None) -> Shapes:
        if self.spec.problem.kv_fp8:   # e4m3 bytes: checked here, then the shape rules as for 16-bit K/V
            from .kv_fp8 import check_fp8_kv
            dtype = self.spec.problem.dtype
            k, v = (replace(check_fp8_kv(t, self.name), dtype=dtype) for t in (k, v))
        shapes = super().check_inputs(q, k, v, kv_lens)
        wanted = self.spec.problem.queries_per_seq
        if shapes.q_len != wanted:
            raise RuntimeInputError(f"{self.name}: built for {wanted} queries per sequence, q has {shapes.q_len}")
        if shapes.batch > MAX_GRID_YZ or shapes.kv_heads * self.row_tiles(shapes) > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch {shapes.batch} or kv_heads x row tiles exceeds {MAX_GRID_YZ}")
        return shapes

    # Workspace and counters are allocated in the inputs' framework on the launch stream
    # (runtime.allocate) and kept: a later launch of the same or a smaller shape allocates nothing,
    # so it can be captured in a CUDA graph once an eager call has run.
    def _counters_for(self, groups: int, q: TensorView, stream):
        have = self._counters
        if have is None or have[1] < groups or have[2] != q.device_id:
            have = (allocate(q.owner, (groups,), "int32", stream, zero=True), groups, q.device_id)
            self._counters = have
        return have[0]

    def _workspace_for(self, rows: int, splits: int, q: TensorView, stream):
        dv = self.spec.problem.head_dim_v
        need = rows * splits
        have = self._workspace
        if have is None or have[2] < need or have[3] != q.device_id:
            have = (allocate(q.owner, (need * dv,), "float32", stream), allocate(q.owner, (need,), "float32", stream),
                    need, q.device_id)
            self._workspace = have
        return have[0], have[1]

    def launch(self, q: TensorView, k: TensorView, v: TensorView, o: TensorView, lse: TensorView,
               kv_lens: TensorView | None, shapes: Shapes, stream=None) -> None:
        self.bind_views(q, k, v, o, lse, kv_lens, shapes, stream)()

    def scale_views(self, q, k_scale, v_scale, kv_heads: int) -> tuple:
        """() for a 16-bit cache; for an FP8 one the (k, v) scale views (kv_fp8.check_scale), Python
        floats (None: 1.0) first copied to q's device. Scales given to a 16-bit kernel are refused."""
        p = self.spec.problem
        if not p.kv_fp8:
            if k_scale is not None or v_scale is not None:
                raise RuntimeInputError(f"{self.name}: k_scale / v_scale are for an FP8 (float8_e4m3fn) KV cache; "
                                        f"this kernel reads {p.dtype.value} K/V")
            return ()
        from .kv_fp8 import check_scale, scale_arrays
        ks, vs = scale_arrays(k_scale, v_scale, p.kv_scale, kv_heads, q.owner)
        return (check_scale(ks, "k_scale", p.kv_scale, kv_heads, q.device_id, self.name),
                check_scale(vs, "v_scale", p.kv_scale, kv_heads, q.device_id, self.name))

    def bind_views(self, q, k, v, o, lse, kv_lens, shapes: Shapes, stream=None, table=None, scales=()):
        """A no-argument function that launches this decode on these (checked) views: the split
        count, workspace and argument tuples are computed once (benchmarks time only launches).
        `table` is a paged kernel's block table (runtime/paged_decode.py); its k, v views then hold
        (page, kv head, slot) strides. `scales` (scale_views) are an FP8 cache's (k, v) scales; its
        k, v strides go to the kernel in pairs of bytes (kv_fp8.kernel_strides)."""
        import numpy as np
        cupy = cupy_module()
        fn = self.function()
        plan = self.plan
        splits, reason = self.splits_for(shapes, q.device_id)
        self.last_splits, self.last_split_reason = splits, reason
        if shapes.batch * shapes.heads * shapes.q_len == 0:
            return lambda: None
        row_tiles = self.row_tiles(shapes)
        rows = shapes.batch * shapes.heads * shapes.q_len
        grid = (splits, shapes.kv_heads * row_tiles, shapes.batch)
        if splits > 1:
            o_part, lse_part = self._workspace_for(rows, splits, q, stream)
            counters = self._counters_for(grid[1] * grid[2], q, stream)
            o_part_ptr, lse_part_ptr, counters_ptr = map(data_pointer, (o_part, lse_part, counters))
        else:
            o_part = lse_part = counters = None
            o_part_ptr = lse_part_ptr = counters_ptr = 0
        i64, i32 = np.int64, np.int32
        if self.spec.problem.kv_fp8:
            from .kv_fp8 import kernel_strides
            k, v = kernel_strides(k), kernel_strides(v)
        args = (np.uintp(q.pointer), np.uintp(k.pointer), np.uintp(v.pointer), np.uintp(o.pointer),
                np.uintp(lse.pointer), np.uintp(o_part_ptr), np.uintp(lse_part_ptr), np.uintp(counters_ptr),
                np.uintp(kv_lens.pointer if kv_lens else 0),
                *((np.uintp(table.pointer), i64(table.strides[0])) if table is not None else ()),
                *(np.uintp(s.pointer) for s in scales),
                i32(shapes.q_len), i32(shapes.kv_len), i32(shapes.heads), i32(shapes.heads // shapes.kv_heads),
                i32(row_tiles), i32(splits),
                *(i64(s) for s in q.strides[:3]), *(i64(s) for s in k.strides[:3]),
                *(i64(s) for s in v.strides[:3]), *(i64(s) for s in o.strides[:3]))
        threads, smem = plan.launch.threads, plan.launch.smem_bytes
        device = q.device_id
        # the views own the memory for the closure
        keep = (q, k, v, o, lse, kv_lens, table, o_part, lse_part, counters, scales)

        def run():
            _ = keep
            try:
                with cupy.cuda.Device(device):
                    fn(grid, (threads, 1, 1), args, shared_mem=smem, stream=stream)
            except Exception as err:
                raise LaunchError(f"{self.name} (grid {grid}, {threads} threads, {smem} B shared, "
                                  f"{splits} splits): launch failed: {err}") from None
        return run

    def bind(self, q, k, v, kv_lens=None, out=None, lse=None, *, k_scale=None, v_scale=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks).
        An FP8 (kv_dtype = e4m3) kernel takes k, v as float8_e4m3fn and their scales."""
        views, shapes, out, lse = self.prepare(q, k, v, kv_lens, out, lse)
        scales = self.scale_views(views[0], k_scale, v_scale, shapes.kv_heads)
        run = self.bind_views(*views, shapes, caller_stream(q), scales=scales)
        return run, out, lse

    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None, *, k_scale=None, v_scale=None):
        run, out, lse = self.bind(q, k, v, kv_lens, out, lse, k_scale=k_scale, v_scale=v_scale)
        run()
        return out, lse
