"""Same-run A/B of the hopper kernel against an earlier rendering of it (one block per item, no
`items` parameter: the template before the persistent launch), to find what the persistent
machinery costs a one-block-per-item launch.

    python bench/experiments/hopper_source_ab.py OUT.json OLD_DIR   # OLD_DIR/old_d128_{none,causal}.cu
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


from hopper_ablation import hopper  # noqa: E402
from tiledsl import compile  # noqa: E402
from tiledsl.tune.bench import attention_flops, prefill_shape, random_inputs, record, sdpa_peers, time_ms
from tiledsl.runtime.tensor_maps import map_arg
from tiledsl.reference.gpu import run_errors


class OldSource:
    """The current kernel object with an older source and the older argument list (no `items`)."""

    def __init__(self, spec, source: str):
        self.kernel = compile(spec)
        self.kernel.source = source
        self.kernel._functions.clear()
        self.name, self.spec = self.kernel.name, spec

    def __call__(self, q, k, v, kv_lens=None, out=None, lse=None):
        from tiledsl.runtime.launch import CallBuilder, i32, pointer_arg, strides_args
        from tiledsl.spec import DType
        kernel, p = self.kernel, self.spec.problem
        b = CallBuilder(kernel.name, (q, k, v, kv_lens, out, lse), kernel.CALL, q, immediate=True)
        qv, kvw, vv, lens = (b.view(i) for i in range(4))
        shapes = kernel.check_inputs(qv, kvw, vv, lens)
        ov = b.output(4, (shapes.batch, shapes.heads, shapes.q_len, p.head_dim_v), p.dtype)
        lv = b.output(5, (shapes.batch, shapes.heads, shapes.q_len), DType.FP32, contiguous=True)
        tile_q, tile_kv = kernel.plan.launch.tile_q, kernel.spec.schedule.tile_kv
        items = -(-shapes.q_len // tile_q) * shapes.batch * shapes.heads
        args = (map_arg(qv, tile_q), map_arg(kvw, tile_kv), map_arg(vv, tile_kv), pointer_arg(ov), pointer_arg(lv),
                pointer_arg(lens), i32(shapes.q_len), i32(shapes.kv_len), i32(shapes.heads),
                i32(shapes.heads // shapes.kv_heads), *strides_args(ov), i32(kernel.order_groups_for(shapes, 0)))
        b.launch(kernel.function(), (items, 1, 1), kernel.plan.launch.threads, kernel.plan.launch.smem_bytes, args,
                 kernel.name)
        return b.run()


def main() -> int:
    out, old_dir = sys.argv[1], Path(sys.argv[2])
    rows = []
    for causal in (False, True):
        spec = hopper(128, causal, "intra")
        new = compile(spec)
        new_grid = compile(spec)
        new_grid.persistent = False
        old = OldSource(spec, (old_dir / f"old_d128_{'causal' if causal else 'none'}.cu").read_text())
        kernels = {"old grid": old, "new grid": new_grid, "new default": new}
        for label, kernel in kernels.items():
            q, k, v = random_inputs(spec.problem, 2, 3, 1000, 1000)
            err = run_errors(kernel, q, k, v)
            assert err[0] < 1e-2 and err[1] < 1e-3, (label, err)
        for n in (4096, 16384):
            batch, heads = prefill_shape(n, 128)
            q, k, v = random_inputs(spec.problem, batch, heads, n, n)
            flops = attention_flops(batch, heads, n, n, 128, causal)
            peers = {name: flops / t / 1e9 for name, t in sdpa_peers(q, k, v, causal).items() if isinstance(t, float)}
            for rep in range(3):   # alternate, so clock drift hits every variant alike
                for label, kernel in kernels.items():
                    ms = time_ms(lambda: kernel(q, k, v))
                    rows.append({"kernel": new.name, "variant": label, "rep": rep, "family": "hopper", "dtype": "bf16",
                                 "head_dim": 128, "seqlen": n, "causal": causal, "ms": ms, "tflops": flops / ms / 1e9,
                                 "peers": peers})
                    print(f"{'causal' if causal else 'none  '} {n:6d} rep {rep} {label:12s} {flops / ms / 1e9:6.1f} "
                          f"(cuDNN {peers.get('sdpa_cudnn', 0):.1f})", flush=True)
    record(out, "python bench/experiments/hopper_source_ab.py " + " ".join(sys.argv[2:]), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
