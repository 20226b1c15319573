// Dropout on a consumer's tile of P (after the online softmax has summed it into l: l stays the
// undropped sum, and O's final 1 / l is C::KEEP_SCALE / l). A thread's accumulators hold, per 8-key
// tile of S, keys 2 (lane & 3) and 2 (lane & 3) + 1 of rows lane / 4 and lane / 4 + 8; one Philox call
// gives the 4 words of 4 consecutive keys of one row (philox.cuh), so the pair of lanes lane and lane ^ 1
// shares each 4-key group of both its rows. Each lane of the pair draws one row's group (the top row for
// the even lane, the bottom one for the odd) and keeps the two bits of its own keys, and hands its partner
// the other two: every word drawn is used, at one call per thread per 8-key tile and one shuffle per 16.
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
#pragma unroll
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
