// FP8 (e4m3) inputs of the hopper family: both GEMMs on e4m3 wgmma (m64nNk32, fp32 accumulators), whose
// shared-memory operands are K-major rows of bytes. Q and K land that way by TMA; V lands with keys as rows,
// so the producer's warps 1.. transpose each V tile into V^T (dv rows of the tile's key bytes). P leaves the
// softmax in S's fp32 accumulators and becomes e4m3 A fragments in registers; the keys of V^T are permuted so
// that each thread's accumulators already are its fragments' bytes (no shuffle). The float32 descales
// (value = e4m3 byte * descale) fold into S before the softmax (q * k) and into O at the end (v), or per
// block: Q's per query tile, K's and V's per kv tile (V's ratio between tiles rides on the O rescale).

// The byte offset of (row, byte) in a tile of K-major rows swizzled in SWIZZLE-byte rows (128 or 64; a longer
// row is split into panels of SWIZZLE bytes, `rows` rows each): the 16-byte chunk index XORed with the
// address bits above it, as TMA's swizzle modes lay a box and a wgmma descriptor of that mode reads it.
template <int SWIZZLE>
__device__ __forceinline__ u32 swizzled_offset(int row, int byte, int rows) {
    const u32 linear = (byte / SWIZZLE) * rows * SWIZZLE + row * SWIZZLE + (byte % SWIZZLE);
    return linear ^ (((linear >> 7) & (SWIZZLE / 16 - 1)) << 4);
}

// Shared-memory descriptor of a K-major operand in SWIZZLE-byte rows: start address, leading offset unused
// (a k32 step of 32 bytes stays inside one swizzled row), stride 8 rows, and the swizzle mode (1: 128 B, 2: 64 B).
template <int SWIZZLE>
__device__ __forceinline__ unsigned long long fp8_descriptor(u32 address) {
    constexpr unsigned long long MODE = SWIZZLE == 128 ? 1ull : 2ull;
    return (unsigned long long)((address & 0x3FFFF) >> 4) | (1ull << 16)
         | ((unsigned long long)((8 * SWIZZLE) >> 4) << 32) | (MODE << 62);
}

// S = Q K^T for one warpgroup's 64 rows, issued: D / 32 SS wgmmas, each 32 bytes of every Q and K row.
template <class C>
__device__ __forceinline__ void issue_qk(float (&s)[C::M_TILES][C::S_TILES][4], u32 q_rows, u32 k_tile) {
    float (&d)[C::S_TILES * 4] = reinterpret_cast<float (&)[C::S_TILES * 4]>(s);
    constexpr int STEPS_PER_PANEL = C::QK_SWIZZLE / C::K_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::D / C::K_BYTES; ++ks) {
        const u32 column = (ks % STEPS_PER_PANEL) * C::K_BYTES, panel = ks / STEPS_PER_PANEL;
        wgmma_ss_qk(d, fp8_descriptor<C::QK_SWIZZLE>(q_rows + panel * C::Q_PANEL_BYTES + column),
                    fp8_descriptor<C::QK_SWIZZLE>(k_tile + panel * C::K_PANEL_BYTES + column), ks > 0);
    }
    wgmma_commit();
}

// O += P V, issued (not waited for): P's e4m3 A fragments from registers, V^T's rows K-major.
template <class C>
__device__ __forceinline__ void issue_pv(float (&o)[C::M_TILES][C::O_TILES][4], const u32 (&p_frag)[C::BC / 32][4],
                                         u32 vt_tile) {
    float (&d)[C::O_TILES * 4] = reinterpret_cast<float (&)[C::O_TILES * 4]>(o);
    constexpr int STEPS_PER_PANEL = C::VT_SWIZZLE / C::K_BYTES;
    fence_accumulators(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::BC / 32; ++kk)
        wgmma_rs_pv(d, p_frag[kk], fp8_descriptor<C::VT_SWIZZLE>(vt_tile + (kk / STEPS_PER_PANEL) * C::VT_PANEL_BYTES
                                                                 + (kk % STEPS_PER_PANEL) * C::K_BYTES));
    wgmma_commit();
}

