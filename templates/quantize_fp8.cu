// FP8 quantization of one attention input (batch, heads, seqlen, D) of 16-bit values, or packed sequences
// (total, heads, D) with cu_seqlens (each sequence's rows are its own batch entry): optional rotation by
// diag(signs) H / sqrt(D) (H the Sylvester Hadamard matrix; the same for Q and K, so it cancels in Q K^T),
// absmax per group of rows, descale = absmax / 448, bytes = e4m3(x * (448 / absmax)) (1 and 1 for all zeros). The
// host defines D, THREADS, ITERS (rows each thread holds), ROTATE, INPUT_BF16, INV_SQRT_D before this header, and
// pastes index_bounds.cuh (packed offsets: the error word's report).
//
// A row is D / 16 consecutive lanes, each holding 16 consecutive values: two 16-byte loads in, one 16-byte store
// out. The butterflies of strides 1..8 run in registers, the longer ones are shuffles between the row's lanes;
// strides go 1, 2, ..., D / 2 (reference/fp8.rotate_rows does the same in the same order). A block covers
// ROWS = ITERS * ROWS_PER_PASS rows and keeps all of them in registers from the load to the store: where the
// block is the descale group (per block, block_rows <= ROWS of them), HBM is read once; per head and per tensor
// (and blocks larger than ROWS) the group spans many blocks, so pass 1 reduces the absmax atomically and pass 2
// reads the rows again.
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

constexpr int VALUES = 16;                     // per lane and row
constexpr int ROW_LANES = D / VALUES;          // lanes per row: 4, 8, 16
constexpr int WARP_ROWS = 32 / ROW_LANES;      // rows a warp holds at once
constexpr int WARPS = THREADS / 32;
constexpr int ROWS_PER_PASS = WARPS * WARP_ROWS;
constexpr float E4M3_MAX = 448.f;

__device__ __forceinline__ float widen(u32 bits) {
#if INPUT_BF16
    return __uint_as_float(bits << 16);
#else
    return __half2float(__ushort_as_half((u16)bits));
#endif
}

// 16 values (two uint4) -> floats, in order.
__device__ __forceinline__ void widen16(float (&x)[VALUES], uint4 a, uint4 b) {
    const u32 words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        x[2 * w] = widen(words[w] & 0xFFFFu);
        x[2 * w + 1] = widen(words[w] >> 16);
    }
}

// The rotation of one row's 16 values of this lane (lane_in_row of ROW_LANES), in rotate_rows' order.
__device__ __forceinline__ void rotate(float (&x)[VALUES], const float (&signs)[VALUES], int lane_in_row) {
#pragma unroll
    for (int e = 0; e < VALUES; ++e) x[e] *= signs[e];
#pragma unroll
    for (int h = 1; h < VALUES; h *= 2)
#pragma unroll
        for (int e = 0; e < VALUES; ++e)
            if ((e & h) == 0) {
                const float a = x[e], b = x[e + h];
                x[e] = a + b;
                x[e + h] = a - b;
            }
#pragma unroll
    for (int m = 1; m < ROW_LANES; m *= 2) {
        // the lower lane of a pair keeps a + b, the upper a - b: other +- x in one rounding, as the model's
        const float sign = (lane_in_row & m) ? -1.f : 1.f;
#pragma unroll
        for (int e = 0; e < VALUES; ++e) x[e] = fmaf(sign, x[e], __shfl_xor_sync(0xffffffffu, x[e], m));
    }
#pragma unroll
    for (int e = 0; e < VALUES; ++e) x[e] *= INV_SQRT_D;   // the host's float32 1 / sqrt(D), as the model's
}

__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    unsigned short low, high;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(low) : "f"(b), "f"(a));   // first source -> high byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(high) : "f"(d), "f"(c));
    return (u32)low | ((u32)high << 16);
}

