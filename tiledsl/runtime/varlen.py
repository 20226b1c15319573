"""Runtime of the Hopper family over packed sequences (`layout = varlen`, templates/hopper_varlen.cu.j2).

Tensors are token-major, as FlashAttention's flash_attn_varlen_func takes them: q (total_q, heads,
d), k (total_k, kv_heads, d), v (total_k, kv_heads, dv); cu_seqlens_q / cu_seqlens_k int32
(batch + 1,) on the GPU; sequence b is rows cu[b]:cu[b + 1]. Outputs: O (total_q, heads, dv) in
q's dtype and LSE fp32 (heads, total_q) (FlashAttention's varlen LSE layout; natural log).

Each TMA map sees a packed tensor as one batch entry of `total` rows: (1, heads, total, d) with
the row stride heads * d, so the hopper kernel's 4-d copies read it unchanged; a work item adds its
sequence's first row. The work list -- (sequence, query tile) pairs, the tiles that see the most
keys first -- is built on the host from host copies of cu_seqlens, so every call syncs on those
copies (and uploads the list, cached per cu_seqlens contents)."""
from __future__ import annotations

from collections import OrderedDict

from ..errors import RuntimeInputError
from .device import capturing, cupy_module, is_torch, caller_stream
from .hopper import PERSISTENT_MASKED_TILES, HopperKernel
from .serving_checks import check_varlen, host
from ..spec import DType, Mask
from .tensor_maps import tensor_map
from .tensors import TensorView, view

WORK_LISTS = 16   # uploaded work lists kept per kernel (one per recent cu_seqlens pair)


def visible_keys(q0: int, rows: int, seq_q: int, seq_kv: int, mask: Mask, left: int, right: int) -> int:
    """Keys that query rows q0 .. q0 + rows - 1 of a sequence can see at all (bottom-right aligned):
    the cost of a work item, by which the list is ordered."""
    diag = seq_kv - seq_q
    lo, hi = 0, seq_kv
    if mask is Mask.CAUSAL:
        hi = min(hi, q0 + rows + diag)
    elif mask is Mask.WINDOW:
        hi = min(hi, q0 + rows + diag + right)
        lo = max(lo, q0 + diag - left)
    return max(hi - lo, 0)


