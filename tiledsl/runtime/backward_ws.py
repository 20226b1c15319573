"""The warp-specialized backward module on the GPU (templates/backward_ws.cu.j2): its preprocess, main and convert
kernels, prepared once per call signature like every backward module (runtime/backward.py), with Q, dO, K, V
(and dQ_accum, the TMA reduce-add's target) handed to the main kernel as TMA tensor maps.

Workspace, one allocation per call from the inputs' framework on the caller's stream (CallBuilder.workspace), all
of it written by the preprocess before the main kernel reads it: LSE and D in rows padded to whole q tiles (the
producer's bulk copies read whole tiles; padded rows hold LSE = +inf, D = 0, so they contribute nothing),
dQ_accum (fp32, like dQ, zeroed), and under `dq accumulate ordered` one int32 semaphore per (batch, head, q tile)."""
from __future__ import annotations

from ..errors import RuntimeInputError
from ..mods.model import (AUX_ALIBI, AUX_BLOCK_MASK, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_SINKS, AlibiSlopes,
                          Documents)
from ..spec import DType
from ..lower.expressions import AUX_PARAMETER
from .aux_args import (aux_names, aux_view, block_mask_arguments, dropout_arguments, expression_views,
                       geometric_slope_tensor, launch_aux)
from .backward import BackwardKernel
from .inputs import Shapes
from .index_checks import add_check, host_validation
from .launch import CallBuilder, i32, i64, pointer_arg, strides_args
from .tensor_maps import map_arg
from .tensors import signature, view


