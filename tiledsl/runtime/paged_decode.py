"""Runtime of the decode family on a paged KV cache (`kv_cache = paged(page = N)`).

    o, lse = kernel(q, k_cache, v_cache, block_table, kv_lens)

Token-major, as serving frameworks hold them (tiledsl/reference/serving.py): q (batch, queries,
heads, d), k_cache / v_cache (pages, page size, kv heads, d / dv), block_table int32 (batch, max
pages per sequence), kv_lens int32 (batch,). O comes back (batch, queries, heads, dv) in q's dtype,
LSE (batch, heads, queries) fp32. The kernel is the decode kernel; only its views differ: q and O
are handed in with (batch, head, query) strides, the caches with (page, kv head, slot) strides.

The block table and kv_lens are read by the kernel; the split count is chosen for the table's
capacity (max pages x page size): runtime/paged_views.py. A planned call (tiledsl/serving/plan.py)
knows the host lengths and chooses for them.
"""
from __future__ import annotations

from .decode import DecodeKernel, DecodeWorkspace, number_or_none, tensor_or_none
from .launch import CallBuilder
from .paged_views import paged_outputs, paged_views


class PagedDecodeKernel(DecodeKernel):
    """A compiled flash-decoding kernel that reads K and V through a block table."""

    CALL = ("q", "k_cache", "v_cache", "block_table", "kv_lens", "out", "lse", "k_scale", "v_scale")

    def __repr__(self) -> str:
        return f"<tiledsl.PagedDecodeKernel {self.name}>"

    def build_call(self, b: CallBuilder, validate: bool | None = None, k_scale=None, v_scale=None,
                   workspace: DecodeWorkspace | None = None, kv_len: int | None = None) -> None:
        """`kv_len`: the longest sequence the launch is sized for (None: the table's capacity)."""
        from dataclasses import replace
        (qv, kv, vv, tv, lens), shapes = paged_views(b, self.spec.problem, validate, self.bounds_indices)
        if kv_len is not None:
            shapes = replace(shapes, kv_len=min(int(kv_len), shapes.kv_len))
        self.check_rows(shapes)
        ov, lv = paged_outputs(b, self.spec.problem, shapes, 5)
        scales = self.scale_views(b, 7, k_scale, v_scale, shapes.kv_heads)
        self.add_launches(b, qv, kv, vv, ov, lv, lens, shapes, table=tv, scales=scales, workspace=workspace)

    def __call__(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, *, k_scale=None,
                 v_scale=None, validate: bool | None = None, aux=None):
        tensors = (q, k_cache, v_cache, block_table, kv_lens, out, lse, tensor_or_none(k_scale),
                   tensor_or_none(v_scale)) + self.aux_tensors(aux)
        return self.run_call(tensors, (number_or_none(k_scale), number_or_none(v_scale), validate), validate=validate,
                             k_scale=k_scale, v_scale=v_scale)

    def bind(self, q, k_cache, v_cache, block_table, kv_lens, out=None, lse=None, *, k_scale=None, v_scale=None,
             aux=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks).
        An FP8 (kv_dtype = e4m3) kernel takes float8_e4m3fn caches and their scales."""
        options = {"k_scale": k_scale, "v_scale": v_scale}
        scales = (tensor_or_none(k_scale), tensor_or_none(v_scale)) + self.aux_tensors(aux)
        head = (q, k_cache, v_cache, block_table, kv_lens)
        if out is None or lse is None:
            out, lse = self.prepare_call(head + (out, lse) + scales, immediate=True, **options).results
        tensors = head + (out, lse) + scales
        call = self.prepare_call(tensors, **options)
        return (lambda: call(*tensors)), out, lse
