"""Runtime of the decode family on a paged KV cache (`kv_cache = paged(page = N)`).

    o, lse = kernel(q, k_cache, v_cache, block_table, kv_lens)

Token-major, as serving frameworks hold them (tiledsl/reference/serving.py): q (batch, queries,
heads, d), k_cache / v_cache (pages, page size, kv heads, d / dv), block_table int32 (batch, max
pages per sequence), kv_lens int32 (batch,). O comes back (batch, queries, heads, dv) in q's dtype,
LSE (batch, heads, queries) fp32. The kernel is the decode kernel; only its views differ: q and O
are handed in with (batch, head, query) strides, the caches with (page, kv head, slot) strides.

The block table and kv_lens are checked on the host (serving_checks.check_paged) before every
launch: an entry out of range or a kv_len over the table's capacity is refused, never read out of
bounds. Under CUDA graph capture (no host reads) the check is skipped and the split count is
chosen for the table's capacity.
"""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..hw import MAX_GRID_YZ
from .decode import DecodeKernel
from .device import caller_stream
from .inputs import Shapes
from .paged_views import paged_outputs, paged_views


class PagedDecodeKernel(DecodeKernel):
    """A compiled flash-decoding kernel that reads K and V through a block table."""

    def __repr__(self) -> str:
        return f"<tiledsl.PagedDecodeKernel {self.name}>"

    def check_paged_inputs(self, q, k_cache, v_cache, block_table, kv_lens):
        """Views (q, k, v, table, kv_lens) with the kernel's stride order, and the Shapes."""
        views, shapes = paged_views(self.name, self.spec.problem, q, k_cache, v_cache, block_table, kv_lens)
        if shapes.q_len != self.spec.problem.queries_per_seq:
            raise RuntimeInputError(f"{self.name}: built for {self.spec.problem.queries_per_seq} queries per sequence, "
                                    f"q has {shapes.q_len}")
        if shapes.batch > MAX_GRID_YZ or shapes.kv_heads * self.row_tiles(shapes) > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch {shapes.batch} or kv_heads x row tiles exceeds {MAX_GRID_YZ}")
        return views, shapes

    def _outputs(self, q, shapes: Shapes, out, lse):
        return paged_outputs(self.name, self.spec.problem, q, shapes, out, lse)

    def bind(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, *, k_scale=None, v_scale=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks).
        An FP8 (kv_dtype = e4m3) kernel takes float8_e4m3fn caches and their scales."""
        (qv, kv, vv, tv, lens), shapes = self.check_paged_inputs(q, k_cache, v_cache, block_table, kv_lens)
        out, lse, ov, lv = self._outputs(q, shapes, out, lse)
        scales = self.scale_views(qv, k_scale, v_scale, shapes.kv_heads)
        run = self.bind_views(qv, kv, vv, ov, lv, lens, shapes, caller_stream(q), table=tv, scales=scales)
        return run, out, lse

    def __call__(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, *, k_scale=None, v_scale=None):
        run, out, lse = self.bind(q, k_cache, v_cache, block_table, kv_lens, out, lse, k_scale=k_scale, v_scale=v_scale)
        run()
        return out, lse
