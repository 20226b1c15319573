// Helpers of the backward kernels (backward.cu.j2 on mma.sync, backward_wgmma.cu.j2, backward_ws.cu.j2), after
// unpack.cuh and index_bounds.cuh.

// A bad kv_lens entry (index_bounds.cuh: outside [0, the keys k holds]) gives its sequence no key in the main
// kernel (no q tile visits a kv tile of it, so nothing is read through it), one block of it reports the entry,
// and every kernel that stores a gradient of it (dK, dV; dQ from the convert or the dq kernel) stores it NaN:
// the factor a gradient is stored with is NaN for a bad sequence, `scale` otherwise (one select at the store;
// its accumulators hold zeros, as it visited nothing, and zero times NaN is NaN). The kernels at their register
// limit ask kv_lens again at the store rather than hold the flag across their loop (backward_ops.j2).
__device__ __forceinline__ float bad_sequence_scale(bool bad_sequence, float scale) {
    return bad_sequence ? QUIET_NAN : scale;
}

// 4-byte global->shared copy, zero-filled when `valid` is false.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ float2 load_shared_f2(u32 address) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(address));
    return v;
}
// Two adjacent fp32 adds to global memory in one vector reduction (sm_90).
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
}
// Four adjacent fp32 adds (16-byte aligned) in one vector reduction (sm_90).
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// LSE in log2 units; a row that saw no key (LSE = -inf) gets +inf so that exp2(s - lse) is 0, not NaN.
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == NEG_INF ? -NEG_INF : lse * 1.4426950408889634f;
}

// Rows r of acc (16 per m-tile, from row0) as 16-bit values to global rows < rows_valid, times `scale`.
template <int MT, int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[MT][NT][4], u16* rows, i64 row_stride, int row0, int rows_valid,
                                           float scale, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + (lane >> 2) + 8 * h;
            if (row < rows_valid)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    *reinterpret_cast<u32*>(rows + row * row_stride + nt * 8 + (lane & 3) * 2) =
                        pack2(acc[mt][nt][2 * h] * scale, acc[mt][nt][2 * h + 1] * scale);
        }
}
