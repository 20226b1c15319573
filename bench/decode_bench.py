"""Flash-decoding benchmark: GB/s of K+V read, next to PyTorch SDPA (cuDNN and flash backends)
measured in the same run, and the device-to-device copy bandwidth as the ceiling.

    python bench/decode_bench.py OUT.json [--quick]

Shapes (head dim 128, bf16, one query per sequence; PEERS.md): batch 1 x 32 heads x 32k,
8 x 32 x 8k, 4 x 32 q heads / 8 kv heads x 64k, 1 x 32 x 128k. GB/s = 2 B Hkv N d 2 bytes / time.
Every variant is validated once against the float64 reference before it is timed. The bundled
spec (specs/decode_d128.tile) is timed with a few pipeline variants (tile kv, stages), so the
spec can be set to the best one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiledsl.tune.bench import record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_specs
from tiledsl import compile  # noqa: E402

SPEC = ROOT / "specs" / "decode_d128.tile"
SHAPES = [(1, 32, 32, 32768), (8, 32, 32, 8192), (4, 32, 8, 65536), (1, 32, 32, 131072)]   # batch, heads, kv_heads, kv_len
VARIANTS = {"spec": {}, "kv64_s3": dict(tile_kv=64, stages=3), "kv64_s4": dict(tile_kv=64, stages=4),
            "kv128_s3": dict(stages=3)}
HEAD_DIM = 128


def copy_gbps(torch) -> float:
    """Device-to-device copy bandwidth (read + write bytes over time) of a 2 GiB buffer."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / (ms * 1e-3) / 1e9


def validate(kernel, q, k, v):
    from tiledsl.reference.gpu import run_errors
    err_o, err_lse = run_errors(kernel, q, k, v)
    if not (err_o < 1e-2 and err_lse < 1e-3):
        raise SystemExit(f"{kernel.name}: validation failed: O error {err_o}, LSE error {err_lse}")
    return err_o, err_lse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write (tiledsl.tune.bench.record)")
    parser.add_argument("--quick", action="store_true", help="the bundled spec only, no variants")
    args = parser.parse_args(argv)
    import torch

    spec = load_specs(str(SPEC))[0]
    variants = {"spec": {}} if args.quick else VARIANTS
    kernels = {name: compile(spec, **overrides) for name, overrides in variants.items()}
    ceiling = copy_gbps(torch)
    print(f"device-to-device copy: {ceiling:.0f} GB/s", flush=True)

    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch, heads, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = 2 * batch * kv_heads * kv_len * HEAD_DIM * 2
        gbps = lambda ms: None if ms is None else nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        peers_ms = sdpa_peers(q, k, v, causal=False)
        peers = {key: gbps(peers_ms.get(key)) for key in ("sdpa_cudnn", "sdpa_flash")}
        errors = {key: value for key, value in peers_ms.items() if key.endswith("_error")}
        for name, kernel in kernels.items():
            err_o, err_lse = validate(kernel, q, k, v)
            run, _, _ = kernel.bind(q, k, v)
            ms = time_ms(run)
            row = {"kernel": kernel.name, "variant": name, "family": "decode", "dtype": "bf16", "head_dim": HEAD_DIM,
                   "batch": batch, "heads": heads, "kv_heads": kv_heads, "kv_len": kv_len,
                   "splits": kernel.last_splits, "split_reason": kernel.last_split_reason, "ms": ms,
                   "gbps": gbps(ms), "fraction_of_copy": gbps(ms) / ceiling, "error_o": err_o, "error_lse": err_lse,
                   "peers": peers, **({"peer_errors": errors} if errors else {})}
            if peers["sdpa_cudnn"]:
                row["vs_sdpa_cudnn"] = row["gbps"] / peers["sdpa_cudnn"]
            rows.append(row)
            print(f"  {name:9s} b{batch} h{heads}/{kv_heads} n{kv_len}: {row['gbps']:.0f} GB/s "
                  f"({kernel.last_splits} splits)", flush=True)
        del q, k, v
        torch.cuda.empty_cache()

    record(args.out, "python bench/decode_bench.py " + " ".join(argv or sys.argv[1:]), rows,
           copy_gbps=ceiling, spec=str(SPEC.relative_to(ROOT)))
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    print(f"\nflash-decoding, d128 bf16, GB/s of K+V (copy ceiling {ceiling:.0f} GB/s)")
    print(f"{'variant':9s} {'batch':>5s} {'heads':>5s} {'kv':>3s} {'kv_len':>7s} {'splits':>6s} {'tiledsl':>8s} "
          f"{'cuDNN':>6s} {'flash':>6s} {'vs cuDNN':>8s}")
    for r in rows:
        print(f"{r['variant']:9s} {r['batch']:5d} {r['heads']:5d} {r['kv_heads']:3d} {r['kv_len']:7d} {r['splits']:6d} "
              f"{r['gbps']:8.0f} {fmt(r['peers']['sdpa_cudnn']):>6s} {fmt(r['peers']['sdpa_flash']):>6s} "
              f"{r.get('vs_sdpa_cudnn', float('nan')):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
