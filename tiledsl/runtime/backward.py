"""The backward module on the GPU: a spec's preprocess, main and convert (or dQ) kernels compiled once per
process and launched on the caller's stream, with dQ, dK, dV and the workspace (D and the fp32 dQ
accumulator in one allocation: CallBuilder.workspace) from the caller's allocator on that stream. Like the
forward kernels (runtime/launch.py), the three launches of a signature are prepared once: a later call reads
pointers, allocates and launches."""
from __future__ import annotations

from ..codegen.render import render
from ..families import resolve
from ..errors import RuntimeInputError, SpecError
from ..hw import MAX_GRID_YZ
from ..layout.backward import BACKWARD_PRE_ROWS
from ..lower.backward import BackwardPlan, lower_backward
from ..lower.plan import bounds_indices
from ..spec import DType, KernelSpec
from .index_checks import add_kv_lens_check
from .inputs import check_int32_vector, check_operand
from .kernel import Kernel, kernel_arguments
from .launch import CallBuilder, SignatureCache, i32, pointer_arg, strides_args
from .tensors import signature

BATCHED = "(batch, heads, seqlen, head_dim)"


class BackwardKernel:
    """The compiled backward module of a spec: `dq, dk, dv = kernel(q, k, v, o, lse, do, kv_lens)`."""

    CALL = ("q", "k", "v", "o", "lse", "do", "kv_lens")

    def __init__(self, spec: KernelSpec, plan: BackwardPlan):
        self.spec, self.plan = spec, plan
        self.source = render(plan)
        self.name = plan.kernel_name
        self.cubin_path = None
        # whether the main kernel bounds kv_lens itself (the error word is one of its parameters): a call
        # without validate= then skips the host check
        self.bounds_indices = bounds_indices(plan)
        self._functions: dict[int, dict] = {}
        self._calls = SignatureCache()

    def __repr__(self) -> str:
        return f"<tiledsl.BackwardKernel {self.name}>"

    def functions(self, device_id: int | None = None) -> dict:
        """{role: loaded function} on `device_id` (None: the current device), loaded once per device."""
        from .compile import cached_cubin
        from .device import current_device, device_arch, load_functions
        device_id = current_device() if device_id is None else device_id
        fns = self._functions.get(device_id)
        if fns is None:
            if self.cubin_path is None or not self.cubin_path.is_file():
                self.cubin_path = cached_cubin(self.source, self.name, device_arch())
            smem = {"main": self.plan.launch.smem_bytes}
            if "dq" in self.plan.kernel_names:
                smem["dq"] = self.plan.dq_launch.smem_bytes
            names = self.plan.kernel_names
            loaded = load_functions(self.cubin_path, {names[role]: smem.get(role, 0) for role in names}, device_id)
            fns = self._functions[device_id] = {role: loaded[name] for role, name in names.items()}
        return fns

    def __call__(self, q, k, v, o, lse, do, kv_lens=None, *, validate: bool | None = None):
        tensors = (q, k, v, o, lse, do, kv_lens)
        key = (tuple(map(signature, tensors)), validate)
        call = self._calls.get(key)
        if call is None:
            call = self._calls.put(key, self.prepare_call(tensors, validate))
        return call(*tensors)

    def prepare_call(self, tensors: tuple, validate: bool | None = None):
        """The PreparedCall of the three launches on `tensors` (CALL order)."""
        builder = CallBuilder(self.name, tensors, self.CALL, tensors[0])
        self.build_call(builder, validate)
        return builder.build()

    def check(self, b: CallBuilder):
        """Views (q, k, v, o, lse, do, kv_lens) and (batch, heads, kv_heads, q_len, kv_len), after
        checking every tensor; errors name the kernel and the tensor."""
        p, name = self.spec.problem, self.name
        views = [b.view(i) for i in range(7)]
        vq, vk, vv, vo, vlse, vdo, lens = views
        for t in (vq, vk, vv, vo, vdo):
            check_operand(t, name, p.dtype, 4, vq.device_id, BATCHED)
        b.require_aligned(vq, vk, vv, vo, vdo)
        batch, heads, q_len, d = vq.shape
        kb, kv_heads, kv_len, dk = vk.shape
        if d != p.head_dim_qk or dk != p.head_dim_qk or vv.shape[3] != p.head_dim_v:
            raise RuntimeInputError(f"{name}: built for head_dim {p.head_dim_qk}/{p.head_dim_v}; q has {d}, k {dk}, "
                                    f"v {vv.shape[3]}")
        if kb != batch or vv.shape[:3] != vk.shape[:3]:
            raise RuntimeInputError(f"{name}: shapes disagree: q {vq.shape}, k {vk.shape}, v {vv.shape}")
        if kv_heads == 0 or heads % kv_heads:
            raise RuntimeInputError(f"{name}: {heads} query heads are not a multiple of {kv_heads} kv heads")
        o_shape = (batch, heads, q_len, p.head_dim_v)
        for t in (vo, vdo):
            if t.shape != o_shape:
                raise RuntimeInputError(f"{name}: {t.name} must have shape {o_shape} (q's, with v's head dim), got "
                                        f"{t.shape}")
        if vlse.dtype is not DType.FP32 or vlse.shape != (batch, heads, q_len) or \
                vlse.strides != (heads * q_len, q_len, 1):
            raise RuntimeInputError(f"{name}: lse must be a contiguous fp32 tensor of shape {(batch, heads, q_len)} "
                                    f"(the forward's return_lse), got {getattr(vlse.dtype, 'value', vlse.dtype)} "
                                    f"{vlse.shape}")
        if vlse.device_id != vq.device_id:
            raise RuntimeInputError(f"{name}: lse is on GPU {vlse.device_id}, q on GPU {vq.device_id}")
        if batch * heads > MAX_GRID_YZ:
            raise RuntimeInputError(f"{name}: batch*heads = {batch * heads} exceeds {MAX_GRID_YZ} per launch")
        if lens is not None:
            check_int32_vector(lens, name, batch, vq.device_id)
        return views, (batch, heads, kv_heads, q_len, kv_len)

    def checked_call(self, b: CallBuilder, validate: bool | None):
        """check's views and sizes, with kv_lens' check added: on the host, or the report of a main
        kernel that bounds them (runtime/index_checks.py)."""
        views, sizes = self.check(b)
        # With no keys in k no main kernel launches to report a bad entry (the convert kernel still makes its
        # sequence's dQ NaN): such a call checks kv_lens on the host.
        add_kv_lens_check(b, 6, sizes[4], validate, self.bounds_indices and sizes[4] > 0)
        return views, sizes

    def main_arguments(self, b: CallBuilder, **values) -> tuple:
        """The main kernel's launch arguments in its plan's parameter order (kernel.kernel_arguments):
        `values` by parameter name, with the error word where the kernel bounds kv_lens."""
        if self.bounds_indices:
            values["index_errors"] = Kernel.error_word_arg(b.device_id, b.like)
        return kernel_arguments(self.plan, values)

    @staticmethod
    def strides(**views) -> dict:
        """{name_batch_stride, name_head_stride, name_row_stride: ...} of each view by its parameter prefix."""
        return {f"{name}_{axis}_stride": stride for name, t in views.items()
                for axis, stride in zip(("batch", "head", "row"), t.strides[:3])}

    def build_call(self, b: CallBuilder, validate: bool | None = None) -> None:
        (vq, vk, vv, vo, vlse, vdo, lens), (batch, heads, kv_heads, q_len, kv_len) = self.checked_call(b, validate)
        p, plan = self.spec.problem, self.plan
        vdq, vdk, vdv = (b.new_output(name, t.shape, p.dtype) for name, t in (("dq", vq), ("dk", vk), ("dv", vv)))
        atomic = plan.dq_mode == "atomic"
        d_rows = b.workspace("d_rows", (batch, heads, q_len), "float32")   # both written by the preprocess
        dq_accum = b.workspace("dq_accum", (batch, heads, q_len, p.head_dim_qk), "float32") if atomic else None
        fns = self.functions(b.device_id)
        pairs = batch * heads
        q_blocks = -(-q_len // BACKWARD_PRE_ROWS)
        ptr, st = pointer_arg, strides_args
        if q_blocks and pairs:
            b.launch(fns["preprocess"], (q_blocks, pairs, 1), plan.pre_threads, 0,
                     (ptr(vo), ptr(vdo), ptr(d_rows), ptr(dq_accum), i32(q_len), i32(heads), *st(vo), *st(vdo)),
                     f"{self.name} preprocess")
        kv_blocks = -(-kv_len // plan.tile_kv)
        if kv_blocks and batch * kv_heads:
            args = self.main_arguments(b, q=vq, k=vk, v=vv, dout=vdo, lse=vlse, d_rows=d_rows, dq_accum=dq_accum,
                                       dk=vdk, dv=vdv, kv_lens=lens, q_len=q_len, kv_len=kv_len, heads=heads,
                                       kv_group=heads // kv_heads,
                                       **self.strides(q=vq, k=vk, v=vv, do=vdo, dk=vdk, dv=vdv))
            b.launch(fns["main"], (kv_blocks, batch * kv_heads, 1), plan.launch.threads, plan.launch.smem_bytes, args,
                     f"{self.name} main")
        if q_blocks and pairs:
            if atomic:
                b.launch(fns["convert"], (q_blocks, pairs, 1), plan.pre_threads, 0,
                         (ptr(dq_accum), ptr(vdq), ptr(lens), i32(q_len), i32(kv_len), i32(heads), *st(vdq)),
                         f"{self.name} convert")
            else:
                tiles = -(-q_len // plan.dq_launch.tile_q)
                b.launch(fns["dq"], (tiles, pairs, 1), plan.dq_launch.threads, plan.dq_launch.smem_bytes,
                         (ptr(vq), ptr(vk), ptr(vv), ptr(vdo), ptr(vlse), ptr(d_rows), ptr(vdq), ptr(lens), i32(q_len),
                          i32(kv_len), i32(heads), i32(heads // kv_heads), *st(vq), *st(vk), *st(vv), *st(vdo),
                          *st(vdq)), f"{self.name} dq")


def compile_backward(spec: KernelSpec) -> BackwardKernel:
    """The backward module of a spec with a `backward { }` block (SpecError when no template builds it)."""
    if spec.backward is None:
        raise SpecError(f"{spec.name} has no backward schedule", spec.span, spec.source_text,
                        "add `backward { }` to its spec")
    plan = lower_backward(spec)
    cls = resolve(plan.kernel_class) if plan.kernel_class else BackwardKernel   # the warp-specialized module's own
    return cls(spec, plan)
