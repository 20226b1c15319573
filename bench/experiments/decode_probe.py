"""Decode: where the time goes, measured (a probe; its numbers go to bench/results, nothing here ships).

  python bench/experiments/decode_probe.py ceiling OUT.json
      The read ceiling under the bench's own timing (triton do_bench: L2 flushed before every
      call), at the byte counts of the issue's shapes: a plain streaming-read kernel (16-byte
      loads, several in flight per thread, one contiguous range per block) at 264 and 1056
      blocks, and the same ranges read with TMA bulk copies (cp.async.bulk into a shared-memory
      ring, one thread per block). cuDNN is timed on the matching decode shapes in the same run.

  python bench/experiments/decode_probe.py timeline OUT.json
      The bundled decode spec with %globaltimer stamps per block (entry, end of the kv loop, end
      of the epilogue, SM id) and at the end of each merge: the start skew, the spread of block
      finish times and the merge tail, in microseconds from the first block's entry.
"""
from __future__ import annotations

import statistics
import sys

import cupy
import numpy as np
import torch

from tiledsl.tune.bench import patch_source, record, sdpa_peers, time_ms
from tiledsl.frontend.parse import load_spec
from tiledsl import compile
from tiledsl.reference.gpu import run_errors

SHAPES = [(1, 32, 32, 32768), (4, 32, 8, 65536), (8, 32, 32, 8192), (1, 32, 32, 131072)]

READ_SOURCE = r"""
typedef unsigned long long u64;
#ifndef UNROLL
#define UNROLL 8
#endif
#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef STAGES
#define STAGES 4
#endif
extern "C" __global__ void read_ldg(const uint4* __restrict__ src, long long n16, long long per_block, unsigned* sink) {
    const long long begin = (long long)blockIdx.x * per_block;
    const long long end = min(begin + per_block, n16);
    unsigned acc = 0;
    for (long long i = begin + threadIdx.x; i < end; i += (long long)blockDim.x * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long j = i + (long long)u * blockDim.x;
            if (j < end) asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + j));
            else v[u] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;   // keeps the loads; practically never true
}

// One thread per block streams its range through a ring of STAGES buffers of CHUNK bytes with
// bulk async copies; each completed buffer is released at once (only one word is read).
extern "C" __global__ void read_bulk(const char* __restrict__ src, long long bytes, long long per_block, unsigned* sink) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 full[STAGES];
    if (threadIdx.x != 0) return;
    const long long begin = (long long)blockIdx.x * per_block;
    const long long end = min(begin + per_block, bytes);
    const int chunks = (int)((end - begin + CHUNK - 1) / CHUNK);
    const unsigned ring_base = (unsigned)__cvta_generic_to_shared(ring);
    for (int s = 0; s < STAGES; ++s) {
        const unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    auto issue = [&](int c) {
        const int s = c % STAGES;
        const unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
        const unsigned n = (unsigned)min((long long)CHUNK, end - begin - (long long)c * CHUNK);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(ring_base + s * CHUNK), "l"(src + begin + (long long)c * CHUNK), "r"(n), "r"(bar) : "memory");
    };
    for (int c = 0; c < STAGES && c < chunks; ++c) issue(c);
    unsigned acc = 0;
    for (int c = 0; c < chunks; ++c) {
        const int s = c % STAGES;
        const unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
        const unsigned parity = (c / STAGES) & 1;
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        acc ^= *reinterpret_cast<volatile unsigned*>(ring + s * CHUNK);
        if (c + STAGES < chunks) issue(c + STAGES);
    }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;
}
"""


def read_kernel(name: str, **defines):
    options = ("--std=c++17", "-arch=sm_90a", *(f"-D{k}={v}" for k, v in defines.items()))
    return cupy.RawModule(code=READ_SOURCE, options=options).get_function(name)


