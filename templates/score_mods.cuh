// Score modifications between S = Q K^T and the mask (mods/model.py's order: softcap, then ALiBi), on the
// consumer's S accumulators in the raw units the softmax scales: the softmax computes
// exp(SCALE * (s - m)), so a modification of the scaled score t = SCALE * s writes f(t) / SCALE.
// Pasted only into kernels whose plan has a modification.

// 2^x on the FMA pipes: x = n + f with n = round(x) by adding 1.5 * 2^23, 2^f on [-1/2, 1/2] by a
// degree-4 minimax polynomial (relative error under 4e-6), n added to the exponent bits. x is clamped
// at -126 so the exponent never underflows past the smallest normal (softcap calls it with x <= 0).
__device__ __forceinline__ float exp2_fma(float x) {
    const float round_shift = 12582912.0f;
    x = fmaxf(x, -126.0f);
    const float t = x + round_shift;
    const float f = x - (t - round_shift);
    const float p = fmaf(fmaf(fmaf(fmaf(0.009570102207362652f, f, 0.05591785907745361f), f, 0.240247443318367f), f,
                              0.6931217908859253f), f, 0.9999992847442627f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// c0 + c1 x + c2 x^2 + ... by Horner's rule: one FMA per degree.
__device__ __forceinline__ float horner(float, float c) { return c; }
template <class... Rest>
__device__ __forceinline__ float horner(float x, float c, Rest... rest) { return fmaf(horner(x, rest...), x, c); }

// softcap's quotient (cap / SCALE) (1 - w) / (1 + w) as a polynomial in w in [0, 1]: tanh(a) for
// w = e^(-2a), back in raw units. Each kernel defines it with its cap's coefficients (C::SOFTCAP_Q*).
template <class C>
__device__ __forceinline__ float softcap_quotient(float w);

// softcap: t = SCALE s becomes cap tanh(t / cap), written back as (cap / SCALE) tanh(SCALE |s| / cap) with
// s's sign. w = 2^(|s| SOFTCAP_EXP) = e^(-2 SCALE |s| / cap) comes from MUFU's ex2 in the first
// SOFTCAP_MUFU_TILES 8-column tiles of S and from the FMA pipes in the rest, so the lowering can move
// the work between the two (mods/softcap.py: ex2 takes every tile, fma none, split half).
template <class C>
__device__ __forceinline__ void softcap_scores(float (&s)[C::M_TILES][C::S_TILES][4]) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = fabsf(s[mt][nt][e]) * C::SOFTCAP_EXP;
                const float w = nt < C::SOFTCAP_MUFU_TILES ? fast_exp2(x) : exp2_fma(x);
                s[mt][nt][e] = copysignf(softcap_quotient<C>(w), s[mt][nt][e]);
            }
}

// softcap by MUFU's tanh.approx (one op a score; the rules allow it only where its error fits).
template <class C>
__device__ __forceinline__ void softcap_scores_tanh_approx(float (&s)[C::M_TILES][C::S_TILES][4]) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = C::SOFTCAP_OUT * tanh_approx(s[mt][nt][e] * C::SOFTCAP_IN);
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

// ALiBi on rows that each carry their own slope and key position (decode's packed (head, query) rows):
// t -= slope |position - j| for key j = key0 + the element's column; `slope` is already -slope / SCALE (raw
// units). Each row's distance to the lane's first key is taken once, then each element adds its column.
template <class C>
__device__ __forceinline__ void alibi_scores_rows(float (&s)[C::M_TILES][C::S_TILES][4], const float (&slope)[C::M_TILES][2],
                                                  const int (&position)[C::M_TILES][2], int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt) {
        const float distance0[2] = {(float)(position[mt][0] - key0 - acc_col(lane, 0)),
                                    (float)(position[mt][1] - key0 - acc_col(lane, 0))};
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[mt][nt][e] = fmaf(slope[mt][e >> 1], fabsf(distance0[e >> 1] - (float)(nt * 8 + (e & 1))), s[mt][nt][e]);
    }
}
