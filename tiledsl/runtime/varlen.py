"""Runtime of the Hopper family over packed sequences (`layout = varlen`, templates/hopper_varlen.cu.j2).

Tensors are token-major, as FlashAttention's flash_attn_varlen_func takes them: q (total_q, heads,
d), k (total_k, kv_heads, d), v (total_k, kv_heads, dv); cu_seqlens_q / cu_seqlens_k int32
(batch + 1,) on the GPU; sequence b is rows cu[b]:cu[b + 1]. Outputs: O (total_q, heads, dv) in
q's dtype and LSE fp32 (heads, total_q) (FlashAttention's varlen LSE layout; natural log).

Each TMA map sees a packed tensor as one batch entry of `total` rows: (1, heads, total, d) with
the row stride heads * d, so the hopper kernel's 4-d copies read it unchanged; a work item adds its
sequence's first row. The work list -- (sequence, query tile) pairs -- comes one of two ways:

- from host copies of cu_seqlens (a sync): checked (serving_checks.check_varlen) and ordered the
  costliest sequence first, the tiles that see the most keys first; uploaded once per cu_seqlens
  contents. What `validate=True`, a call without max_seqlen_q / max_seqlen_k, and plan() do;
- without reading cu_seqlens, when the caller gives max_seqlen_q and max_seqlen_k (as flash-attn
  asks): every sequence's ceil(max_seqlen_q / tile q) tiles, the later (longer, under a causal
  mask) tiles first; a tile past its sequence's end reads no keys and stores no row. Uploaded once
  per (batch, tiles): no sync, capturable in a CUDA graph.

FP8 kernels (dtype = e4m3) take float8_e4m3fn q, k, v and their float32 descales after the outputs: one value
each, or (sequences, kv_heads) each (runtime/fp8_descales.py); O is the spec's out_dtype. Kernels with score
modifications (softcap, ALiBi, sinks) take their aux tensors after the outputs instead (runtime/aux_args.py):
ALiBi's slopes (heads,) or (sequences, heads), the sinks (heads,).
"""
from __future__ import annotations

from collections import OrderedDict

from ..errors import LaunchError, RuntimeInputError
from ..spec import DType, LaunchKind, Mask
from .arguments import length_bound
from .fp8_descales import descale_views
from .hopper import PERSISTENT_MASKED_TILES, HopperKernel
from .index_checks import add_device_report
from .inputs import Shapes, check_operand
from .launch import CallBuilder, SignatureCache, i32, i64, pointer_arg
from .serving_checks import check_varlen, host
from .tensor_maps import map_arg
from .tensors import TensorView, signature, view

WORK_LISTS = 16   # uploaded work lists kept per kernel (one per recent cu_seqlens pair or shape)
PACKED = "(total tokens, heads, head_dim)"


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


def bounded_work_list(batch: int, tiles: int):
    """(sequence, query tile) int32 pairs for `tiles` tiles of every sequence, without their lengths:
    the last tiles first (under a causal mask they see the most keys), sequences in order within."""
    import numpy as np
    t, b = np.meshgrid(np.arange(tiles - 1, -1, -1, dtype=np.int32), np.arange(batch, dtype=np.int32), indexing="ij")
    return np.stack([b.ravel(), t.ravel()], axis=1).astype(np.int32).reshape(-1, 2)


def packed_view(t: TensorView) -> TensorView:
    """A packed (total, heads, d) tensor as the (batch 1, heads, rows, d) the tensor maps describe."""
    total, heads, d = t.shape
    return TensorView(t.name, t.pointer, (1, heads, total, d), (total * t.strides[0], t.strides[1], t.strides[0], 1),
                      t.dtype, t.device_id, t.owner, t.slot)


def upload_int32(pairs, like):
    """A device copy of the int32 NumPy array `pairs` in `like`'s framework (on its current stream)."""
    from .device import cupy_module
    if type(like).__module__.startswith("torch"):
        import torch
        # From pinned memory, without a sync (torch keeps the host block until the copy has run).
        return torch.from_numpy(pairs).pin_memory().to(like.device, non_blocking=True)
    cupy = cupy_module()
    with cupy.cuda.Device(view(like, "q").device_id):
        return cupy.asarray(pairs)


