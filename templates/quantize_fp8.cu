// FP8 quantization of one attention input (batch, heads, seqlen, D) of 16-bit values: optional rotation by
// diag(signs) H / sqrt(D) (H the Sylvester Hadamard matrix; the same for Q and K, so it cancels in Q K^T),
// absmax per group of rows, descale = absmax / 448, bytes = e4m3(x / descale). The host defines D, ROWS (rows
// of a block), ROTATE, INPUT_BF16, INV_SQRT_D before this header. A warp owns whole rows: lane l holds the D / 32
// consecutive values l * E .. l * E + E - 1, so the butterflies of strides < E run in registers and the rest
// are lane shuffles; strides go 1, 2, ..., D / 2 (reference/fp8.rotate_rows does the same in the same order).
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

constexpr int E = D / 32;         // values per lane
constexpr float E4M3_MAX = 448.f;

__device__ __forceinline__ float widen(u16 bits) {
#if INPUT_BF16
    return __uint_as_float((u32)bits << 16);
#else
    return __half2float(__ushort_as_half(bits));
#endif
}

// One row's E values of this lane, rotated (or as they are).
__device__ __forceinline__ void load_row(float (&x)[E], const u16* __restrict__ row, const float* __restrict__ signs,
                                         int lane) {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = widen(row[lane * E + e]);
#if ROTATE
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] *= signs[lane * E + e];
#pragma unroll
    for (int h = 1; h < E; h *= 2)
#pragma unroll
        for (int e = 0; e < E; ++e)
            if ((e & h) == 0) {
                const float a = x[e], b = x[e + h];
                x[e] = a + b;
                x[e + h] = a - b;
            }
#pragma unroll
    for (int m = 1; m < 32; m *= 2)
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, x[e], m);
            x[e] = (lane & m) ? other - x[e] : x[e] + other;
        }
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] *= INV_SQRT_D;   // the host's float32 1 / sqrt(D), as the model's
#endif
}

__device__ __forceinline__ unsigned short e4m3x2(float low, float high) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(high), "f"(low));
    return r;
}

// The absmax of the block's rows (grid: row blocks, heads, batch), atomically maxed into absmax[group]
// (group: the block's own, or its (batch, kv head)'s, or 0, as the host says by group_of).
__device__ __forceinline__ float block_absmax(const u16* __restrict__ x, const float* __restrict__ signs, int rows,
                                              i64 row_stride, int lane, int warp, int warps) {
    float m = 0.f;
    for (int r = warp; r < ROWS; r += warps) {
        const int row = blockIdx.x * ROWS + r;
        if (row >= rows) break;
        float v[E];
        load_row(v, x + row * row_stride, signs, lane);
#pragma unroll
        for (int e = 0; e < E; ++e) m = fmaxf(m, fabsf(v[e]));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// Pass 1 (every granularity): each block's absmax -> absmax[group of the block] (float bits are ordered as
// unsigned ints for values >= 0, so atomicMax on the bits is a float max). With per-block groups pass 2
// follows at once in the same kernel: the block's rows are still in L2.
extern "C" __global__ void __launch_bounds__(256) quantize_fp8(
        const u16* __restrict__ x, unsigned char* __restrict__ out, float* __restrict__ descale,
        unsigned int* __restrict__ absmax, const float* __restrict__ signs, int rows, int heads, int group,
        int per_block, i64 batch_stride, i64 head_stride, i64 row_stride, int pass) {
    __shared__ float warp_max[8];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int head = blockIdx.y, batch = blockIdx.z;
    const u16* base = x + batch * batch_stride + head * head_stride;
    unsigned char* out_base = out + ((i64)batch * heads + head) * (i64)rows * D;
    // the descale group this block belongs to: its own tile, its (batch, kv head) (group heads each), or 0
    const i64 slot = per_block ? ((i64)batch * heads + head) * gridDim.x + blockIdx.x
                               : (group > 0 ? (i64)batch * (heads / group) + head / group : 0);
    if (pass == 1) {
        const float m = block_absmax(base, signs, rows, row_stride, lane, warp, warps);
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            float b = 0.f;
            for (int w = 0; w < warps; ++w) b = fmaxf(b, warp_max[w]);
            if (per_block) {
                const float s = b > 0.f ? b / E4M3_MAX : 1.f;
                descale[slot] = s;
                warp_max[0] = s;
            } else {
                atomicMax(absmax + slot, __float_as_uint(b));
            }
        }
        __syncthreads();
        if (!per_block) return;
    }
    const float s = pass == 1 ? warp_max[0] : descale[slot];
    for (int r = warp; r < ROWS; r += warps) {
        const int row = blockIdx.x * ROWS + r;
        if (row >= rows) break;
        float v[E];
        load_row(v, base + row * row_stride, signs, lane);
        unsigned char* dst = out_base + (i64)row * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; e += 2) *reinterpret_cast<unsigned short*>(dst + e) = e4m3x2(v[e] / s, v[e + 1] / s);
    }
}

// Between the passes of the per-head and per-tensor granularities: descale = absmax / 448 (1 for all zeros).
extern "C" __global__ void descales_from_absmax(const unsigned int* __restrict__ absmax, float* __restrict__ descale,
                                                int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        const float m = __uint_as_float(absmax[i]);
        descale[i] = m > 0.f ? m / E4M3_MAX : 1.f;
    }
}
