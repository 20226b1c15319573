// decode's FP8 path `dequant shared`: each warp converts its slice into a 16-bit tile (reads decode's
// C and W; after fp8_kv.cuh).
// One warp's slice (ROWS keys) of an e4m3 ring tile (`from`: unswizzled rows of ROW8 bytes, CHUNKS8
// 16-byte chunks) -> the 16-bit mma.sync tile at `to` (rows of ROW_BYTES, SWIZZLE): each lane
// turns one 16-byte chunk (16 values) into two 16-byte chunks. The scales are applied in fp32
// later (K's to the scores, V's to the output), so the values here are the stored ones.
template <int ROWS, int CHUNKS8, int ROW8, int ROW_BYTES, bool SWIZZLE>
__device__ __forceinline__ void dequant_slice(u32 to, u32 from, int lane) {
    constexpr int TOTAL = ROWS * CHUNKS8;
#pragma unroll
    for (int i = 0; i < (TOTAL + 31) / 32; ++i) {
        const int index = i * 32 + lane;
        if (TOTAL % 32 == 0 || index < TOTAL) {
            const int row = index / CHUNKS8, chunk = index % CHUNKS8;
            const uint4 bytes = load_shared_v4(from + row * ROW8 + chunk * 16);
            const u32 w[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
            u32 out[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                out[2 * j] = dequant_e4m3x2(w[j] & 0xffffu);
                out[2 * j + 1] = dequant_e4m3x2(w[j] >> 16);
            }
#pragma unroll
            for (int half = 0; half < 2; ++half)
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                             :: "r"(to + chunk_offset<ROW_BYTES, SWIZZLE>(row, 2 * chunk + half)),
                                "r"(out[4 * half]), "r"(out[4 * half + 1]), "r"(out[4 * half + 2]), "r"(out[4 * half + 3]));
        }
    }
}
