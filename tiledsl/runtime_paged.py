"""Runtime of the decode family on a paged KV cache (`kv_cache = paged(page = N)`).

    o, lse = kernel(q, k_cache, v_cache, block_table, kv_lens)

Token-major, as serving frameworks hold them (tiledsl/serving_reference.py): q (batch, queries,
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

from dataclasses import replace

from .errors import RuntimeInputError
from .runtime import Shapes, _capturing, caller_stream
from .runtime_decode import MAX_GRID_YZ, DecodeKernel
from .serving_checks import check_paged
from .spec import DType
from .tensors import view


class PagedDecodeKernel(DecodeKernel):
    """A compiled flash-decoding kernel that reads K and V through a block table."""

    def __repr__(self) -> str:
        return f"<tiledsl.PagedDecodeKernel {self.name}>"

    def check_paged_inputs(self, q, k_cache, v_cache, block_table, kv_lens):
        """Views (q, k, v, table, kv_lens) with the kernel's stride order, and the Shapes."""
        p = self.spec.problem
        qv, kv, vv = view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache")
        for t in (qv, kv, vv):
            if len(t.shape) != 4:
                raise RuntimeInputError(f"{self.name}: {t.name} must be 4-d, got shape {t.shape} (q: (batch, queries, "
                                        "heads, d); caches: (pages, page size, kv heads, d))")
            if p.kv_fp8 and t is not qv:   # e4m3 bytes: 16-byte rows are strides of 16 elements
                from .kv_fp8 import check_fp8_kv
                check_fp8_kv(t, self.name)
                continue
            if t.dtype is not p.dtype:
                raise RuntimeInputError(f"{self.name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel "
                                        f"was built for {p.dtype.value}")
            if t.strides[3] != 1 or any(s % 8 for s in t.strides[:3]) or t.pointer % 16:
                raise RuntimeInputError(f"{self.name}: {t.name} needs a unit stride on head_dim and 16-byte aligned "
                                        f"rows (strides {t.strides} elements)")
        for t in (kv, vv):
            if t.device_id != qv.device_id:
                raise RuntimeInputError(f"{self.name}: q is on GPU {qv.device_id} but {t.name} on GPU {t.device_id}")
        batch, q_len, heads, dq = qv.shape
        num_pages, page_size, kv_heads, dk = kv.shape
        if page_size != p.kv_page_size:
            raise RuntimeInputError(f"{self.name}: built for pages of {p.kv_page_size} keys; k_cache has "
                                    f"{page_size} (shape {kv.shape})")
        if dq != p.head_dim_qk or dk != p.head_dim_qk or vv.shape[3] != p.head_dim_v:
            raise RuntimeInputError(f"{self.name}: built for head dims {p.head_dim_qk} / v {p.head_dim_v}; q has {dq}, "
                                    f"k_cache {dk}, v_cache {vv.shape[3]}")
        if vv.shape[:3] != kv.shape[:3]:
            raise RuntimeInputError(f"{self.name}: k_cache {kv.shape} and v_cache {vv.shape} disagree")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{self.name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        if q_len != p.queries_per_seq:
            raise RuntimeInputError(f"{self.name}: built for {p.queries_per_seq} queries per sequence, q has {q_len}")
        tv, lv = view(block_table, "block_table"), view(kv_lens, "kv_lens")
        if tv.dtype != "int32" or len(tv.shape) != 2 or tv.shape[0] != batch or tv.strides[1] != 1:
            raise RuntimeInputError(f"{self.name}: block_table must be int32 (batch = {batch}, max pages) with unit "
                                    f"stride along the pages, got {tv.dtype} {tv.shape} strides {tv.strides}")
        if lv.dtype != "int32" or lv.shape != (batch,) or lv.strides != (1,):
            raise RuntimeInputError(f"{self.name}: kv_lens must be a contiguous int32 array of shape ({batch},)")
        if tv.device_id != qv.device_id or lv.device_id != qv.device_id:
            raise RuntimeInputError(f"{self.name}: block_table and kv_lens must be on q's GPU {qv.device_id}")
        if _capturing(q):
            kv_len = tv.shape[1] * page_size   # no host reads under capture: split for the capacity
        else:
            _, lens = check_paged(block_table, kv_lens, num_pages, page_size)
            kv_len = int(lens.max()) if batch else 0
        shapes = Shapes(batch, heads, kv_heads, q_len, kv_len)
        if batch > MAX_GRID_YZ or kv_heads * self.row_tiles(shapes) > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch {batch} or kv_heads x row tiles exceeds {MAX_GRID_YZ}")
        # The decode kernel's stride order: (batch | page, head, query | slot).
        qk = replace(qv, shape=(batch, heads, q_len, dq), strides=(qv.strides[0], qv.strides[2], qv.strides[1], 1))
        kk = replace(kv, strides=(kv.strides[0], kv.strides[2], kv.strides[1], 1))
        vk = replace(vv, strides=(vv.strides[0], vv.strides[2], vv.strides[1], 1))
        return (qk, kk, vk, tv, lv), shapes

    def _outputs(self, q, shapes: Shapes, out, lse):
        """O (batch, queries, heads, dv) in q's dtype and LSE (batch, heads, queries) fp32."""
        p = self.spec.problem
        o_shape = (shapes.batch, shapes.q_len, shapes.heads, p.head_dim_v)
        lse_shape = (shapes.batch, shapes.heads, shapes.q_len)
        if type(q).__module__.startswith("torch"):
            import torch
            out = out if out is not None else torch.empty(o_shape, dtype=q.dtype, device=q.device)
            lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        else:
            from .runtime import _cupy
            cupy = _cupy()
            if p.dtype is DType.BF16 and out is None:
                raise RuntimeInputError(f"{self.name}: CuPy has no bfloat16 dtype; pass out= (e.g. a PyTorch tensor)")
            out = out if out is not None else cupy.empty(o_shape, dtype=cupy.float16)
            lse = lse if lse is not None else cupy.empty(lse_shape, dtype=cupy.float32)
        ov, lv = view(out, "out"), view(lse, "lse")
        if ov.shape != o_shape or ov.dtype is not p.dtype or ov.strides[3] != 1 or any(s % 8 for s in ov.strides[:3]):
            raise RuntimeInputError(f"{self.name}: out must be {o_shape} {p.dtype.value} with unit stride on head_dim "
                                    f"and 16-byte aligned rows, got {ov.shape}")
        if lv.shape != lse_shape or lv.dtype is not DType.FP32 or lv.strides != (shapes.heads * shapes.q_len, shapes.q_len, 1):
            raise RuntimeInputError(f"{self.name}: lse must be a contiguous fp32 array of shape {lse_shape}")
        ok = replace(ov, shape=(shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v),
                     strides=(ov.strides[0], ov.strides[2], ov.strides[1], 1))
        return out, lse, ok, lv

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