def work_list(q_lens, k_lens, tile_q: int, mask: Mask, left: int = 0, right: int = 0):
    """(sequence, query tile) int32 pairs (n, 2): the costliest sequences first (keys seen by all
    their tiles), each one's tiles together, those that see the most keys first. A sequence at a
    time keeps few heads' K and V in L2 (the blocks in flight share them), and the short sequences
    fill the tail; sequences without queries give none."""
    import numpy as np
    entries = []
    for b, (nq, nk) in enumerate(zip(q_lens.tolist(), k_lens.tolist())):
        costs = [visible_keys(t * tile_q, tile_q, nq, nk, mask, left, right) for t in range(-(-nq // tile_q))]
        entries += [(-sum(costs), b, -cost, -t) for t, cost in enumerate(costs)]
    entries.sort()
    return np.array([(b, -t) for _, b, _, t in entries], dtype=np.int32).reshape(-1, 2)


def packed_view(t: TensorView) -> TensorView:
    """A packed (total, heads, d) tensor as the (batch 1, heads, rows, d) the tensor maps describe."""
    total, heads, d = t.shape
    return TensorView(t.name, t.pointer, (1, heads, total, d), (total * t.strides[0], t.strides[1], t.strides[0], 1),
                      t.dtype, t.device_id, t.owner)


class VarlenHopperKernel(HopperKernel):
    """A compiled varlen hopper kernel: `o, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)`
    (module docstring for the layouts). `max_seqlen_q/k`, when given, are checked against the
    lengths (the kernel itself needs neither). Runs on the caller's stream; not capturable in a
    CUDA graph, since the work list is built from host copies of cu_seqlens."""

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self._work: OrderedDict = OrderedDict()

    def check_packed(self, q: TensorView, k: TensorView, v: TensorView) -> tuple[int, int]:
        """(heads, kv_heads) after checking the packed tensors; errors name the tensor."""
        p = self.spec.problem
        for t, dim in ((q, p.head_dim_qk), (k, p.head_dim_qk), (v, p.head_dim_v)):
            if len(t.shape) != 3:
                raise RuntimeInputError(f"{self.name}: {t.name} must be 3-d (total tokens, heads, head_dim), got "
                                        f"shape {t.shape}")
            if t.dtype is not p.dtype:
                raise RuntimeInputError(f"{self.name}: {t.name} is {getattr(t.dtype, 'value', t.dtype)}, the kernel "
                                        f"was built for {p.dtype.value}")
            if t.shape[2] != dim:
                raise RuntimeInputError(f"{self.name}: {t.name} has head_dim {t.shape[2]}, the kernel was built for "
                                        f"{dim}")
            if t.strides[2] != 1 or any(s % 8 for s in t.strides[:2]) or t.pointer % 16:
                raise RuntimeInputError(f"{self.name}: {t.name} needs a unit stride on head_dim and 16-byte aligned "
                                        f"rows "
                                        f"(strides {t.strides} elements)")
            if t.device_id != q.device_id:
                raise RuntimeInputError(f"{self.name}: q is on GPU {q.device_id} but {t.name} on GPU {t.device_id}")
        heads, kv_heads = q.shape[1], k.shape[1]
        if v.shape[:2] != k.shape[:2]:
            raise RuntimeInputError(f"{self.name}: k {k.shape} and v {v.shape} must hold the same (total_k, kv_heads)")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{self.name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        return heads, kv_heads

    def _device_offsets(self, cu, name: str, batch: int, device_id: int) -> TensorView:
        t = view(cu, name)
        if t.dtype != "int32" or t.shape != (batch + 1,) or t.strides != (1,) or t.device_id != device_id:
            raise RuntimeInputError(f"{self.name}: {name} must be a contiguous int32 GPU array of shape ({batch + 1},) "
                                    f"on GPU {device_id}")
        return t

    def _work_list(self, like, cu_q, cu_k, q_lens, k_lens, stream):
        """The uploaded work list for these offsets (and the longest item's kv tiles)."""
        p = self.spec.problem
        key = (cu_q.tobytes(), cu_k.tobytes(), is_torch(like), view(like, "q").device_id)
        hit = self._work.get(key)
        if hit is None:
            pairs = work_list(q_lens, k_lens, self.plan.launch.tile_q, p.mask, p.window_left, p.window_right)
            tile_q, tile_kv = self.plan.launch.tile_q, self.spec.schedule.tile_kv
            most = max((visible_keys(int(t) * tile_q, tile_q, int(q_lens[b]), int(k_lens[b]), p.mask, p.window_left,
                                     p.window_right) for b, t in pairs[:1]), default=0)
            if is_torch(like):
                import torch
                device = torch.from_numpy(pairs).to(like.device)
            else:
                cupy = cupy_module()
                with cupy.cuda.Device(view(like, "q").device_id), stream:
                    device = cupy.asarray(pairs)
            hit = (device, len(pairs), -(-most // tile_kv) + 1)
            if len(self._work) >= WORK_LISTS:
                self._work.popitem(last=False)
            self._work[key] = hit
        self._work.move_to_end(key)
        return hit

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, out=None, lse=None):
        out, lse, launch = self.prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                                               lse)
        if launch is not None:
            self.launch_function(self.function(), *launch)
        return out, lse

    def prepare_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, out=None,
                       lse=None):
        """Checks, outputs and work list: (out, lse, (grid, args, device, stream) of the launch, or
        None when there is nothing to compute). The benchmark replays the launch alone."""
        import numpy as np
        p = self.spec.problem
        qv, kw, vv = view(q, "q"), view(k, "k"), view(v, "v")
        heads, kv_heads = self.check_packed(qv, kw, vv)
        if capturing(q):
            raise RuntimeInputError(f"{self.name}: varlen attention reads cu_seqlens on the host; it cannot run "
                                    "under CUDA graph capture")
        cu_q, cu_k = host(cu_seqlens_q, "cu_seqlens_q"), host(cu_seqlens_k, "cu_seqlens_k")   # the host sync
        q_lens, k_lens = check_varlen(cu_q, cu_k, qv.shape[0], kw.shape[0], max_seqlen_q, max_seqlen_k)
        batch = q_lens.shape[0]
        cu_qv = self._device_offsets(cu_seqlens_q, "cu_seqlens_q", batch, qv.device_id)
        cu_kv = self._device_offsets(cu_seqlens_k, "cu_seqlens_k", batch, qv.device_id)
        total_q = qv.shape[0]
        out, lse = self._outputs(q, total_q, heads, out, lse)
        ov = view(out, "out")
        stream = caller_stream(q)
        if total_q == 0 or heads == 0:
            return out, lse, None
        work, items, most_tiles = self._work_list(q, cu_q, cu_k, q_lens, k_lens, stream)
        items *= heads
        if items == 0:
            return out, lse, None
        tile_q, tile_kv = self.plan.launch.tile_q, self.spec.schedule.tile_kv
        qp, kp, vp = packed_view(qv), packed_view(kw), packed_view(vv)
        # With no keys no K/V tile is loaded; Q's map stands in (a map needs at least one row).
        k_map, v_map = (tensor_map(kp, tile_kv), tensor_map(vp, tile_kv)) if kw.shape[0] else (tensor_map(qp, tile_q),
                                                                                               ) * 2
        i64 = np.int64
        args = (tensor_map(qp, tile_q), k_map, v_map, np.uintp(ov.pointer), np.uintp(view(lse, "lse").pointer),
                np.uintp(cu_qv.pointer), np.uintp(cu_kv.pointer), np.uintp(view(work, "work").pointer),
                np.int32(heads), np.int32(heads // kv_heads), np.int32(total_q), i64(ov.strides[1]), i64(ov.strides[0]),
                np.int32(items))
        persistent = self.persistent
        if persistent is None:   # as HopperKernel: the static walk balances long masked items badly
            persistent = p.mask is Mask.NONE or most_tiles <= PERSISTENT_MASKED_TILES
        blocks = min(items, self.slots(qv.device_id)) if persistent else items
        return out, lse, ((blocks, 1, 1), args, qv.device_id, stream)

    def _outputs(self, q, total_q: int, heads: int, out, lse):
        """O (total_q, heads, dv) in q's dtype and LSE fp32 (heads, total_q), allocated or checked."""
        p = self.spec.problem
        o_shape, lse_shape = (total_q, heads, p.head_dim_v), (heads, total_q)
        if is_torch(q):
            import torch
            out = out if out is not None else torch.empty(o_shape, dtype=q.dtype, device=q.device)
            lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        else:
            cupy = cupy_module()
            if p.dtype is DType.BF16 and out is None:
                raise RuntimeInputError(f"{self.name}: CuPy has no bfloat16 dtype; pass out= (e.g. a PyTorch tensor)")
            with cupy.cuda.Device(view(q, "q").device_id):
                out = out if out is not None else cupy.empty(o_shape, dtype=cupy.float16)
                lse = lse if lse is not None else cupy.empty(lse_shape, dtype=cupy.float32)
        ov, lv = view(out, "out"), view(lse, "lse")
        if ov.shape != o_shape or ov.dtype is not p.dtype or ov.strides[2] != 1 or any(s % 8 for s in ov.strides[:2]) \
                or ov.pointer % 16:
            raise RuntimeInputError(f"{self.name}: out must be {o_shape} {p.dtype.value} with a unit stride on "
                                    f"head_dim "
                                    f"and 16-byte aligned rows, got {ov.shape} strides {ov.strides}")
        if lv.shape != lse_shape or lv.dtype is not DType.FP32 or lv.strides != (total_q, 1):
            raise RuntimeInputError(f"{self.name}: lse must be a contiguous fp32 array of shape {lse_shape}")
        return out, lse
