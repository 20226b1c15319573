// Dropout on a consumer's tile of P (after the online softmax has summed it into l: l stays the
// undropped sum, and O's final 1 / l is C::KEEP_SCALE / l). A thread's accumulators hold, per 8-key
// tile of S, keys 2 (lane & 3) and 2 (lane & 3) + 1 of rows lane / 4 and lane / 4 + 8; one Philox call
// gives the 4 words of 4 consecutive keys of one row (philox.cuh), so the pair of lanes lane and lane ^ 1
// shares each 4-key group of both its rows. Each lane of the pair draws one row's group (the top row for
// the even lane, the bottom one for the odd) and keeps the two bits of its own keys, and hands its partner
// the other two: every word drawn is used, at one call per thread per 8-key tile and one shuffle per 16.
// The calls run one at a time (unroll 1: each writes only the two bit words): unrolled, ptxas interleaves
// their ten-round chains and runs the consumers out of registers.
template <class C>
__device__ __forceinline__ void dropout_scores(float (&p)[C::M_TILES][C::S_TILES][4], const DropoutRng& rng,
                                               int row0, int col0, int lane) {
    const int odd = lane & 1;
    const u32 row = row0 + (lane >> 2) + 8 * odd;              // the row this lane draws
    const u32 group = (u32)(col0 >> 2) + ((lane >> 1) & 1);    // its 4-key group in the first 8-key tile
    constexpr int CHUNKS = (C::S_TILES + 15) / 16;            // 16 tiles' two bits to a 32-bit word
#pragma unroll
    for (int chunk = 0; chunk < CHUNKS; ++chunk) {
        u32 own = 0, theirs = 0;
#pragma unroll 1
        for (int t = 0; t < 16 && chunk * 16 + t < C::S_TILES; ++t) {
            const u32 keep = keep_bits(rng, group + 2 * (chunk * 16 + t), row, C::DROP_THRESHOLD);
            own |= ((keep >> (2 * odd)) & 3u) << (2 * t);
            theirs |= ((keep >> (2 - 2 * odd)) & 3u) << (2 * t);
        }
        const u32 other = __shfl_xor_sync(0xffffffffu, theirs, 1);
        const u32 top = odd ? other : own, bottom = odd ? own : other;   // rows lane / 4 and lane / 4 + 8
#pragma unroll
        for (int t = 0; t < 16 && chunk * 16 + t < C::S_TILES; ++t) {
            float (&s)[4] = p[0][chunk * 16 + t];
            s[0] = (top >> (2 * t)) & 1u ? s[0] : 0.f;
            s[1] = (top >> (2 * t + 1)) & 1u ? s[1] : 0.f;
            s[2] = (bottom >> (2 * t)) & 1u ? s[2] : 0.f;
            s[3] = (bottom >> (2 * t + 1)) & 1u ? s[3] : 0.f;
        }
    }
}

// The backward's S^T (keys are rows): a thread holds keys lane / 4 and lane / 4 + 8 of its warp's 16 and, per
// 8-query tile, queries 2 (lane & 3) and 2 (lane & 3) + 1, so a 4-key group of one query lies across the 4 lanes
// lane & 19 + 4 r (r = 0..3) -- which between them hold 2 groups (top rows, bottom rows) x 2 queries of each tile:
// 4 Philox calls, one per lane. Lane r draws group (top if r < 2) of query (r & 1) and keeps word k for lane k; a
// shuffle from each of the 4 lanes per 8 tiles gathers, for element e, the words lane r = e drew. keep[c][e] bit
// 4 t is element e of tile 8 c + t (the same (query, key) words as the forward's, hence the same mask).
template <int TILES>
__device__ __forceinline__ void dropout_keep_transposed(u32 (&keep)[(TILES + 7) / 8][4], const DropoutRng& rng,
                                                        int key0, int query0, int lane, u32 threshold) {
    const int r = (lane >> 2) & 3;
    const u32 group = (u32)(key0 >> 2) + (lane >> 4) + 2 * (r >> 1);   // key0: the warp's first key (16 | key0)
    const u32 query = (u32)query0 + 2 * (lane & 3) + (r & 1);
#pragma unroll
    for (int chunk = 0; chunk < (TILES + 7) / 8; ++chunk) {
        u32 drawn = 0;
#pragma unroll 1
        for (int t = 0; t < 8 && chunk * 8 + t < TILES; ++t)
            drawn |= keep_bits(rng, group, query + 8 * (chunk * 8 + t), threshold) << (4 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            keep[chunk][e] = __shfl_sync(0xffffffffu, drawn, (lane & ~12) | (e << 2)) >> r;
    }
}

// The dropped weights of the backward's P^T marked by their sign (P >= 0: a dropped P is stored as -P, and
// an exact 0 counts as dropped, whose gradient terms are 0 either way), so the mask costs no registers
// between the steps that read it: dV's fragments (pack_dropped_fragments) and dS (dropout_softmax_gradient).
template <int TILES>
__device__ __forceinline__ void mark_dropped(float (&p)[1][TILES][4], const DropoutRng& rng, int key0, int query0,
                                             int lane, u32 threshold) {
    u32 keep[(TILES + 7) / 8][4];
    dropout_keep_transposed<TILES>(keep, rng, key0, query0, lane, threshold);
#pragma unroll
    for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!((keep[nt / 8][e] >> (4 * (nt % 8))) & 1u)) p[0][nt][e] = -p[0][nt][e];
}

// P^T's A fragments for dV += (P Z / (1 - p))^T dO: the kept weights scaled, the dropped (negative) ones 0.
template <int K16>
__device__ __forceinline__ void pack_dropped_fragments(u32 (&frag)[K16][4], const float (&x)[1][2 * K16][4],
                                                       float scale) {
#pragma unroll
    for (int kk = 0; kk < K16; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float* s = x[0][2 * kk + half];
            frag[kk][2 * half] = pack2(fmaxf(s[0], 0.f) * scale, fmaxf(s[1], 0.f) * scale);
            frag[kk][2 * half + 1] = pack2(fmaxf(s[2], 0.f) * scale, fmaxf(s[3], 0.f) * scale);
        }
}
