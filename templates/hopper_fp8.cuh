// FP8 (e4m3) inputs of the hopper family: both GEMMs on e4m3 wgmma (m64nNk32, fp32 accumulators), whose
// shared-memory operands are K-major rows of bytes. Q and K land that way by TMA; V lands with keys as rows,
// so the producer's warps 1.. transpose each V tile into V^T (dv rows of the tile's key bytes) on chip. P leaves the
// softmax in S's fp32 accumulators and becomes e4m3 A fragments in registers; the keys of V^T are permuted so
// that each thread's accumulators already are its fragments' bytes (no shuffle). The float32 descales
// (value = e4m3 byte * descale) fold into the softmax's scale (q * k) and into O at the end (v), or per
// block: Q's per query tile, K's and V's per kv tile (V's ratio between tiles rides on the O rescale).

// The byte offset of (row, byte) in a tile of K-major rows swizzled in SWIZZLE-byte rows (128 or 64; a longer
// row is split into panels of SWIZZLE bytes, `rows` rows each): the 16-byte chunk index XORed with the
// address bits above it, as TMA's swizzle modes lay a box and a wgmma descriptor of that mode reads it.
// linear_offset is the address before the XOR and swizzle_bits the XOR: a 1024-byte swizzle atom (8 rows of
// 128 bytes, 16 of 64) keeps one phase per row within it, so moving by whole atoms and by whole 32-byte pieces
// of a row (inside a swizzled row) leaves the XOR as it is: offset = (linear a + linear b) ^ bits(b).
template <int SWIZZLE>
__device__ __forceinline__ u32 linear_offset(unsigned row, unsigned byte, unsigned rows) {
    return (byte / SWIZZLE) * rows * SWIZZLE + row * SWIZZLE + (byte % SWIZZLE);
}
template <int SWIZZLE>
__device__ __forceinline__ u32 swizzle_bits(u32 linear) { return ((linear >> 7) & (SWIZZLE / 16 - 1)) << 4; }
template <int SWIZZLE>
__device__ __forceinline__ u32 swizzled_offset(unsigned row, unsigned byte, unsigned rows) {
    const u32 linear = linear_offset<SWIZZLE>(row, byte, rows);
    return linear ^ swizzle_bits<SWIZZLE>(linear);
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

// P (fp32, in S's accumulators, already P_SCALE times the weights: fp8_softmax_update) -> e4m3 A fragments of
// the k32 wgmma. An A register holds 4 keys of one row; a thread's accumulators hold keys 2q, 2q+1 of each n8
// tile (q = lane % 4), so register 0 of k step kk takes those of tiles 4kk and 4kk+1 (row r), register 1 the
// same of row r+8, registers 2, 3 tiles 4kk+2, 4kk+3. The A fragment calls them keys 4q..4q+3: V^T's keys are
// laid out in that order (transpose_v).
template <class C>
__device__ __forceinline__ void pack_p(u32 (&p_frag)[C::BC / 32][4], const float (&p)[C::M_TILES][C::S_TILES][4]) {
#pragma unroll
    for (int kk = 0; kk < C::BC / 32; ++kk) {
        const float (&t0)[4] = p[0][4 * kk], (&t1)[4] = p[0][4 * kk + 1];
        const float (&t2)[4] = p[0][4 * kk + 2], (&t3)[4] = p[0][4 * kk + 3];
        p_frag[kk][0] = e4m3x4(t0[0], t0[1], t1[0], t1[1]);
        p_frag[kk][1] = e4m3x4(t0[2], t0[3], t1[2], t1[3]);
        p_frag[kk][2] = e4m3x4(t2[0], t2[1], t3[0], t3[1]);
        p_frag[kk][3] = e4m3x4(t2[2], t2[3], t3[2], t3[3]);
    }
}

__device__ __forceinline__ void store_matrix_x4(u32 address, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(address), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// V (Bc key rows of dv bytes, as TMA landed it) -> V^T (dv rows of Bc key bytes), by the C::TRANSPOSERS threads
// (`thread` of them), a warp at a time on units of 16 keys x 32 columns. One transposed ldmatrix reads a unit as
// four 8x8 matrices of byte pairs (keys 0-7 / 8-15 x columns 0-15 / 16-31): lane (g = lane / 4, t = lane % 4)
// gets, per matrix, keys 2t and 2t+1 of columns 2g and 2g+1. Two byte permutes per column pair give V^T's rows
// 2g and 2g+1 their bytes 4t..4t+3 = keys 2t, 2t+1, 8+2t, 9+2t: the order pack_p leaves P's keys in. One
// stmatrix writes the unit's 32 rows of 16 key bytes. Its matrix rows alternate even and odd columns by lane
// half (lanes 0-15 the even row of a pair in matrices 0 and 2, lanes 16-31 the odd one), so each matrix's 8
// rows cover all 8 swizzle phases: no bank conflict (all-even rows would repeat 4 phases twice).
template <class C>
__device__ __forceinline__ void transpose_v(u32 v_tile, u32 vt_tile, int thread) {
    constexpr unsigned KEY_GROUPS = C::BC / 16, UNITS = KEY_GROUPS * (C::DV / 32), WARPS = C::TRANSPOSERS / 32;
    static_assert(C::BC % 16 == 0 && C::DV % 32 == 0 && C::TRANSPOSERS % 32 == 0, "units of 16 keys x 32 columns");
    const unsigned lane = (unsigned)thread % 32, warp = (unsigned)thread / 32, matrix = lane / 8, r = lane % 8;
    // this lane's row of each ldmatrix / stmatrix matrix, as an offset within unit 0 and its swizzle XOR (units
    // start on whole 16-key and 32-column steps: the XOR stays the lane's)
    const u32 load_lane = linear_offset<C::V_SWIZZLE>((matrix % 2) * 8 + r, (matrix / 2) * 16, C::BC);
    const u32 store_lane = linear_offset<C::VT_SWIZZLE>((matrix / 2) * 16 + 2 * r + ((matrix % 2) ^ (r / 4)), 0, C::DV);
    const u32 load_xor = swizzle_bits<C::V_SWIZZLE>(load_lane), store_xor = swizzle_bits<C::VT_SWIZZLE>(store_lane);
    const u32 even = lane < 16 ? 0x6420u : 0x7531u;   // byte picks of V^T row 2g (row 2g+1: even ^ 0x1111)
#pragma unroll 1
    for (unsigned unit = warp; unit < UNITS; unit += WARPS) {
        const unsigned keys = (unit % KEY_GROUPS) * 16, columns = (unit / KEY_GROUPS) * 32;
        u32 m[4];
        ldmatrix_x4_trans(m, v_tile + ((linear_offset<C::V_SWIZZLE>(keys, columns, C::BC) + load_lane) ^ load_xor));
        store_matrix_x4(vt_tile + ((linear_offset<C::VT_SWIZZLE>(columns, keys, C::DV) + store_lane) ^ store_xor),
                        __byte_perm(m[0], m[1], even), __byte_perm(m[0], m[1], even ^ 0x1111u),
                        __byte_perm(m[2], m[3], even), __byte_perm(m[2], m[3], even ^ 0x1111u));
    }
}

constexpr float LEAST_NORMAL_FLOAT = 1.17549435e-38f, FLOAT_MAX = 3.40282347e38f;

// Descales are finite and >= 0 (value = byte * descale); per block V's are > 0 too (O carries sum P V over the
// last tile's V descale, rescaled by each tile's ratio to the one before). NaN fails both comparisons. A bad one
// makes the rows that read it NaN, and the item's epilogue reports it (report_bad_descale).
__device__ __forceinline__ bool descale_bad(float x, bool zero_bad) {
    return !(zero_bad ? x > 0.f : x >= 0.f) || x > FLOAT_MAX;
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
        const float q = q_descale[((i64)w.batch * heads + w.head) * q_tiles + w.q0 / C::BR];
        return {descale_bad(q, false) ? QUIET_NAN : q, 1.f, k_descale + kv_pair * kv_tiles,
                v_descale + kv_pair * kv_tiles};
    } else {
        const i64 at = C::DESCALE == 1 ? kv_pair : 0;
        const float q = q_descale[at], k = k_descale[at];
        return {descale_bad(q, false) || descale_bad(k, false) ? QUIET_NAN : q * k, v_descale[at], nullptr, nullptr};
    }
}

// The descale of tile `tile`'s raw scores (q descale * k descale): true score = raw * it. At least the least
// normal float: a zero descale (an all-zero tensor's) must not turn a masked raw score's -inf into -inf * 0 = NaN.
// NaN for a bad q or k descale: the softmax keeps its max in raw units, which only a descale >= 0 allows.
template <class C>
__device__ __forceinline__ float score_descale(const Fp8Descales& d, int tile) {
    float qk = d.qk;   // NaN where fp8_descales found q's (or k's) descale bad
    if constexpr (C::DESCALE == 2) {
        const float k = d.k_tiles[tile];
        qk *= descale_bad(k, false) ? QUIET_NAN : k;
    }
    return qk >= LEAST_NORMAL_FLOAT ? qk : (qk >= 0.f ? LEAST_NORMAL_FLOAT : QUIET_NAN);
}

// attention.cuh's online softmax on raw e4m3 scores: the descale `qk` rides on the softmax scale (one FFMA per
// score, as without it), the running max m is kept in true scores (raw max * qk: descales are positive, so the
// raw max is the true one's), and the exponent is offset by P_LOG2 so P leaves as P_SCALE * exp(scale (s - m)),
// in e4m3's range for pack_p with no multiply. l sums the same P, so O / l is unchanged and the epilogue takes
// P_SCALE out of LSE alone (fp8_finish).
template <class C>
__device__ __forceinline__ void fp8_softmax_update(float (&s)[C::M_TILES][C::S_TILES][4],
                                                   float (&row_max)[C::M_TILES][2], float (&row_sum)[C::M_TILES][2],
                                                   float (&alpha)[C::M_TILES][2], float qk) {
    const float score_log2 = qk * C::SCALE_LOG2;   // raw score -> log2 units
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float raw_max = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt) raw_max = fmaxf(raw_max, fmaxf(s[0][nt][2 * h], s[0][nt][2 * h + 1]));
        const float m_new = fmaxf(row_max[0][h], quad_max(raw_max) * qk);
        // A row with every key masked so far keeps m = -inf; use 0 so exp never sees -inf - -inf.
        const float m_scaled = m_new == NEG_INF ? 0.f : m_new * C::SCALE_LOG2;
        alpha[0][h] = fast_exp2(row_max[0][h] * C::SCALE_LOG2 - m_scaled);
        row_max[0][h] = m_new;
        const float offset = m_scaled - C::P_LOG2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 2 * h; e < 2 * h + 2; ++e) {
                s[0][nt][e] = fast_exp2(fmaf(s[0][nt][e], score_log2, -offset));
                sum += s[0][nt][e];
            }
        row_sum[0][h] = row_sum[0][h] * alpha[0][h] + sum;
    }
}