def ceiling(out_path: str) -> None:
    rows = []
    sink = cupy.zeros(4096, dtype=cupy.uint32)
    for batch, heads, kv_heads, kv_len in SHAPES:
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        buf = cupy.random.randint(0, 2**31, size=nbytes // 4, dtype=cupy.int32)
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cudnn = nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6
        del q, k, v
        results = {}
        for blocks in (264, 1056):
            for threads, unroll in ((128, 8), (256, 8), (256, 16)):
                fn = read_kernel("read_ldg", UNROLL=unroll)
                n16 = nbytes // 16
                per = -(-n16 // blocks)
                run = lambda: fn((blocks,), (threads,), (buf, np.int64(n16), np.int64(per), sink))  # noqa: E731
                results[f"ldg b{blocks} t{threads} u{unroll}"] = nbytes / time_ms(run) / 1e6
        for blocks, chunk, stages in ((264, 16384, 4), (264, 16384, 6), (264, 32768, 3), (132, 32768, 6)):
            fn = read_kernel("read_bulk", CHUNK=chunk, STAGES=stages)
            fn.max_dynamic_shared_size_bytes = chunk * stages
            per = -(-nbytes // blocks // 16) * 16
            run = lambda: fn((blocks,), (32,), (buf, np.int64(nbytes), np.int64(per), sink), shared_mem=chunk * stages)  # noqa: E731
            results[f"bulk b{blocks} c{chunk} s{stages}"] = nbytes / time_ms(run) / 1e6
        print(f"b{batch} h{heads}/{kv_heads} n{kv_len}: {nbytes / 1e6:.0f} MB  cuDNN {cudnn:.0f} GB/s", flush=True)
        for name, gbps in results.items():
            print(f"    {name:24s} {gbps:6.0f} GB/s", flush=True)
        rows.append({"batch": batch, "heads": heads, "kv_heads": kv_heads, "kv_len": kv_len, "bytes": nbytes,
                     "read_gbps": results, "peers": {"sdpa_cudnn_gbps": cudnn}})
        del buf
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    record(out_path, "python bench/experiments/decode_probe.py ceiling OUT", rows)


STAMP_HELPERS = r"""
__device__ unsigned long long probe_stamps[16384 * 4];
__device__ unsigned long long probe_merge_end[16384];
__device__ __forceinline__ unsigned long long probe_time() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ unsigned probe_smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
"""
TIMELINE_PATCHES = (   # (anchor, replacement); each anchor must occur exactly once
    ('extern "C" __global__', STAMP_HELPERS + 'extern "C" __global__'),
    ("    extern __shared__ __align__(128) unsigned char smem[];\n",
     "    extern __shared__ __align__(128) unsigned char smem[];\n    const unsigned long long probe_t0 = probe_time();\n"),
    ("    cp_async_wait<0>();\n    __syncthreads();   // the combine's scratch",
     "    const unsigned long long probe_t1 = probe_time();\n    cp_async_wait<0>();\n    __syncthreads();   // the combine's scratch"),
    ("    if (!o_part) return;\n",
     "    __syncthreads();\n    if (threadIdx.x == 0) {\n"
     "        const long long id = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);\n"
     "        probe_stamps[id * 4] = probe_t0; probe_stamps[id * 4 + 1] = probe_t1;\n"
     "        probe_stamps[id * 4 + 2] = probe_time(); probe_stamps[id * 4 + 3] = probe_smid();\n    }\n"
     "    if (!o_part) return;\n"),
    ("    if (threadIdx.x == 0) *counter = 0;\n",
     "    if (threadIdx.x == 0) { *counter = 0; probe_merge_end[blockIdx.z * gridDim.y + blockIdx.y] = probe_time(); }\n"),
)


def percentiles(values) -> dict:
    values = sorted(values)
    pick = lambda f: round(float(values[min(len(values) - 1, int(f * len(values)))]), 2)  # noqa: E731
    return {"min": pick(0), "p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": pick(1.0)}


def device_global(kernel, name: str, nbytes: int):
    address = kernel._module.get_global_var(name)
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(address, nbytes, kernel), 0)


def timeline(out_path: str) -> None:
    base = compile(load_spec("specs/decode_d128.tile"))
    probe = compile(load_spec("specs/decode_d128.tile"))
    patch_source(probe, TIMELINE_PATCHES)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    rows = []
    for batch, heads, kv_heads, kv_len in SHAPES:
        q = torch.randn(batch, heads, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nbytes = 2 * batch * kv_heads * kv_len * 128 * 2
        err = run_errors(probe, q, k, v)
        run_base, _, _ = base.bind(q, k, v)
        run_probe, _, _ = probe.bind(q, k, v)
        gbps = {"spec": nbytes / time_ms(run_base) / 1e6, "probe": nbytes / time_ms(run_probe) / 1e6}
        cudnn = nbytes / sdpa_peers(q, k, v, False)["sdpa_cudnn"] / 1e6
        blocks = probe.last_splits * kv_heads * batch
        stamps_ptr = device_global(probe, "probe_stamps", 16384 * 4 * 8)
        merge_ptr = device_global(probe, "probe_merge_end", 16384 * 8)
        runs = []
        for _ in range(5):   # a flushed L2 before each, as the bench times it
            flush.zero_()
            torch.cuda.synchronize()
            run_probe()
            torch.cuda.synchronize()
            stamps = cupy.ndarray((16384 * 4,), cupy.uint64, stamps_ptr).get()[: blocks * 4].reshape(blocks, 4)
            merges = cupy.ndarray((16384,), cupy.uint64, merge_ptr).get()[: kv_heads * batch]
            t0 = stamps[:, 0].min()
            us = lambda t: (t.astype(np.float64) - float(t0)) / 1e3  # noqa: E731
            entry, loop_end, block_end = us(stamps[:, 0]), us(stamps[:, 1]), us(stamps[:, 2])
            run = {"entry_us": percentiles(entry), "loop_end_us": percentiles(loop_end),
                   "block_end_us": percentiles(block_end), "loop_us": percentiles(loop_end - entry),
                   "sms_used": int(len(set(stamps[:, 3].tolist())))}
            if probe.last_splits > 1:
                run["merge_end_us"] = percentiles(us(merges))
            runs.append(run)
        # the last run in full: (split, kv group) order, SM id, entry, loop end, block end
        raw = {"sm": stamps[:, 3].astype(int).tolist(), "entry_us": np.round(entry, 2).tolist(),
               "loop_end_us": np.round(loop_end, 2).tolist(), "block_end_us": np.round(block_end, 2).tolist()}
        if probe.last_splits > 1:
            raw["merge_end_us"] = np.round(us(merges), 2).tolist()
        last = runs[-1]
        print(f"b{batch} h{heads}/{kv_heads} n{kv_len:6d}: spec {gbps['spec']:.0f} GB/s, probe {gbps['probe']:.0f},"
              f" cuDNN {cudnn:.0f}; {blocks} blocks on {last['sms_used']} SMs, err {err[0]}", flush=True)
        for run in runs:
            print("   entry", run["entry_us"], "\n   loop ", run["loop_us"], "\n   end  ", run["block_end_us"],
                  "\n   merge", run.get("merge_end_us"), flush=True)
        rows.append({"kernel": probe.name, "batch": batch, "heads": heads, "kv_heads": kv_heads, "kv_len": kv_len,
                     "splits": probe.last_splits, "gbps": gbps, "error_o": err[0], "runs": runs, "last_run": raw,
                     "peers": {"sdpa_cudnn_gbps": cudnn}})
        del q, k, v
        torch.cuda.empty_cache()
    record(out_path, "python bench/experiments/decode_probe.py timeline OUT", rows,
           median_block_end_spread_us=statistics.median(r["runs"][-1]["block_end_us"]["max"] - r["runs"][-1]["block_end_us"]["p10"] for r in rows))


if __name__ == "__main__":
    {"ceiling": ceiling, "timeline": timeline}[sys.argv[1]](sys.argv[2])
