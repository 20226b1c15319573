"""`tiledsl run`: run kernels on the GPU on fresh random inputs and validate them against the
exact float64 reference; exit status 1 when any error is over its tolerance."""
from __future__ import annotations

from .common import add_shape_arguments, add_spec_arguments, check_kv_heads, concrete_specs, gpu_ready
from ..spec import DType

TOLERANCE_O, TOLERANCE_LSE = 1e-2, 1e-3   # 16-bit inputs: normwise relative on O, absolute on LSE


def add_arguments(parser) -> None:
    add_spec_arguments(parser)
    add_shape_arguments(parser, seqlen_default=1000)


def validate_spec(spec, batch: int, heads: int, q_len: int, kv_len: int, kv_heads: int | None = None) -> tuple[float,
                                                                                                               float]:
    """(O relative error, LSE max error) of one run on poisoned outputs."""
    from ..tune.bench import random_inputs
    from ..families import compile
    from ..reference.gpu import run_errors
    q, k, v = random_inputs(spec.problem, batch, heads, q_len, kv_len, kv_heads)
    return run_errors(compile(spec), q, k, v)


def run(args) -> int:
    check_kv_heads(args.heads, args.kv_heads)
    specs = concrete_specs(args.specs, args.name)
    gpu_ready("run", specs, torch_for="" if all(s.problem.dtype is DType.FP16 for s in specs) else
              "bf16/fp32 inputs (CuPy has no bfloat16)")
    status = 0
    for spec in specs:
        q_len = spec.problem.queries_per_seq or args.seqlen
        kv_len = args.seqlen_kv or args.seqlen
        err_o, err_lse = validate_spec(spec, args.batch, args.heads, q_len, kv_len, args.kv_heads)
        ok = err_o < TOLERANCE_O and err_lse < TOLERANCE_LSE
        status = status or (0 if ok else 1)
        print(f"{spec.kernel_name}: batch {args.batch}, heads {args.heads}, q {q_len}, kv {kv_len}: "
              f"O rel. error {err_o:.2e} (< {TOLERANCE_O:g}), LSE error {err_lse:.2e} (< {TOLERANCE_LSE:g}) "
              f"{'ok' if ok else 'FAILED'}")
    return status