// Per block, O holds sum P V / v descale of the tile last added: moving on to `tile`, O's rescale (alpha)
// also takes the ratio of the last tile's V descale to this one's.
template <class C>
__device__ __forceinline__ void carry_v_descale(float (&alpha)[C::M_TILES][2], const Fp8Descales& d, int tile, int first) {
    if constexpr (C::DESCALE == 2) {
        if (tile > first) {
            // a zero or NaN V descale has no finite positive ratio: NaN rows, reported by the epilogue
            const float ratio = d.v_tiles[tile - 1] / d.v_tiles[tile];
            const float kept = ratio > 0.f && ratio <= FLOAT_MAX ? ratio : QUIET_NAN;
            alpha[0][0] *= kept;
            alpha[0][1] *= kept;
        }
    }
}

// The first descale item `w` read that breaks descale_bad's rule, to the error word (index_bounds.cuh; the entry is
// its flat index in the tensor, the value its float's bits). Called by one lane after the item's rows came out NaN:
// NaN bytes in the inputs give NaN rows too, and find nothing to report.
template <class C, class Item>
__device__ __forceinline__ void report_bad_descale(const float* __restrict__ q_descale, const float* __restrict__ k_descale,
                                                const float* __restrict__ v_descale, const Item& w, int q_len,
                                                int kv_len, int heads, int kv_group, int tile_begin, int tile_end,
                                                int* words) {
    const i64 kv_pair = (i64)w.batch * (heads / kv_group) + w.kv_head;
    const auto report = [&](int code, int tensor, i64 at, float value) {
        report_bad_index(words, code, tensor, w.batch, (int)at, __float_as_int(value), 0);
    };
    if constexpr (C::DESCALE == 2) {
        const int q_tiles = (q_len + C::BR - 1) / C::BR, kv_tiles = (kv_len + C::BC - 1) / C::BC;
        const i64 q_at = ((i64)w.batch * heads + w.head) * q_tiles + w.q0 / C::BR;
        if (descale_bad(q_descale[q_at], false)) return report(INDEX_DESCALE_INVALID, INDEX_TENSOR_Q_DESCALE, q_at,
                                                               q_descale[q_at]);
        for (int tile = tile_begin; tile < tile_end; ++tile) {
            const i64 at = kv_pair * kv_tiles + tile;
            if (descale_bad(k_descale[at], false)) return report(INDEX_DESCALE_INVALID, INDEX_TENSOR_K_DESCALE, at,
                                                                 k_descale[at]);
            if (descale_bad(v_descale[at], true))
                return report(v_descale[at] == 0.f ? INDEX_DESCALE_ZERO_V_BLOCK : INDEX_DESCALE_INVALID,
                              INDEX_TENSOR_V_DESCALE, at, v_descale[at]);
        }
    } else {
        const i64 at = C::DESCALE == 1 ? kv_pair : 0;
        if (descale_bad(q_descale[at], false)) return report(INDEX_DESCALE_INVALID, INDEX_TENSOR_Q_DESCALE, at,
                                                             q_descale[at]);
        if (descale_bad(k_descale[at], false)) return report(INDEX_DESCALE_INVALID, INDEX_TENSOR_K_DESCALE, at,
                                                             k_descale[at]);
        if (descale_bad(v_descale[at], false)) return report(INDEX_DESCALE_INVALID, INDEX_TENSOR_V_DESCALE, at,
                                                             v_descale[at]);
    }
}

