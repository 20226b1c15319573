// Dropout's random numbers: Philox4x32-10 (Salmon et al., Random123), the CUDA statement of
// tiledsl/mods/philox.py, word for word: ten rounds of two 32 x 32 -> 64-bit multiplies (__umulhi for
// the high word, a plain multiply for the low one: ptxas fuses them into one wide IMAD, with no 64-bit
// multiply) and the key bumped by the Weyl increments between rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The keys and counter words one (batch entry, head) of a launch draws with: key = (seed lo, seed hi),
// counter = (key j / 4, query i, batch * heads + head, offset lo); word j % 4 drops its weight when
// below the spec's threshold (mods/philox.py).
struct DropoutRng { u32 key0, key1, head, offset; };

__device__ __forceinline__ DropoutRng dropout_rng(unsigned long long seed, unsigned long long offset, int batch,
                                                  int heads, int head) {
    return {(u32)seed, (u32)(seed >> 32), (u32)(batch * heads + head), (u32)offset};
}

// Four keep bits (bit w: word w is at or above `threshold`) of the keys 4 group .. 4 group + 3 of query `row`.
__device__ __forceinline__ u32 keep_bits(const DropoutRng& rng, u32 group, u32 row, u32 threshold) {
    const uint4 w = philox4x32_10(make_uint4(group, row, rng.head, rng.offset), rng.key0, rng.key1);
    return (u32)(w.x >= threshold) | (u32)(w.y >= threshold) << 1 | (u32)(w.z >= threshold) << 2
           | (u32)(w.w >= threshold) << 3;
}
