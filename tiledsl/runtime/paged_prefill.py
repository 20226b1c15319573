"""Runtime of the fa2 (mma.sync) family on a paged KV cache (`kv_cache = paged(page = N)`): chunked
prefill, a chunk of q_len queries against a sequence's whole cached history.

    o, lse = kernel(q, k_cache, v_cache, block_table, kv_lens)

Token-major, as serving frameworks hold them (tiledsl/reference/serving.py): q (batch, queries,
heads, d), k_cache / v_cache (pages, page size, kv heads, d / dv), block_table int32 (batch, max
pages per sequence), kv_lens int32 (batch,). The chunk's queries are the last q_len positions of
each sequence (masks aligned bottom-right). O comes back (batch, queries, heads, dv) in q's dtype,
LSE (batch, heads, queries) fp32. The kernel is the fa2 kernel; only its views differ: q and O are
handed in with (batch, head, query) strides, the caches with (page, kv head, slot) strides.

The block table and kv_lens are checked on the host (serving_checks.check_paged) before every
launch: an entry out of range or a kv_len over the table's capacity is refused, never read out of
bounds. Under CUDA graph capture (no host reads) the check is skipped.
"""
from __future__ import annotations

import numpy as np

from ..errors import RuntimeInputError
from .paged_views import paged_outputs, paged_views
from ..hw import MAX_GRID_YZ
from .inputs import Shapes
from .kernel import Kernel
from .device import caller_stream


class PagedPrefillKernel(Kernel):
    """A compiled fa2 kernel that reads K and V through a block table."""

    def __repr__(self) -> str:
        return f"<tiledsl.PagedPrefillKernel {self.name}>"

    def check_paged_inputs(self, q, k_cache, v_cache, block_table, kv_lens):
        """Views (q, k, v, table, kv_lens) in the kernel's stride order, and the Shapes."""
        views, shapes = paged_views(self.name, self.spec.problem, q, k_cache, v_cache, block_table, kv_lens)
        if shapes.batch * shapes.heads > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch*heads = {shapes.batch * shapes.heads} exceeds {MAX_GRID_YZ} "
                                    "per launch")
        return views, shapes

    def _outputs(self, q, shapes: Shapes, out, lse):
        return paged_outputs(self.name, self.spec.problem, q, shapes, out, lse)

    def bind(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, stream=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks)."""
        (qv, kv, vv, tv, lens), shapes = self.check_paged_inputs(q, k_cache, v_cache, block_table, kv_lens)
        out, lse, ov, lv = self._outputs(q, shapes, out, lse)
        stream = stream or caller_stream(q)
        tile_q = self.plan.launch.tile_q
        blocks = -(-shapes.q_len // tile_q) * shapes.batch * shapes.heads
        if blocks == 0:
            return (lambda: None), out, lse
        base = self.attention_args(qv, kv, vv, ov, lv, lens, shapes)
        # fa2.cu.j2's paged signature: the block table and its row stride follow kv_lens.
        args = base[:6] + (np.uintp(tv.pointer), np.int64(tv.strides[0])) + base[6:] + (
            np.int32(self.order_groups_for(shapes, qv.device_id)),)
        fn = self.function()
        return (lambda: self.launch_function(fn, (blocks, 1, 1), args, qv.device_id, stream)), out, lse

    def __call__(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None):
        run, out, lse = self.bind(q, k_cache, v_cache, block_table, kv_lens, out, lse)
        run()
        return out, lse
