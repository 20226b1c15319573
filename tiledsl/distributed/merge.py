"""The merge of a block's partial (O, LSE) into the running (O, LSE) of its query rows.

Each ring step attends the local queries to one shard of keys; the shards are disjoint, so the result is
exact by the split-KV merge that decode uses (reference.forward.merge_partials):
    lse = m + log(exp(lse_acc - m) + exp(lse_blk - m)),  m = max(lse_acc, lse_blk)
    O   = exp(lse_acc - lse) O_acc + exp(lse_blk - lse) O_blk
with a -inf side weighing 0 and a row that is -inf on both left at O = 0, LSE = -inf.

On the GPU a generated kernel (templates/ring_merge.cu.j2) does it in one pass over the fp32 accumulator:
it reads the block's 16-bit O and fp32 LSE as the forward kernel wrote them and updates O_acc and LSE_acc
in place. Elementwise torch ops would take about eight passes over the same bytes, and the merge runs once
per step on every rank. On the CPU (the float64 protocol tests) the reference's merge_partials does it."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import RuntimeInputError
from ..spec import DTYPE_PTX, DType
from ..version import __version__

COLUMNS_PER_THREAD = 8       # one 16-byte load of the block's 16-bit O, two of the fp32 accumulator
THREADS_PER_BLOCK = 256      # rows per block = THREADS_PER_BLOCK // threads per row
TEMPLATE = "ring_merge.cu.j2"


@dataclass(frozen=True)
class Constant:
    type: str
    name: str
    value: int
    why: str = ""


@dataclass(frozen=True)
class MergePlan:
    """Everything templates/ring_merge.cu.j2 spells, decided here."""
    dtype: DType
    head_dim_v: int

    def __post_init__(self):
        if self.dtype not in (DType.FP16, DType.BF16):
            raise RuntimeInputError(f"ring merge: O must be fp16 or bf16, got {self.dtype}")
        if self.head_dim_v % COLUMNS_PER_THREAD or not 0 < self.head_dim_v <= 256:
            raise RuntimeInputError(f"ring merge: head_dim_v must be a multiple of {COLUMNS_PER_THREAD} in 8..256, "
                                    f"got {self.head_dim_v}")

    template = TEMPLATE
    tiledsl_version = __version__

    @property
    def kernel_name(self) -> str:
        return f"ring_merge_{self.dtype.value}_dv{self.head_dim_v}"

    @property
    def dtype_ptx(self) -> str:
        return DTYPE_PTX[self.dtype]

    @property
    def threads_per_row(self) -> int:
        return self.head_dim_v // COLUMNS_PER_THREAD

    @property
    def rows_per_block(self) -> int:
        return max(1, THREADS_PER_BLOCK // self.threads_per_row)

    @property
    def threads(self) -> int:
        return self.rows_per_block * self.threads_per_row

    @property
    def constants(self) -> tuple[Constant, ...]:
        return (Constant("int", "DV", self.head_dim_v, "O's head dim (columns per row)"),
                Constant("int", "COLUMNS_PER_THREAD", COLUMNS_PER_THREAD, "16 bytes of the block's 16-bit O"),
                Constant("int", "THREADS_PER_ROW", self.threads_per_row),
                Constant("int", "ROWS_PER_BLOCK", self.rows_per_block),
                Constant("int", "THREADS", self.threads))


def render_merge(plan: MergePlan) -> str:
    from ..codegen.render import environment
    return environment().get_template(plan.template).render(plan=plan)


class MergeKernel:
    """The compiled merge of one (dtype, head_dim_v): `kernel(o_acc, lse_acc, o, lse, row_start)`."""

    def __init__(self, plan: MergePlan):
        self.plan, self.name = plan, plan.kernel_name
        self.source = render_merge(plan)
        self._function = None

    def function(self):
        if self._function is None:
            from ..runtime.compile import compile_cubin
            from ..runtime.device import cupy_module, device_arch
            module = cupy_module().cuda.function.Module()
            module.load(compile_cubin(self.source, self.name, device_arch()))
            self._module, self._function = module, module.get_function(self.name)
        return self._function

    def __call__(self, o_acc, lse_acc, o, lse, row_start: int = 0) -> None:
        import numpy as np

        from ..runtime.device import caller_stream, cupy_module
        from ..runtime.tensors import view
        acc, acc_lse, blk, blk_lse = view(o_acc, "o_acc"), view(lse_acc, "lse_acc"), view(o, "o"), view(lse, "lse")
        batch, heads, rows, dv = acc.shape
        b_batch, b_heads, b_rows, b_dv = blk.shape
        name = self.name
        if (b_batch, b_heads, b_dv) != (batch, heads, dv) or dv != self.plan.head_dim_v:
            raise RuntimeInputError(f"{name}: o {blk.shape} does not match o_acc {acc.shape} (head_dim_v "
                                    f"{self.plan.head_dim_v})")
        if not 0 <= row_start <= rows - b_rows:
            raise RuntimeInputError(f"{name}: rows [{row_start}, {row_start + b_rows}) are not inside o_acc's {rows}")
        contiguous = lambda t, shape: t.shape == shape and t.strides == tuple(  # noqa: E731
            int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        if acc.dtype is not DType.FP32 or not contiguous(acc, acc.shape):
            raise RuntimeInputError(f"{name}: o_acc must be a contiguous fp32 tensor")
        for t, shape in ((acc_lse, (batch, heads, rows)), (blk_lse, (batch, heads, b_rows))):
            if t.dtype is not DType.FP32 or not contiguous(t, shape):
                raise RuntimeInputError(f"{name}: {t.name} must be a contiguous fp32 tensor of shape {shape}")
        if blk.dtype is not self.plan.dtype:
            raise RuntimeInputError(f"{name}: o is {getattr(blk.dtype, 'value', blk.dtype)}, built for "
                                    f"{self.plan.dtype.value}")
        if blk.strides[3] != 1 or any(s % COLUMNS_PER_THREAD for s in blk.strides[:3]) or blk.pointer % 16:
            raise RuntimeInputError(f"{name}: o needs a unit stride on head_dim and 16-byte aligned rows "
                                    f"(strides {blk.strides})")
        if len({t.device_id for t in (acc, acc_lse, blk, blk_lse)}) != 1:
            raise RuntimeInputError(f"{name}: o_acc, lse_acc, o and lse must be on one GPU")
        total = batch * heads * b_rows
        if not total:
            return
        grid = (-(-total // self.plan.rows_per_block), 1, 1)
        i32, i64, ptr = np.int32, np.int64, lambda t: np.uintp(t.pointer)  # noqa: E731
        with cupy_module().cuda.Device(acc.device_id):
            self.function()(grid, (self.plan.threads, 1, 1),
                            (ptr(acc), ptr(acc_lse), ptr(blk), ptr(blk_lse), i32(heads), i32(b_rows), i32(rows),
                             i32(row_start), *(i64(s) for s in blk.strides[:3]), i64(total)),
                            stream=caller_stream(o_acc))


_kernels: dict[MergePlan, MergeKernel] = {}


def merge_kernel(dtype: DType, head_dim_v: int) -> MergeKernel:
    """The merge kernel of (dtype, head_dim_v), compiled and loaded once per process."""
    plan = MergePlan(dtype, head_dim_v)
    kernel = _kernels.get(plan)
    if kernel is None:
        kernel = _kernels[plan] = MergeKernel(plan)
        kernel.function()
    return kernel


def merge_float64(o_acc, lse_acc, o, lse, row_start: int = 0) -> None:
    """The same merge in float64 on NumPy arrays or CPU torch tensors, in place (reference.merge_partials)."""
    import numpy as np

    from ..reference.forward import merge_partials
    rows = slice(row_start, row_start + o.shape[2])
    as_numpy = lambda x: x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)  # noqa: E731
    acc, acc_lse = as_numpy(o_acc), as_numpy(lse_acc)
    merged, merged_lse = merge_partials([acc[:, :, rows], as_numpy(o)], [acc_lse[:, :, rows], as_numpy(lse)])
    acc[:, :, rows], acc_lse[:, :, rows] = merged, merged_lse
