"""Runtime of the fa2 (mma.sync) family on a paged KV cache (`kv_cache = paged(page = N)`): chunked
prefill, a chunk of q_len queries against a sequence's whole cached history.

    o, lse = kernel(q, k_cache, v_cache, block_table, kv_lens)

Token-major, as serving frameworks hold them (tiledsl/reference/serving.py): q (batch, queries,
heads, d), k_cache / v_cache (pages, page size, kv heads, d / dv), block_table int32 (batch, max
pages per sequence), kv_lens int32 (batch,). The chunk's queries are the last q_len positions of
each sequence (masks aligned bottom-right). O comes back (batch, queries, heads, dv) in q's dtype,
LSE (batch, heads, queries) fp32. The kernel is the fa2 kernel; only its views differ: q and O are
handed in with (batch, head, query) strides, the caches with (page, kv head, slot) strides.

The block table and kv_lens are read by the kernel: runtime/paged_views.py.
"""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..hw import MAX_GRID_YZ
from .inputs import Shapes
from .kernel import Kernel
from .launch import CallBuilder
from .paged_views import paged_outputs, paged_views
from .tensors import TensorView


class PagedPrefillKernel(Kernel):
    """A compiled fa2 kernel that reads K and V through a block table."""

    CALL = ("q", "k_cache", "v_cache", "block_table", "kv_lens", "out", "lse")

    def __repr__(self) -> str:
        return f"<tiledsl.PagedPrefillKernel {self.name}>"

    def __call__(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, *,
                 validate: bool | None = None):
        return self.run_call((q, k_cache, v_cache, block_table, kv_lens, out, lse), (validate,), validate=validate)

    def build_call(self, b: CallBuilder, validate: bool | None = None, kv_len: int | None = None) -> None:
        from dataclasses import replace
        (qv, kv, vv, tv, lens), shapes = paged_views(b, self.spec.problem, validate, self.bounds_indices)
        if kv_len is not None:
            shapes = replace(shapes, kv_len=min(int(kv_len), shapes.kv_len))
        if shapes.batch * shapes.heads > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch*heads = {shapes.batch * shapes.heads} exceeds {MAX_GRID_YZ} "
                                    "per launch")
        ov, lv = paged_outputs(b, self.spec.problem, shapes, 5)
        self.add_paged_launches(b, qv, kv, vv, ov, lv, lens, tv, shapes)

    def add_paged_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                           lse: TensorView, kv_lens: TensorView, table: TensorView, shapes: Shapes) -> None:
        tile_q = self.plan.launch.tile_q
        blocks = -(-shapes.q_len // tile_q) * shapes.batch * shapes.heads
        if blocks == 0:
            return
        args = self.attention_args(q, k, v, o, lse, kv_lens, shapes, like=b.like, block_table=table,
                                   table_stride=table.strides[0], table_pages=table.shape[1], num_pages=k.shape[0],
                                   order_groups=self.order_groups_for(shapes, b.device_id))
        launch = self.plan.launch
        b.launch(self.function(b.device_id), (blocks, 1, 1), launch.threads, launch.smem_bytes, args, self.name)

    def bind(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks)."""
        head = (q, k_cache, v_cache, block_table, kv_lens)
        if out is None or lse is None:
            out, lse = self.prepare_call(head + (out, lse), immediate=True).results
        tensors = head + (out, lse)
        call = self.prepare_call(tensors)
        return (lambda: call(*tensors)), out, lse