class WsBackwardKernel(BackwardKernel):
    """`dq, dk, dv = kernel(q, k, v, o, lse, do, kv_lens)`, as BackwardKernel (the same input checks). With score
    modifications the call takes their aux tensors (`aux={"alibi_slopes": ..., "sinks": ...}`, as the forward
    kernel's) and with sinks returns dsink (float32, (heads,)) fourth."""

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self.aux_names = aux_names(spec)   # after CALL, in this order
        if self.aux_names:
            self.CALL = type(self).CALL + self.aux_names

    def __call__(self, q, k, v, o, lse, do, kv_lens=None, *, validate: bool | None = None, aux=None):
        aux = launch_aux(dict(aux or {}))   # dropout's (seed, offset) as two values
        missing = [n for n in self.aux_names if aux.get(n) is None]
        extra = sorted(set(aux) - set(self.aux_names))
        if missing or extra:
            raise RuntimeInputError(f"{self.name}: aux tensors " + "; ".join(
                (["missing " + ", ".join(missing)] if missing else []) + (["not read by this kernel: "
                                                                            + ", ".join(extra)] if extra else []))
                + f" (it reads: {', '.join(self.aux_names) or 'none'})")
        tensors = (q, k, v, o, lse, do, kv_lens) + tuple(aux[n] for n in self.aux_names)
        key = (tuple(map(signature, tensors)), validate)
        call = self._calls.get(key)
        if call is None:
            call = self._calls.put(key, self.prepare_call(tensors, validate))
        return call(*tensors)

    def mod_arguments(self, b: CallBuilder, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                      validate: bool | None) -> dict:
        """The main kernel's ALiBi arguments (slopes and their batch stride: 0 for (heads,) and geometric ones),
        documents (ids or bounds, read by pointer; their order checked on the host where the call checks its index
        tensors there, as the forward's: runtime/hopper.HopperKernel.add_document_check) and its block mask's (the
        table and its strides, 0 where a dimension of 1 broadcasts)."""
        mods, out = self.spec.problem.mods, self._block_arguments(b, batch, heads, kv_heads, q_len, kv_len)
        if mods.alibi is AlibiSlopes.GEOMETRIC:
            slopes = geometric_slope_tensor(b.like, b.device_id, heads)
            b.keep.append(slopes)
            out |= {"alibi_slopes": view(slopes, AUX_ALIBI), "alibi_batch_stride": 0}
        elif mods.alibi is AlibiSlopes.GIVEN:
            t = aux_view(b, self.name, self.CALL, AUX_ALIBI, ((heads,), (batch, heads)))
            out |= {"alibi_slopes": t, "alibi_batch_stride": heads if len(t.shape) == 2 else 0}
        if mods.document is Documents.IDS:
            t = aux_view(b, self.name, self.CALL, AUX_DOCUMENT_IDS, ((batch, kv_len),), "int32")
            out |= {"document_ids": t, "document_stride": t.strides[0]}
        elif mods.document is Documents.BOUNDS:
            t = aux_view(b, self.name, self.CALL, AUX_DOCUMENT_BOUNDS, None, "int32")
            if len(t.shape) != 2 or t.shape[0] != batch or t.shape[1] < 1:
                raise RuntimeInputError(f"{self.name}: {AUX_DOCUMENT_BOUNDS} has shape {t.shape}; this launch needs "
                                        f"({batch}, documents + 1)")
            out |= {"document_bounds": t, "document_stride": t.strides[0], "document_count": t.shape[1]}
        if mods.document is not None:
            self.add_document_check(b, kv_len, validate)
        shapes = Shapes(batch, heads, kv_heads, q_len, kv_len)
        ragged = b.tensors[self.CALL.index("kv_lens")] is not None
        for name, t in expression_views(b, self.name, self.CALL, mods, shapes, ragged).items():
            out |= {AUX_PARAMETER + name: t} | {f"{AUX_PARAMETER}{name}_stride{axis}": stride
                                                 for axis, stride in enumerate(t.strides)}
        return out | dropout_arguments(b, self.name, self.CALL, mods)

    def add_document_check(self, b: CallBuilder, kv_len: int, validate: bool | None) -> None:
        """The documents' host check (mods/checks: ids in runs, bounds in order) where the call checks its index
        tensors on the host (runtime/index_checks.host_validation): the kernel reads any data in bounds, but
        documents out of order would give wrong gradients."""
        if not host_validation(validate):
            return
        from ..mods.checks import check_bounds, check_document_ids
        from .serving_checks import host
        if self.spec.problem.mods.document is Documents.IDS:
            index = self.CALL.index(AUX_DOCUMENT_IDS)
            add_check(b, lambda tensors: check_document_ids(host(tensors[index], AUX_DOCUMENT_IDS), self.name))
        else:
            index = self.CALL.index(AUX_DOCUMENT_BOUNDS)
            add_check(b, lambda tensors: check_bounds(host(tensors[index], AUX_DOCUMENT_BOUNDS), kv_len, self.name))

    def check_marked_steps(self, heads: int, kv_heads: int, q_len: int) -> None:
        """The steps a kv tile may walk fit the shared step bits (block_mask's or mask_mod's marked steps)."""
        from ..layout.backward_ws import STEP_BITS
        if not self.plan.marked_steps:
            return
        steps = (heads // max(kv_heads, 1)) * -(-q_len // self.plan.launch.tile_q)
        if steps > STEP_BITS:
            what = f"{AUX_BLOCK_MASK}: " if self.spec.problem.mods.blocks is not None else "mask_mod: "
            kind = "block-sparse" if self.spec.problem.mods.blocks is not None else "mask_mod"
            raise RuntimeInputError(f"{self.name}: {what}a kv tile walks {steps} (query head, q tile) "
                                    f"steps here; the {kind} backward marks at most {STEP_BITS} (fewer query "
                                    "heads per kv head, or a shorter sequence)")

    def _block_arguments(self, b: CallBuilder, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> dict:
        self.check_marked_steps(heads, kv_heads, q_len)
        blocks = self.spec.problem.mods.blocks
        if blocks is None:
            return {}
        t, batch_stride, head_stride, kv_blocks = block_mask_arguments(b, self.name, self.CALL, blocks, batch, heads,
                                                                       q_len, kv_len)
        return {"block_mask": t, "block_mask_batch_stride": batch_stride, "block_mask_head_stride": head_stride,
                "block_mask_kv_blocks": kv_blocks}

    def build_call(self, b: CallBuilder, validate: bool | None = None) -> None:
        (vq, vk, vv, vo, vlse, vdo, lens), (batch, heads, kv_heads, q_len, kv_len) = self.checked_call(b, validate)
        p, plan = self.spec.problem, self.plan
        vdq, vdk, vdv = (b.new_output(name, t.shape, p.dtype) for name, t in (("dq", vq), ("dk", vk), ("dv", vv)))
        mods = self.mod_arguments(b, batch, heads, kv_heads, q_len, kv_len, validate)
        if plan.sinks:
            vsinks = aux_view(b, self.name, self.CALL, AUX_SINKS, ((heads,),))
            vdsink = b.new_output("dsink", (heads,), DType.FP32)
        br, bc = plan.launch.tile_q, plan.tile_kv
        pairs, kv_pairs = batch * heads, batch * kv_heads
        tiles = -(-q_len // br)
        q_rows = tiles * br
        lse_rows = b.workspace("lse_rows", (pairs * q_rows,), "float32")
        d_rows = b.workspace("d_rows", (pairs * q_rows,), "float32")
        dq_accum = b.workspace("dq_accum", (batch, heads, q_len, p.head_dim_qk), "float32")
        semaphores = b.workspace("semaphores", (pairs * tiles,), "int32") if plan.ordered else None
        fns = self.functions(b.device_id)
        ptr, st = pointer_arg, strides_args
        if q_rows and pairs:
            b.launch(fns["preprocess"], (q_rows // plan.pre_rows, pairs, 1), plan.pre_threads, 0,
                     (ptr(vo), ptr(vdo), ptr(vlse), ptr(lse_rows), ptr(d_rows), ptr(dq_accum), ptr(semaphores),
                      i32(q_len), i32(q_rows), i32(heads), *st(vo), *st(vdo)), f"{self.name} preprocess")
        if plan.sinks and heads:   # after the preprocess: it reads the LSE and D rows (padded: +inf, 0)
            b.launch(fns["sink_grad"], (heads, 1, 1), plan.sink_threads, 0,
                     (ptr(lse_rows), ptr(d_rows), ptr(vsinks), ptr(vdsink), i32(q_rows), i32(batch), i32(heads)),
                     f"{self.name} sink gradient")
        kv_blocks = -(-kv_len // bc)
        if plan.documents and kv_blocks and kv_pairs:   # after the preprocess: it zeroes the semaphores
            # per (kv tile, batch) the keys' documents, at the main kernel's block of the batch entry's kv head 0
            key_spans = b.workspace("key_spans", (kv_blocks * kv_pairs * 2,), "int32")
            source = ((ptr(mods["document_ids"]), i64(mods["document_stride"])) if plan.documents == "ids" else
                      (ptr(mods["document_bounds"]), i64(mods["document_stride"]), i32(mods["document_count"])))
            b.launch(fns["documents"], (max(kv_blocks, tiles), batch, 1), 32, 0,
                     (*source, ptr(lens), ptr(key_spans), ptr(semaphores), i32(q_len), i32(kv_len), i32(kv_blocks),
                      i32(tiles), i32(kv_pairs), i32(kv_heads), i32(heads)), f"{self.name} documents")
            mods["key_spans"] = key_spans
        if kv_blocks and kv_pairs:
            rows = plan.box_rows
            k_map, v_map = map_arg(vk, rows["k"]), map_arg(vv, rows["v"])
            # Without queries no block loads Q or dO (every block stores zero dK, dV): K's map stands in.
            q_map, do_map = (map_arg(vq, rows["q"]), map_arg(vdo, rows["do"])) if q_len else (k_map, k_map)
            dq_map = map_arg(dq_accum, rows["dq"], "float32") if plan.dq_path == "writer_tma" and q_len else q_map
            args = self.main_arguments(b, q_map=q_map, k_map=k_map, v_map=v_map, do_map=do_map, dq_map=dq_map,
                                       lse_rows=lse_rows, d_rows=d_rows, dq_accum=dq_accum, semaphores=semaphores,
                                       dk=vdk, dv=vdv, kv_lens=lens, q_len=q_len, q_rows=q_rows, kv_len=kv_len,
                                       heads=heads, kv_group=heads // kv_heads, pairs=kv_pairs,
                                       **self.strides(dk=vdk, dv=vdv), **mods)
            b.launch(fns["main"], (kv_blocks * kv_pairs, 1, 1), plan.launch.threads, plan.launch.smem_bytes, args,
                     f"{self.name} main")
        if q_len and pairs:
            b.launch(fns["convert"], (-(-q_len // plan.pre_rows), pairs, 1), plan.pre_threads, 0,
                     (ptr(dq_accum), ptr(vdq), ptr(lens), i32(q_len), i32(kv_len), i32(heads), *st(vdq)),
                     f"{self.name} convert")
