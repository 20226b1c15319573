"""Runtime of the decode family: one launch per call.

With one split each block writes the final O and LSE itself. With several, each split writes its
normalised O (fp32) and LSE to a workspace of (batch * heads * queries, splits, dv) floats, kept
on the kernel and grown on demand, and the last split of each (batch, kv head, row tile) to
finish merges them; it finds out through an int32 ticket counter per group, zeroed once here and
reset by the merging block. `split kv = auto` picks the count at launch for the device in hand;
the count and the reason of the most recently prepared launch are kept on the kernel (`last_splits`,
`last_split_reason`; a launch's count depends only on its shapes and device).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import RuntimeInputError
from ..hw import MAX_GRID_YZ
from ..schedule.splits import choose_splits
from ..spec import AUTO, DType
from .aux_args import AuxArguments, aux_names
from .device import device_limits
from .inputs import Shapes
from .kernel import Kernel
from .launch import CallBuilder, allocator, i32, i64, pointer_arg, strides_args
from .tensors import TensorView, view


def constant(plan, name: str):
    """The value of the plan's constant `name`. Here, not in lower_decode, so that a decode kernel
    loaded from a warm record (runtime/warm.py) runs without importing the front end (lark, networkx)."""
    for c in plan.constants:
        if c.name == name:
            return c.value
    raise KeyError(name)


def tensor_or_none(x):
    """A scale argument as a call tensor: None for a Python number (or None), which the prepared
    call holds as a constant instead."""
    return None if x is None or isinstance(x, (int, float)) else x


def number_or_none(x):
    return x if isinstance(x, (int, float)) else None


class DecodeWorkspace:
    """The split-KV partials (O fp32 (rows x splits, dv), LSE fp32 (rows x splits)) and the int32
    ticket counters of decode launches, in the inputs' framework, grown on demand. A prepared call
    keeps the arrays it was built with alive, so a later, larger allocation never frees memory a
    captured or queued launch still writes; launches that share a workspace must share a stream."""

    def __init__(self):
        self.parts = None      # (o_part, lse_part, rows x splits, dv, device)
        self.counters = None   # (int32 counters, count, device): zero between launches

    def parts_for(self, like, need: int, dv: int, device_id: int):
        have = self.parts
        if have is None or have[2] < need or have[3] != dv or have[4] != device_id:
            have = self.parts = (allocator(like, (need * dv,), "float32")(), allocator(like, (need,), "float32")(),
                                 need, dv, device_id)
        return have[0], have[1]

    def counters_for(self, like, groups: int, device_id: int):
        have = self.counters
        if have is None or have[1] < groups or have[2] != device_id:
            have = self.counters = (allocator(like, (groups,), "int32", zero=True)(), groups, device_id)
        return have[0]


class DecodeKernel(AuxArguments, Kernel):
    """A compiled flash-decoding kernel: `o, lse = kernel(q, k, v, kv_lens=None)` with q
    (batch, heads, queries, d), k/v (batch, kv_heads, kv_len, d/dv), heads a multiple of kv_heads.
    A kernel with score modifications takes their aux tensors by name (`aux={"sinks": ...}`, after the
    scales in CALL: runtime/aux_args.py)."""

    CALL = Kernel.CALL + ("k_scale", "v_scale")
    QUERY_POSITIONS = True   # templates/decode_expressions.cuh: the queries are their sequence's last

    def __init__(self, spec, plan):
        super().__init__(spec, plan)
        self.aux_names = aux_names(spec)
        if self.aux_names:
            self.CALL = type(self).CALL + self.aux_names
        self.last_splits: int | None = None
        self.last_split_reason: str = ""
        self.workspace = DecodeWorkspace()   # shared by this kernel's calls (one stream at a time)

    def __repr__(self) -> str:
        return f"<tiledsl.DecodeKernel {self.name}>"

    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None, *, k_scale=None, v_scale=None,
                 validate: bool | None = None, aux=None):
        tensors = ((q, k, v, kv_lens, out, lse, tensor_or_none(k_scale), tensor_or_none(v_scale))
                   + self.aux_tensors(aux))
        return self.run_call(tensors, (number_or_none(k_scale), number_or_none(v_scale), validate), validate=validate,
                             k_scale=k_scale, v_scale=v_scale)

    def bind(self, q, k, v, kv_lens=None, out=None, lse=None, *, k_scale=None, v_scale=None, aux=None):
        """(run, out, lse): check and allocate once, then `run()` only launches (for benchmarks).
        An FP8 (kv_dtype = e4m3) kernel takes k, v as float8_e4m3fn and their scales."""
        options = {"k_scale": k_scale, "v_scale": v_scale}
        scales = (tensor_or_none(k_scale), tensor_or_none(v_scale)) + self.aux_tensors(aux)
        if out is None or lse is None:
            out, lse = self.prepare_call((q, k, v, kv_lens, out, lse) + scales, immediate=True, **options).results
        tensors = (q, k, v, kv_lens, out, lse) + scales
        call = self.prepare_call(tensors, **options)
        return (lambda: call(*tensors)), out, lse

    def build_call(self, b: CallBuilder, validate: bool | None = None, k_scale=None, v_scale=None,
                   workspace: DecodeWorkspace | None = None) -> None:
        q, k, v, o, lse, kv_lens, shapes = self.checked_call(b, validate)
        scales = self.scale_views(b, 6, k_scale, v_scale, shapes.kv_heads)
        self.add_launches(b, q, k, v, o, lse, kv_lens, shapes, scales=scales, workspace=workspace)

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
            from .inputs import check_operand
            from .kernel import BATCHED
            for t in (k, v):
                check_operand(t, self.name, DType.E4M3, 4, q.device_id, BATCHED)
            dtype = self.spec.problem.dtype
            k, v = (replace(t, dtype=dtype, strides=t.strides[:3] + (1,), pointer=0) for t in (k, v))
        shapes = super().check_inputs(q, k, v, kv_lens)
        self.check_rows(shapes)
        return shapes

    def check_rows(self, shapes: Shapes) -> None:
        wanted = self.spec.problem.queries_per_seq
        if shapes.q_len != wanted:
            raise RuntimeInputError(f"{self.name}: built for {wanted} queries per sequence, q has {shapes.q_len}")
        if shapes.batch > MAX_GRID_YZ or shapes.kv_heads * self.row_tiles(shapes) > MAX_GRID_YZ:
            raise RuntimeInputError(f"{self.name}: batch {shapes.batch} or kv_heads x row tiles exceeds {MAX_GRID_YZ}")

    def scale_views(self, b: CallBuilder, index: int, k_scale, v_scale, kv_heads: int) -> tuple:
        """() for a 16-bit cache; for an FP8 one the (k, v) scale views (kv_fp8.check_scale): tensors
        at call positions `index`, `index + 1`, Python floats (None: 1.0) copied to q's device once
        for the prepared call. Scales given to a 16-bit kernel are refused."""
        p = self.spec.problem
        if not p.kv_fp8:
            if k_scale is not None or v_scale is not None:
                raise RuntimeInputError(f"{self.name}: k_scale / v_scale are for an FP8 (float8_e4m3fn) KV cache; "
                                        f"this kernel reads {p.dtype.value} K/V")
            return ()
        from .kv_fp8 import check_scale, scale_arrays
        ks, vs = scale_arrays(k_scale, v_scale, p.kv_scale, kv_heads, b.like)
        views = []
        for i, (given, array, name) in enumerate(((k_scale, ks, "k_scale"), (v_scale, vs, "v_scale"))):
            if tensor_or_none(given) is not None:
                t = b.view(index + i)
            else:
                b.keep.append(array)
                t = view(array, name)
            views.append(check_scale(t, name, p.kv_scale, kv_heads, b.device_id, self.name))
        return tuple(views)

    def add_launches(self, b: CallBuilder, q: TensorView, k: TensorView, v: TensorView, o: TensorView,
                     lse: TensorView, kv_lens: TensorView | None, shapes: Shapes, table: TensorView | None = None,
                     scales: tuple = (), workspace: DecodeWorkspace | None = None) -> None:
        """The decode launch on these (checked) views: the split count, workspace and parameters.
        `table` is a paged kernel's block table (runtime/paged_decode.py); its k, v views then hold
        (page, kv head, slot) strides. `scales` (scale_views) are an FP8 cache's (k, v) scales; its
        k, v strides go to the kernel in pairs of bytes (kv_fp8.kernel_strides). `workspace`: the
        split partials' owner (None: this kernel's)."""
        plan = self.plan
        splits, reason = self.splits_for(shapes, b.device_id)
        self.last_splits, self.last_split_reason = splits, reason
        if shapes.batch * shapes.heads * shapes.q_len == 0:
            return
        row_tiles = self.row_tiles(shapes)
        rows = shapes.batch * shapes.heads * shapes.q_len
        grid = (splits, shapes.kv_heads * row_tiles, shapes.batch)
        parts = (None, None, None)
        if splits > 1:
            workspace = workspace or self.workspace
            o_part, lse_part = workspace.parts_for(b.like, rows * splits, self.spec.problem.head_dim_v, b.device_id)
            counters = workspace.counters_for(b.like, grid[1] * grid[2], b.device_id)
            b.keep.extend((o_part, lse_part, counters))
            parts = tuple(view(x, name) for x, name in ((o_part, "o_part"), (lse_part, "lse_part"),
                                                        (counters, "counters")))
        num_pages = k.shape[0]   # paged: the cache's pages (k is (pages, page size, kv heads, d))
        if self.spec.problem.kv_fp8:
            from .kv_fp8 import kernel_strides
            k, v = kernel_strides(k), kernel_strides(v)
        args = (pointer_arg(q), pointer_arg(k), pointer_arg(v), pointer_arg(o), pointer_arg(lse),
                *(pointer_arg(t) for t in parts), pointer_arg(kv_lens), self.error_word_arg(b.device_id, b.like),
                *((pointer_arg(table), i64(table.strides[0]), i32(table.shape[1]), i32(num_pages))
                  if table is not None else ()),
                *(pointer_arg(s) for s in scales),
                i32(shapes.q_len), i32(shapes.kv_len), i32(shapes.heads), i32(shapes.heads // shapes.kv_heads),
                i32(row_tiles), i32(splits),
                *strides_args(q), *strides_args(k), *strides_args(v), *strides_args(o),
                *self.mod_args(b, shapes, ragged=kv_lens is not None))
        b.launch(self.function(b.device_id), grid, plan.launch.threads, plan.launch.smem_bytes, args,
                 f"{self.name} ({splits} splits)")