// mode 0: the block is its descale group (per block): absmax, descale, bytes, one read. mode 1: absmax of the
// block's rows atomically maxed into absmax[slot] (float bits order as unsigned ints for values >= 0). mode 2:
// bytes with descale[slot]. Grid: (row blocks of block_rows, heads, batch or sequences); `group_rows`: rows per
// descale group (mode 0: block_rows; per block in two passes a multiple of block_rows = ROWS), 0 per head (group
// heads of a kv head share one) or per tensor (group 0). With `cu_seqlens` (packed: per head or per tensor only)
// batch entry s is rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of `total`, the grid covers `rows` of each; offsets
// outside the tensor, going down, or a sequence longer than `rows` are reported (tensor code `offsets_tensor`) and
// that sequence's bytes are not written.
extern "C" __global__ void __launch_bounds__(THREADS) quantize_fp8(
        const u16* __restrict__ x, unsigned char* __restrict__ out, float* __restrict__ descale,
        unsigned int* __restrict__ absmax, const float* __restrict__ signs_in, int rows, int heads, int group,
        int group_rows, int block_rows, i64 batch_stride, i64 head_stride, i64 row_stride, i64 out_batch_stride,
        i64 out_head_stride, i64 out_row_stride, const int* __restrict__ cu_seqlens, int total, int offsets_tensor,
        int* error_words, int mode) {
    __shared__ float warp_max[WARPS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int lane_in_row = lane % ROW_LANES, warp_row = lane / ROW_LANES;
    const int head = blockIdx.y, batch = blockIdx.z;
    const int first_row = blockIdx.x * block_rows;
    int start = 0;   // the sequence's first row in the tensor (packed), and its rows from here on
    if (cu_seqlens) {
        start = cu_seqlens[batch];
        const int end = cu_seqlens[batch + 1];
        const bool bad = offsets_bad(start, end, total), long_one = !bad && end - start > rows;
        if (bad || long_one) {   // every block of the sequence stops; one reports
            if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && mode != 2) {
                if (bad) report_offsets(cu_seqlens, batch, total, offsets_tensor, error_words);
                else report_bad_index(error_words, INDEX_SEQUENCE_OVER_MAX, offsets_tensor, batch, batch + 1,
                                      end - start, rows);
            }
            return;
        }
        rows = end - start;
        if (first_row >= rows) return;   // the grid covers the longest sequence: nothing of this one here
    }
    const i64 pair = (i64)batch * heads + head;
    const i64 slot = group_rows ? pair * ((rows + group_rows - 1) / group_rows) + first_row / group_rows
                                : (group > 0 ? (i64)batch * (heads / group) + head / group : 0);
    const u16* base = x + batch * batch_stride + head * head_stride + start * row_stride + lane_in_row * VALUES;
#if ROTATE
    float signs[VALUES];   // this lane's columns are the same in every row
#pragma unroll
    for (int e = 0; e < VALUES; ++e) signs[e] = signs_in[lane_in_row * VALUES + e];
#endif

    float v[ITERS][VALUES];
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {   // every load issued before any is used
        const int local = i * ROWS_PER_PASS + warp * WARP_ROWS + warp_row, row = first_row + local;
        uint4 a = make_uint4(0, 0, 0, 0), b = a;
        if (local < block_rows && row < rows) {
            const uint4* src = reinterpret_cast<const uint4*>(base + row * row_stride);
            a = __ldg(src);
            b = __ldg(src + 1);
        }
        widen16(v[i], a, b);
    }
#if ROTATE
#pragma unroll
    for (int i = 0; i < ITERS; ++i) rotate(v[i], signs, lane_in_row);   // rows past the end rotate zeros
#endif
    float inverse;   // bytes = e4m3(x * (448 / absmax)): one multiply per value (the model's order)
    if (mode != 2) {
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < ITERS; ++i)
#pragma unroll
            for (int e = 0; e < VALUES; ++e) m = fmaxf(m, fabsf(v[i][e]));
#pragma unroll
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) warp_max[warp] = m;
        __syncthreads();
        float b = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) b = fmaxf(b, warp_max[w]);
        if (mode == 1) {
            if (threadIdx.x == 0) atomicMax(absmax + slot, __float_as_uint(b));
            return;
        }
        if (threadIdx.x == 0) descale[slot] = b > 0.f ? b / E4M3_MAX : 1.f;
        inverse = b > 0.f ? E4M3_MAX / b : 1.f;
    } else {
        const float b = __uint_as_float(absmax[slot]);
        inverse = b > 0.f ? E4M3_MAX / b : 1.f;
    }
    unsigned char* out_rows = out + batch * out_batch_stride + head * out_head_stride + start * out_row_stride
                              + lane_in_row * VALUES;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int local = i * ROWS_PER_PASS + warp * WARP_ROWS + warp_row, row = first_row + local;
        if (local >= block_rows || row >= rows) continue;
        float (&r)[VALUES] = v[i];
        uint4 bytes;
#pragma unroll
        for (int e = 0; e < VALUES; ++e) r[e] *= inverse;
        bytes.x = e4m3x4(r[0], r[1], r[2], r[3]);
        bytes.y = e4m3x4(r[4], r[5], r[6], r[7]);
        bytes.z = e4m3x4(r[8], r[9], r[10], r[11]);
        bytes.w = e4m3x4(r[12], r[13], r[14], r[15]);
        *reinterpret_cast<uint4*>(out_rows + (i64)row * out_row_stride) = bytes;
    }
}

// Between the passes of the two-pass granularities: descale = absmax / 448 (1 for all zeros); pass 2 reads absmax.
extern "C" __global__ void descales_from_absmax(const unsigned int* __restrict__ absmax, float* __restrict__ descale,
                                                int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        const float m = __uint_as_float(absmax[i]);
        descale[i] = m > 0.f ? m / E4M3_MAX : 1.f;
    }
}