class VarlenHopperKernel(HopperKernel):
    """A compiled varlen hopper kernel: `o, lse = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)`
    (module docstring for the layouts and the two work lists). `max_seqlen_q/k`, when given, bound
    the lengths: with both and without `validate`, no host reads (capturable). `aux`: the score
    modifications' tensors by name (runtime/aux_args.py), after the outputs in CALL."""

    CALL = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out", "lse")

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self._work: OrderedDict = OrderedDict()
        self._host_calls = SignatureCache(WORK_LISTS * 4)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, out=None, lse=None,
                 *, validate: bool | None = None, aux=None, q_descale=None, k_descale=None, v_descale=None):
        tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse) + self.aux_tensors(aux) + \
            self.descale_tensors(q_descale, k_descale, v_descale)
        max_seqlen_q, max_seqlen_k = (length_bound(self.name, name, value) for name, value in (
            ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
        if max_seqlen_q is not None and max_seqlen_k is not None and not validate:
            return self.run_call(tensors, (max_seqlen_q, max_seqlen_k), max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k)
        from .device import capturing
        if capturing(q):
            raise RuntimeInputError(f"{self.name}: without max_seqlen_q and max_seqlen_k (or with validate=True) "
                                    "varlen attention reads cu_seqlens on the host; it cannot run under CUDA graph "
                                    "capture")
        cu_q, cu_k = host(cu_seqlens_q, "cu_seqlens_q"), host(cu_seqlens_k, "cu_seqlens_k")   # the host sync
        key = (tuple(map(signature, tensors)), cu_q.tobytes(), cu_k.tobytes(), max_seqlen_q, max_seqlen_k,
               self.launch_options())
        call = self._host_calls.get(key)
        if call is None:
            call = self._host_calls.put(key, self.prepare_call(tensors, host_offsets=(cu_q, cu_k),
                                                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
        return call(*tensors)

    def bind(self, *args, **options):
        """HopperKernel.bind reads batched (q, k, v, kv_lens, ...) arguments: a packed call binds through
        prepare_varlen instead."""
        raise RuntimeInputError(f"{self.name}: a varlen kernel has no bind(); prepare_varlen(q, k, v, cu_seqlens_q, "
                                "cu_seqlens_k, ...) checks one call and returns (out, lse, launches) to replay "
                                "(runtime/launch.run_now)")

    def check_packed(self, q: TensorView, k: TensorView, v: TensorView) -> tuple[int, int]:
        """(heads, kv_heads) after checking the packed tensors; errors name the tensor."""
        p = self.spec.problem
        for t, dim in ((q, p.head_dim_qk), (k, p.head_dim_qk), (v, p.head_dim_v)):
            check_operand(t, self.name, p.dtype, 3, q.device_id, PACKED)
            if t.shape[2] != dim:
                raise RuntimeInputError(f"{self.name}: {t.name} has head_dim {t.shape[2]}, the kernel was built for "
                                        f"{dim}")
        heads, kv_heads = q.shape[1], k.shape[1]
        if v.shape[:2] != k.shape[:2]:
            raise RuntimeInputError(f"{self.name}: k {k.shape} and v {v.shape} must hold the same (total_k, kv_heads)")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{self.name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        return heads, kv_heads

    def _device_offsets(self, t: TensorView, batch: int | None, device_id: int) -> int:
        """The batch size cu_seqlens `t` describes, after checking it is a contiguous int32 GPU vector
        (of batch + 1 entries when `batch` is known)."""
        ok = t.dtype == "int32" and len(t.shape) == 1 and t.shape[0] >= 1 and t.strides[0] == 1
        if not ok or (batch is not None and t.shape[0] != batch + 1) or t.device_id != device_id:
            want = f"({batch + 1},)" if batch is not None else "(batch + 1,)"
            raise RuntimeInputError(f"{self.name}: {t.name} must be a contiguous int32 GPU array of shape {want} "
                                    f"on GPU {device_id}")
        return t.shape[0] - 1

    def _uploaded(self, key, pairs_of, like):
        """The device work list for `key` ((device array, items) from `pairs_of()`), kept for reuse."""
        hit = self._work.get(key)
        if hit is None:
            pairs = pairs_of()
            hit = (upload_int32(pairs, like), len(pairs))
            if len(self._work) >= WORK_LISTS:
                self._work.popitem(last=False)
            self._work[key] = hit
        self._work.move_to_end(key)
        return hit

    def build_call(self, b: CallBuilder, host_offsets=None, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, planned_work=None) -> None:
        """The launch on packed q, k, v with a work list from host offsets (`host_offsets`: host copies
        of cu_seqlens), from the length bounds (max_seqlen_q, max_seqlen_k), or uploaded by a plan
        (`planned_work`: (device (items, 2) int32 list, items, keys the costliest item sees))."""
        p = self.spec.problem
        qv, kw, vv, cu_qv, cu_kv = (b.view(i) for i in range(5))
        heads, kv_heads = self.check_packed(qv, kw, vv)
        b.require_aligned(qv, kw, vv)
        tile_q, tile_kv = self.plan.launch.tile_q, self.spec.schedule.tile_kv
        framework = type(b.like).__module__.split(".")[0]
        if host_offsets is not None:
            cu_q, cu_k = host_offsets
            q_lens, k_lens = check_varlen(cu_q, cu_k, qv.shape[0], kw.shape[0], max_seqlen_q, max_seqlen_k)
            batch = q_lens.shape[0]
            ordered = work_list(q_lens, k_lens, tile_q, p.mask, p.window_left, p.window_right)
            key = ("host", cu_q.tobytes(), cu_k.tobytes(), framework, qv.device_id)
            work, pairs = self._uploaded(key, lambda: ordered, b.like)
            most = max((visible_keys(int(t) * tile_q, tile_q, int(q_lens[s]), int(k_lens[s]), p.mask, p.window_left,
                                     p.window_right) for s, t in ordered[:1]), default=0)
        elif planned_work is not None:
            work, pairs, most = planned_work
            batch = None
        else:
            batch = None
            most = max_seqlen_k
        batch = self._device_offsets(cu_qv, batch, qv.device_id)
        self._device_offsets(cu_kv, batch, qv.device_id)
        total_q = qv.shape[0]
        # A list from max_seqlen_q covers that many rows of every sequence (no sequence holds more than q's rows;
        # at least one tile, so that a sequence over the bound has an item to report it).
        covered_q = min(max_seqlen_q, total_q) if host_offsets is None and planned_work is None else total_q
        if host_offsets is None and planned_work is None:
            tiles = max(1, -(-covered_q // tile_q))
            work, pairs = self._uploaded(("bounded", batch, tiles, framework, qv.device_id),
                                         lambda: bounded_work_list(batch, tiles), b.like)
        b.keep.append(work)
        ov = b.output(5, (total_q, heads, p.head_dim_v), p.output_dtype)
        lv = b.output(6, (heads, total_q), DType.FP32, contiguous=True)
        # the aux tensors checked before an empty launch returns: a wrong one is refused whatever the lengths. The
        # expressions' indices are checked over the longest sequence the kernel can meet: the host lengths where
        # read, else the queries the device bounds and every packed key (max_seqlen_k is not bounded there).
        longest = (int(q_lens.max(initial=0)), int(k_lens.max(initial=0))) if host_offsets is not None else \
            (covered_q, kw.shape[0])
        mods = self.mod_args(b, Shapes(batch, heads, kv_heads, *longest), ragged=True)
        descales = ()
        if p.fp8:   # per tensor or per (sequence, kv head): the lengths would only size per-block descales
            descales = descale_views(b, len(self.CALL) - 3, p.descales, Shapes(batch, heads, kv_heads, 0, 0), tile_q,
                                     tile_kv, self.name, batch_axis="sequences")
        items = pairs * heads
        if total_q == 0 or items == 0:
            return
        qp, kp, vp = packed_view(qv), packed_view(kw), packed_view(vv)
        qk_element, v_element = self.map_elements()
        # With no keys no K/V tile is loaded; Q's map stands in (a map needs at least one row).
        k_map, v_map = ((map_arg(kp, tile_kv, qk_element), map_arg(vp, tile_kv, v_element)) if kw.shape[0]
                        else (map_arg(qp, tile_q, qk_element),) * 2)
        add_device_report(b, True)   # the kernel bounds cu_seqlens by the packed rows and covered_q
        args = (map_arg(qp, tile_q, qk_element), k_map, v_map, pointer_arg(ov), pointer_arg(lv), pointer_arg(cu_qv),
                pointer_arg(cu_kv), pointer_arg(view(work, "work")), self.error_word_arg(qv.device_id, b.like),
                i32(heads), i32(heads // kv_heads), i32(total_q), i32(kw.shape[0]), i32(covered_q),
                i64(ov.strides[1]), i64(ov.strides[0]), i32(items)) + mods + tuple(pointer_arg(t) for t in descales)
        persistent = self.persistent
        if self.plan.launch_kind == LaunchKind.GRID.value:
            # one item a block: such a kernel may reuse a ring for O that the next item's loads would overwrite
            if persistent:
                raise LaunchError(f"{self.name}: a `launch grid` kernel runs one work item per block; persistent "
                                  "launches need `launch persistent`")
            persistent = False
        elif persistent is None:   # as HopperKernel: the static walk balances long masked items badly
            persistent = p.mask is Mask.NONE or -(-most // tile_kv) + 1 <= PERSISTENT_MASKED_TILES
        blocks = min(items, self.slots(b.device_id)) if persistent else items
        b.launch(self.function(b.device_id), (blocks, 1, 1), self.plan.launch.threads, self.plan.launch.smem_bytes,
                 args, self.name)

    def prepare_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, out=None,
                       lse=None, q_descale=None, k_descale=None, v_descale=None, aux=None):
        """(out, lse, launches) of one call checked on the host, for benchmarks that replay the launch
        alone (runtime/launch.run_now)."""
        tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse) + self.aux_tensors(aux) + \
            self.descale_tensors(q_descale, k_descale, v_descale)
        offsets = (host(cu_seqlens_q, "cu_seqlens_q"), host(cu_seqlens_k, "cu_seqlens_k"))
        b = self.prepare_call(tensors, immediate=True, host_offsets=offsets, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k)
        out, lse = b.results
        return out, lse, b.launches
