"""What computes one block of the ring: tiledsl's GPU kernels, or the float64 reference on the CPU.

Both take one block's queries and keys as views of the local shards and hand back what the ring merges:
    forward(q, k, v, causal, scale)              -> (O, LSE)   O over the block's keys only, LSE natural log
    backward(q, k, v, o, lse, do, causal, scale) -> (dQ, dK, dV) of the block, from the *final* O and LSE
The backward of a block is the ordinary attention backward run with the full row's O and LSE: P = exp(S - LSE)
is then the block's share of the row's softmax and D = rowsum(dO o O) the whole row's, so the blocks' dQ, dK, dV
add up to the gradients of the full attention (what ring-flash-attention and TransformerEngine do too).

`KernelBlocks` runs what tiledsl.attention(..., return_lse=True) and tiledsl.attention_backward run (the tuned
forward, the chosen backward), merges with the generated merge kernel and accumulates in fp32. `ReferenceBlocks`
runs the scheduler graphs in float64 (reference.forward.reference_attention, reference.backward.reference_backward)
and merges with merge_partials: the CPU tests of the ring protocol (gloo) use it to check the ring to 1e-12."""
from __future__ import annotations

from ..errors import RuntimeInputError
from .merge import merge_float64, merge_kernel


class KernelBlocks:
    """tiledsl's kernels on CUDA torch tensors (fp16 / bf16)."""
    name = "kernels"

    def __init__(self, deterministic: bool = False):
        self.deterministic = deterministic

    @staticmethod
    def accumulator_dtype(torch):
        return torch.float32

    def forward(self, q, k, v, causal: bool, scale):
        from ..dispatch.tuned import forward
        return forward(q.detach(), k.detach(), v.detach(), causal, None, scale)

    def backward(self, q, k, v, o, lse, do, causal: bool, scale):
        from ..dispatch.backward import attention_backward
        return attention_backward(q.detach(), k.detach(), v.detach(), o.detach(), lse.contiguous(), do.detach(),
                                  causal=causal, scale=scale, deterministic=self.deterministic)

    def merge(self, o_acc, lse_acc, o, lse, row_start: int) -> None:
        from ..runtime.tensors import view
        merge_kernel(view(o, "o").dtype, o.shape[-1])(o_acc, lse_acc, o, lse.contiguous(), row_start)


class ReferenceBlocks:
    """The float64 reference executor on CPU torch tensors (any float dtype; computed in float64)."""
    name = "reference"

    @staticmethod
    def accumulator_dtype(torch):
        return torch.float64

    @staticmethod
    def _spec(q, v, causal: bool, scale, backward: bool):
        from ..spec import BackwardSchedule, DType, KernelSpec, Mask, Problem, Schedule
        problem = Problem(q.shape[-1], v.shape[-1], DType.FP32, Mask.CAUSAL if causal else Mask.NONE,
                          softmax_scale=None if scale is None else float(scale))
        return KernelSpec("ring_block", problem, Schedule(), backward=BackwardSchedule() if backward else None)

    @staticmethod
    def _numpy(*xs):
        return tuple(x.detach().double().numpy() for x in xs)

    def forward(self, q, k, v, causal: bool, scale):
        import torch

        from ..reference.forward import reference_attention
        o, lse = reference_attention(self._spec(q, v, causal, scale, False), *self._numpy(q, k, v))
        return torch.from_numpy(o), torch.from_numpy(lse)

    def backward(self, q, k, v, o, lse, do, causal: bool, scale):
        import torch

        from ..reference.backward import reference_backward
        q64, k64, v64, o64, lse64, do64 = self._numpy(q, k, v, o, lse, do)
        grads = reference_backward(self._spec(q, v, causal, scale, True), q64, k64, v64, do64, o=o64, lse=lse64)
        return tuple(torch.from_numpy(g) for g in grads)

    def merge(self, o_acc, lse_acc, o, lse, row_start: int) -> None:
        merge_float64(o_acc, lse_acc, o, lse, row_start)


def blocks_for(q, blocks=None):
    """The block engine for `q`: `blocks` ("kernels", "reference" or an engine object) or, when None,
    kernels for CUDA tensors and the float64 reference for CPU ones."""
    if blocks is None:
        blocks = "kernels" if q.is_cuda else "reference"
    if isinstance(blocks, str):
        table = {"kernels": KernelBlocks, "reference": ReferenceBlocks}
        if blocks not in table:
            raise ValueError(f"ring_attention: blocks must be one of {sorted(table)} or an engine, got {blocks!r}")
        blocks = table[blocks]()
    if blocks.name == "kernels" and not q.is_cuda:
        raise RuntimeInputError("ring_attention: q is on the CPU; tiledsl's kernels need CUDA tensors "
                                "(blocks='reference' runs the float64 reference on the CPU)")
    if blocks.name == "reference" and q.is_cuda:
        raise RuntimeInputError("ring_attention: the float64 reference runs on CPU tensors; q is on "
                                f"{q.device} (blocks='kernels' runs tiledsl's kernels)")
    return blocks