// Whether this thread's rows came out NaN (row sums, or O where a V descale's ratio broke its rescale).
template <class C>
__device__ __forceinline__ bool rows_nan(const float (&o)[C::M_TILES][C::O_TILES][4], const float (&row_sum)[C::M_TILES][2]) {
    return row_sum[0][0] != row_sum[0][0] || row_sum[0][1] != row_sum[0][1] || o[0][0][0] != o[0][0][0] ||
           o[0][0][2] != o[0][0][2];
}

// Before the epilogue divides O by l: O *= v descale (per block: the last tile's), and m loses P_SCALE's share of
// l (LSE = scale m + log l, l summed P_SCALE times the weights).
template <class C>
__device__ __forceinline__ void fp8_finish(float (&o)[C::M_TILES][C::O_TILES][4], float (&row_max)[C::M_TILES][2],
                                           const Fp8Descales& d, int last_tile) {
    const float read = C::DESCALE == 2 ? (last_tile >= 0 ? d.v_tiles[last_tile] : 1.f) : d.v;
    const float v = descale_bad(read, C::DESCALE == 2) ? QUIET_NAN : read;   // NaN rows, reported after
#pragma unroll
    for (int nd = 0; nd < C::O_TILES; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[0][nd][e] *= v;
    row_max[0][0] -= C::P_SCALE_UNITS;
    row_max[0][1] -= C::P_SCALE_UNITS;
}
