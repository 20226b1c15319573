// The softmax numerator with a softcap, p = 2^((c tanh(s / c) - m) log2 e), spread four ways over
// Hopper's pipes: a probe for the hopper template's softcap (nothing here ships). exp already keeps
// the MUFU unit busy (16 results / clock / SM, against 128 FMAs), so a second MUFU op per score
// (tanh.approx) halves the softmax's rate unless one of the two moves to the FMA pipes:
//   0  no softcap: ex2 on MUFU                                  (the unmodified kernel's softmax)
//   1  tanh.approx and ex2 on MUFU                              (two MUFU ops per score)
//   2  tanh.approx on MUFU, 2^x by a polynomial on the FMA pipes
//   3  tanh.approx on MUFU, 2^x on MUFU for even scores and the polynomial for odd ones
//   4  tanh on the FMA pipes (1 - 2 / (1 + 2^(2x log2 e)), Newton's reciprocal), ex2 on MUFU
// Each variant has a kernel that maps an array once (accuracy, against float64) and one that keeps
// 32 scores per thread in registers for many rounds (throughput). Compiled by NVRTC
// (bench/experiments/softcap_pipes.py) and, for its ptxas report, by nvcc:
//   nvcc -gencode=arch=compute_90a,code=sm_90a --cubin -Xptxas -v bench/experiments/softcap_pipes.cu

#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float ex2_mufu(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float tanh_mufu(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^x with FADDs, FMAs and two integer ops: x = n + f, n = round(x) by the 1.5 * 2^23 trick, 2^f on
// [-1/2, 1/2] by a degree-4 minimax polynomial (relative error 2.7e-6), n added to the exponent bits.
// x is clamped at -127 (a masked score, -inf, gives ~0).
__device__ __forceinline__ float ex2_fma(float x) {
    const float magic = 12582912.0f;
    x = fmaxf(x, -127.0f);
    float t = x + magic;
    float f = x - (t - magic);
    float p = fmaf(fmaf(fmaf(fmaf(0.009570102207362652f, f, 0.05591785907745361f), f, 0.240247443318367f), f,
                        0.6931217908859253f), f, 0.9999992847442627f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// tanh on the FMA pipes: 1 - 2 / (1 + 2^(2 |x| log2 e)) with the reciprocal by a bit-pattern guess
// and three Newton steps, the sign copied back; |x| is clamped at 15 (tanh is 1 in fp32 from 9).
__device__ __forceinline__ float tanh_fma(float x) {
    float a = fminf(fabsf(x), 15.0f);
    float d = 1.0f + ex2_fma(2.0f * LOG2E * a);
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
    #pragma unroll
    for (int i = 0; i < 3; ++i) {
        float e = fmaf(-d, r, 1.0f);
        r = fmaf(r, e, r);
    }
    return copysignf(fmaf(-2.0f, r, 1.0f), x);
}

// One score: s the scaled score, inv_cap = 1 / c, cap_log2 = c log2 e, m_log2 = m log2 e.
template <int VARIANT>
__device__ __forceinline__ float numerator(float s, float inv_cap, float cap_log2, float m_log2, int lane) {
    if (VARIANT == 0)
        return ex2_mufu(fmaf(s, LOG2E, -m_log2));
    float t = VARIANT == 4 ? tanh_fma(s * inv_cap) : tanh_mufu(s * inv_cap);
    float x = fmaf(t, cap_log2, -m_log2);
    if (VARIANT == 2 || (VARIANT == 3 && (lane & 1)))
        return ex2_fma(x);
    return ex2_mufu(x);
}

template <int VARIANT>
__device__ void map_once(const float* s, float* p, int n, float cap, float m) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        p[i] = numerator<VARIANT>(s[i], 1.0f / cap, cap * LOG2E, m * LOG2E, i);
}

// 32 scores per thread, `rounds` times: each round feeds the row sum back into the scores (one FMA a
// score, the same in every variant), so nothing is hoisted or dropped.
template <int VARIANT>
__device__ void throughput(float* out, int rounds, float cap, float m) {
    float s[32];
    #pragma unroll
    for (int k = 0; k < 32; ++k)
        s[k] = -8.0f + 0.5f * k + 1e-3f * threadIdx.x;
    float inv_cap = 1.0f / cap, cap_log2 = cap * LOG2E, m_log2 = m * LOG2E, sum = 0.0f;
    for (int r = 0; r < rounds; ++r) {
        float row = 0.0f;
        #pragma unroll
        for (int k = 0; k < 32; ++k)
            row += numerator<VARIANT>(s[k], inv_cap, cap_log2, m_log2, k);
        #pragma unroll
        for (int k = 0; k < 32; ++k)
            s[k] = fmaf(row, 1e-9f, s[k]);
        sum += row;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

#define VARIANT_KERNELS(V)                                                                          \
    extern "C" __global__ void map_once_##V(const float* s, float* p, int n, float cap, float m) { \
        map_once<V>(s, p, n, cap, m);                                                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) throughput_##V(float* out, int rounds, float cap, float m) { \
        throughput<V>(out, rounds, cap, m);                                                         \
    }

VARIANT_KERNELS(0)
VARIANT_KERNELS(1)
VARIANT_KERNELS(2)
VARIANT_KERNELS(3)
VARIANT_KERNELS(4)