// Four floats -> one register of four e4m3 bytes, `a` in the lowest (cvt's first source lands in the high half).
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
    unsigned short low, high;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(low) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(high) : "f"(d), "f"(c));
    return (u32)low | ((u32)high << 16);
}

// P (fp32, in S's accumulators) * P_SCALE -> e4m3 A fragments of the k32 wgmma. An A register holds 4 keys of
// one row; a thread's accumulators hold keys 2q, 2q+1 of each n8 tile (q = lane % 4), so register 0 of k step kk
// takes those of tiles 4kk and 4kk+1 (row r), register 1 the same of row r+8, registers 2, 3 tiles 4kk+2, 4kk+3.
// The A fragment calls them keys 4q..4q+3: V^T's keys are laid out in that order (transpose_v).
template <class C>
__device__ __forceinline__ void pack_p(u32 (&p_frag)[C::BC / 32][4], const float (&p)[C::M_TILES][C::S_TILES][4]) {
    constexpr float S = C::P_SCALE;
#pragma unroll
    for (int kk = 0; kk < C::BC / 32; ++kk) {
        const float (&t0)[4] = p[0][4 * kk], (&t1)[4] = p[0][4 * kk + 1];
        const float (&t2)[4] = p[0][4 * kk + 2], (&t3)[4] = p[0][4 * kk + 3];
        p_frag[kk][0] = e4m3x4(t0[0] * S, t0[1] * S, t1[0] * S, t1[1] * S);
        p_frag[kk][1] = e4m3x4(t0[2] * S, t0[3] * S, t1[2] * S, t1[3] * S);
        p_frag[kk][2] = e4m3x4(t2[0] * S, t2[1] * S, t3[0] * S, t3[1] * S);
        p_frag[kk][3] = e4m3x4(t2[2] * S, t2[3] * S, t3[2] * S, t3[3] * S);
    }
}

__device__ __forceinline__ u32 load_shared_b32(u32 address) {
    u32 value;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(address));
    return value;
}

// V (Bc key rows of dv bytes, as TMA landed it) -> V^T (dv rows of Bc key bytes), by `thread` of C::TRANSPOSERS.
// A unit is 4 keys x 4 columns: four 4-byte loads, a byte transpose, four 4-byte stores. Within each 16 keys,
// V^T's bytes 4q..4q+3 take V's keys 2q, 2q+1, 8+2q, 9+2q: the order pack_p leaves P's keys in. A warp's 32 units
// are 8 quads x 4 column groups: its loads then spread over more of the swizzled rows' 16-byte chunks (fewer
// bank conflicts than 32 quads of one column group, whose keys share 4 swizzle phases).
template <class C>
__device__ __forceinline__ void transpose_v(u32 v_tile, u32 vt_tile, int thread) {
    constexpr int QUADS = C::BC / 4, UNITS = QUADS * (C::DV / 4);
    static_assert(QUADS % 8 == 0 && C::TRANSPOSERS % 32 == 0, "a warp's units are 8 quads x 4 column groups");
#pragma unroll 1
    for (int unit = thread; unit < UNITS; unit += C::TRANSPOSERS) {
        const int lane_unit = unit % 32, warp_unit = unit / 32;
        const int quad = (warp_unit % (QUADS / 8)) * 8 + lane_unit % 8;
        const int column = ((warp_unit / (QUADS / 8)) * 4 + lane_unit / 8) * 4;
        const int group = (quad / 4) * 16, q = quad % 4;
        const int key = group + 2 * q;
        const u32 r0 = load_shared_b32(v_tile + swizzled_offset<C::V_SWIZZLE>(key, column, C::BC));
        const u32 r1 = load_shared_b32(v_tile + swizzled_offset<C::V_SWIZZLE>(key + 1, column, C::BC));
        const u32 r2 = load_shared_b32(v_tile + swizzled_offset<C::V_SWIZZLE>(key + 8, column, C::BC));
        const u32 r3 = load_shared_b32(v_tile + swizzled_offset<C::V_SWIZZLE>(key + 9, column, C::BC));
        const u32 low01 = __byte_perm(r0, r1, 0x5140), low23 = __byte_perm(r2, r3, 0x5140);    // columns 0, 1
        const u32 high01 = __byte_perm(r0, r1, 0x7362), high23 = __byte_perm(r2, r3, 0x7362);  // columns 2, 3
        const int byte = group + 4 * q;
        store_shared_u32(vt_tile + swizzled_offset<C::VT_SWIZZLE>(column, byte, C::DV), __byte_perm(low01, low23, 0x5410));
        store_shared_u32(vt_tile + swizzled_offset<C::VT_SWIZZLE>(column + 1, byte, C::DV), __byte_perm(low01, low23, 0x7632));
        store_shared_u32(vt_tile + swizzled_offset<C::VT_SWIZZLE>(column + 2, byte, C::DV), __byte_perm(high01, high23, 0x5410));
        store_shared_u32(vt_tile + swizzled_offset<C::VT_SWIZZLE>(column + 3, byte, C::DV), __byte_perm(high01, high23, 0x7632));
    }
}

