// score_mod's derivative on dS^T in the warp-specialized backward (backward_expressions.cuh's slice), pasted after
// it into kernels whose score_mod has a derivative other than 1 (macros.j2's score_grad_of). dS^T = P^T (dP^T - D)
// is multiplied by it before it is packed; where P^T is 0 (masked, padded, underflowed) dS^T stays 0 for a finite
// factor.
//
// A derivative that reads the score is evaluated at score_mod's step, from the scores before it, and held until dS^T
// as bf16 pairs (half the registers of the scores; dS^T itself is rounded to 16 bits for its wgmmas after the
// multiply); one that does not is evaluated at dS^T's step from the indices alone.

template <class C, bool CLAMP>
__device__ __forceinline__ void expression_gradient_t_at(float (&ds)[1][C::BR / 8][4], const ExprItem& x, int key_lo,
                                                         int q_lo, int lane) {
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int2 at = expr_point_t<C, CLAMP>(x, key_lo, q_lo, nt, e, lane);
            ds[0][nt][e] *= score_grad_of(0.f, x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux);
        }
}

// dS^T *= score_mod' of the element's indices (a derivative that does not read the score).
template <class C>
__device__ __forceinline__ void expression_gradient_t(float (&ds)[1][C::BR / 8][4], const ExprItem& x, int key_lo,
                                                      int q_lo, int lane) {
    if (slice_needs_clamp<C>(x, key_lo, q_lo)) expression_gradient_t_at<C, true>(ds, x, key_lo, q_lo, lane);
    else expression_gradient_t_at<C, false>(ds, x, key_lo, q_lo, lane);
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

template <class C, bool CLAMP>
__device__ __forceinline__ void expression_factors_t_at(u32 (&factors)[C::BR / 8][2], const float (&s)[1][C::BR / 8][4],
                                                        const ExprItem& x, int key_lo, int q_lo, int lane) {
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float f[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int e = 2 * h + u;
                const int2 at = expr_point_t<C, CLAMP>(x, key_lo, q_lo, nt, e, lane);
                f[u] = score_grad_of(s[0][nt][e] * C::SCALE, x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux);
            }
            factors[nt][h] = pack_bf16x2(f[0], f[1]);
        }
}

// score_mod' at each element's score before score_mod (S^T, raw units), as bf16 pairs: elements 2h, 2h + 1 of an
// 8-column tile in factors[nt][h].
template <class C>
__device__ __forceinline__ void expression_factors_t(u32 (&factors)[C::BR / 8][2], const float (&s)[1][C::BR / 8][4],
                                                     const ExprItem& x, int key_lo, int q_lo, int lane) {
    if (slice_needs_clamp<C>(x, key_lo, q_lo)) expression_factors_t_at<C, true>(factors, s, x, key_lo, q_lo, lane);
    else expression_factors_t_at<C, false>(factors, s, x, key_lo, q_lo, lane);
}

// dS^T *= the factors expression_factors_t held.
template <class C>
__device__ __forceinline__ void apply_factors(float (&ds)[1][C::BR / 8][4], const u32 (&factors)[C::BR / 8][2]) {
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 pair = factors[nt][e >> 1];
            ds[0][nt][e] *= __uint_as_float((e & 1) ? pair & 0xffff0000u : pair << 16);
        }
}
