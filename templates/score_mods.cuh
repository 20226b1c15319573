// Score modifications between S = Q K^T and the mask (mods/model.py's order: softcap, then ALiBi), on the
// consumer's S accumulators in the raw units the softmax scales: the softmax computes
// exp(SCALE * (s - m)), so a modification of the scaled score t = SCALE * s writes f(t) / SCALE.
// Pasted only into kernels whose plan has a modification.

// 2^x on the FMA pipes: x = n + f with n = round(x) by adding 1.5 * 2^23, 2^f on [-1/2, 1/2] by a
// degree-4 minimax polynomial (relative error under 3e-6), n added to the exponent bits. x is clamped
// at -126 so the exponent never underflows (only tanh_fma calls it, with x >= 0).
__device__ __forceinline__ float exp2_fma(float x) {
    const float round_shift = 12582912.0f;
    x = fmaxf(x, -126.0f);
    const float t = x + round_shift;
    const float f = x - (t - round_shift);
    const float p = fmaf(fmaf(fmaf(fmaf(0.009570102207362652f, f, 0.05591785907745361f), f, 0.240247443318367f), f,
                              0.6931217908859253f), f, 0.9999992847442627f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// tanh on the FMA pipes: 1 - 2 / (1 + 2^(2 |x| log2 e)), the reciprocal from a bit-pattern guess and
// three Newton steps, the sign copied back; |x| is clamped at 15 (tanh is 1 in fp32 from 9). Why not
// MUFU's tanh.approx (one instruction): the softmax's ex2 already issues on MUFU once per score, and
// tanh.approx's 2^-11 relative error comes back multiplied by the cap in the exponent (cap 50: p off by
// up to 2.4%, an LSE off by as much); this form is good to about 1e-6 absolute, so the capped logit
// is off by cap * 1e-6, and its ~20 instructions issue on the FP32 and integer pipes, which have
// eight times MUFU's rate and little else to do in the softmax.
__device__ __forceinline__ float tanh_fma(float x) {
    const float a = fminf(fabsf(x), 15.0f);
    const float d = 1.0f + exp2_fma(2.0f * 1.4426950408889634f * a);
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
    for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.0f), r);
    return copysignf(fmaf(-2.0f, r, 1.0f), x);
}

// softcap: t = SCALE s becomes cap tanh(t / cap), written back as (cap / SCALE) tanh(s SCALE / cap).
template <class C>
__device__ __forceinline__ void softcap_scores(float (&s)[C::M_TILES][C::S_TILES][4]) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = C::SOFTCAP_OUT * tanh_fma(s[mt][nt][e] * C::SOFTCAP_IN);
}

// ALiBi: t -= slope |i + kv_len - q_len - j|; `slope` is already -slope / SCALE (raw units), and
// `position0` is i + kv_len - q_len - j of this warp's first row and the tile's first key, so each
// element's distance is that plus its constant offset in the fragment (lane terms added once).
template <class C>
__device__ __forceinline__ void alibi_scores(float (&s)[C::M_TILES][C::S_TILES][4], float slope, int position0,
                                             int lane) {
    const float lane_position = (float)(position0 + acc_row(lane, 0) - acc_col(lane, 0));
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float offset = (float)(mt * 16 + ((e >> 1) << 3) - nt * 8 - (e & 1));
                s[mt][nt][e] = fmaf(slope, fabsf(lane_position + offset), s[mt][nt][e]);
            }
}