// One work item's descales (C::DESCALE: 0 per tensor, 1 per (batch, kv head), 2 per block): q * k and v, or
// per block Q's tile descale and the (batch, kv head)'s rows of K and V tile descales.
struct Fp8Descales {
    float qk, v;
    const float* k_tiles;
    const float* v_tiles;
};

template <class C, class Item>
__device__ __forceinline__ Fp8Descales fp8_descales(const float* __restrict__ q_descale, const float* __restrict__ k_descale,
                                                    const float* __restrict__ v_descale, const Item& w, int q_len,
                                                    int kv_len, int heads, int kv_group) {
    const i64 kv_pair = (i64)w.batch * (heads / kv_group) + w.kv_head;
    if constexpr (C::DESCALE == 2) {
        const int q_tiles = (q_len + C::BR - 1) / C::BR, kv_tiles = (kv_len + C::BC - 1) / C::BC;
        return {q_descale[((i64)w.batch * heads + w.head) * q_tiles + w.q0 / C::BR], 1.f,
                k_descale + kv_pair * kv_tiles, v_descale + kv_pair * kv_tiles};
    } else {
        const i64 at = C::DESCALE == 1 ? kv_pair : 0;
        return {q_descale[at] * k_descale[at], v_descale[at], nullptr, nullptr};
    }
}

// S *= q descale * k descale of this kv tile: the softmax then scales true scores.
template <class C>
__device__ __forceinline__ void descale_scores(float (&s)[C::M_TILES][C::S_TILES][4], const Fp8Descales& d, int tile) {
    const float qk = C::DESCALE == 2 ? d.qk * d.k_tiles[tile] : d.qk;
#pragma unroll
    for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nt][e] *= qk;
}

// Per block, O holds sum P V / v descale of the tile last added: moving on to `tile`, O's rescale (alpha)
// also takes the ratio of the last tile's V descale to this one's.
template <class C>
__device__ __forceinline__ void carry_v_descale(float (&alpha)[C::M_TILES][2], const Fp8Descales& d, int tile, int first) {
    if constexpr (C::DESCALE == 2) {
        if (tile > first) {
            const float ratio = d.v_tiles[tile - 1] / d.v_tiles[tile];
            alpha[0][0] *= ratio;
            alpha[0][1] *= ratio;
        }
    }
}

// O *= v descale (per block: the last tile's) / P_SCALE, before the epilogue divides by l.
template <class C>
__device__ __forceinline__ void descale_output(float (&o)[C::M_TILES][C::O_TILES][4], const Fp8Descales& d, int last_tile) {
    const float v = C::DESCALE == 2 ? (last_tile >= 0 ? d.v_tiles[last_tile] : 0.f) : d.v;
    const float scale = v / C::P_SCALE;
#pragma unroll
    for (int nd = 0; nd < C::O_TILES; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[0][nd][e] *= scale;
}
