// The algorithmic pieces of tile attention as device functions over a config struct C (the
// constexprs a template renders from its KernelPlan). One piece each: QK^T, mask, online
// softmax update, PV, epilogue. Every family that keeps a warp's rows in mma accumulators
// uses these.
enum MaskKind { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

// Accumulator element e of m16n8 tile: row  g + 8*(e/2), column 2*t + e%2 (g = lane/4, t = lane%4).
__device__ __forceinline__ int acc_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
__device__ __forceinline__ int acc_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

// S = Q K^T for this warp's rows: Q fragments from registers or shared memory, K from shared.
template <class C>
__device__ __forceinline__ void mma_qk(float (&s)[C::M_TILES][C::S_TILES][4], const u32 (&q_regs)[C::Q_REG_TILES][C::D / 16][4],
                                       u32 q_tile, u32 k_tile, int warp_row, int lane) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
    // Per 16-wide slice of the head dim: this warp's Q fragments, then one K fragment pair at a
    // time (fewer live registers than loading all of K's slice first).
#pragma unroll
    for (int ks = 0; ks < C::D / 16; ++ks) {
        u32 q_frag[C::M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < C::M_TILES; ++mt) {
            if constexpr (C::Q_IN_REGISTERS) {
#pragma unroll
                for (int i = 0; i < 4; ++i) q_frag[mt][i] = q_regs[mt][ks][i];
            } else {
                ldmatrix_x4(q_frag[mt], q_tile + chunk_offset<C::QK_ROW_BYTES, C::QK_SWIZZLE>(
                                                     warp_row + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
            }
        }
#pragma unroll
        for (int np = 0; np < C::S_TILES / 2; ++np) {
            u32 k_frag[4];   // keys 16*np.. x dims 16*ks..: b-fragments of two n-tiles
            ldmatrix_x4(k_frag, k_tile + chunk_offset_split<C::QK_ROW_BYTES, C::QK_SWIZZLE>(
                                             np * 16 + ((lane >> 4) << 3), lane & 7, ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
            for (int mt = 0; mt < C::M_TILES; ++mt) {
                mma_16816(s[mt][2 * np], q_frag[mt], k_frag[0], k_frag[1]);
                mma_16816(s[mt][2 * np + 1], q_frag[mt], k_frag[2], k_frag[3]);
            }
        }
    }
}

// Q fragments of this warp's rows, kept in registers across the whole kv loop.
template <class C>
__device__ __forceinline__ void load_q_fragments(u32 (&q_regs)[C::Q_REG_TILES][C::D / 16][4], u32 q_tile, int warp_row, int lane) {
#pragma unroll
    for (int mt = 0; mt < C::Q_REG_TILES; ++mt)
#pragma unroll
        for (int ks = 0; ks < C::D / 16; ++ks)
            ldmatrix_x4(q_regs[mt][ks], q_tile + chunk_offset<C::QK_ROW_BYTES, C::QK_SWIZZLE>(
                                                    warp_row + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
}

// Is key `col` visible to query `row`? diag = kv_len - q_len aligns masks to the bottom-right.
template <class C>
__device__ __forceinline__ bool key_visible(int row, int col, int kv_len, int diag) {
    bool visible = col < kv_len;
    if constexpr (C::MASK == MASK_CAUSAL) visible = visible && col <= row + diag;
    if constexpr (C::MASK == MASK_WINDOW)
        visible = visible && col >= row + diag - C::WINDOW_LEFT && col <= row + diag + C::WINDOW_RIGHT;
    return visible;
}

// Does any element of the kv tile starting at `col0` need masking for rows row0..row0+rows-1?
template <class C>
__device__ __forceinline__ bool tile_needs_mask(int row0, int rows, int col0, int cols, int kv_len, int diag) {
    bool needs = col0 + cols > kv_len;
    if constexpr (C::MASK == MASK_CAUSAL) needs = needs || col0 + cols - 1 > row0 + diag;
    if constexpr (C::MASK == MASK_WINDOW)
        needs = needs || col0 + cols - 1 > row0 + diag + C::WINDOW_RIGHT || col0 < row0 + rows - 1 + diag - C::WINDOW_LEFT;
    return needs;
}

// Scores of invisible keys become -inf, so they get weight exactly 0.
template <class C>
__device__ __forceinline__ void apply_mask(float (&s)[C::M_TILES][C::S_TILES][4], int row0, int col0, int kv_len, int diag, int lane) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!key_visible<C>(row0 + mt * 16 + acc_row(lane, e), col0 + nt * 8 + acc_col(lane, e), kv_len, diag))
                    s[mt][nt][e] = NEG_INF;
}

// Online softmax, in two steps so the O rescale can wait for an in-flight P V (Hopper's
// intra-warpgroup overlap): softmax_update raises the running max, rescales the running sum by
// alpha = exp(m_old - m_new) and turns the scores into unnormalised probabilities
// P = exp(scale * (S - m_new)) in place; rescale_o multiplies O by alpha. Row sums stay
// per-thread partial sums; the quad reduces them once, in the epilogue. Once the maxima settle
// most tiles leave every row's max unchanged (alpha == 1 exactly), so the warp skips the O
// rescale (M_TILES * DV / 2 multiplies per thread) when no row of it needs one.
template <class C>
__device__ __forceinline__ void softmax_update(float (&s)[C::M_TILES][C::S_TILES][4], float (&row_max)[C::M_TILES][2],
                                               float (&row_sum)[C::M_TILES][2], float (&alpha)[C::M_TILES][2]) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m_new = row_max[mt][h];
#pragma unroll
            for (int nt = 0; nt < C::S_TILES; ++nt) m_new = fmaxf(m_new, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
            m_new = quad_max(m_new);
            // A row with every key masked so far keeps m = -inf; use 0 so exp never sees -inf - -inf.
            const float m_scaled = m_new == NEG_INF ? 0.f : m_new * C::SCALE_LOG2;
            alpha[mt][h] = fast_exp2(row_max[mt][h] * C::SCALE_LOG2 - m_scaled);
            row_max[mt][h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], C::SCALE_LOG2, -m_scaled));
                    sum += s[mt][nt][e];
                }
            row_sum[mt][h] = row_sum[mt][h] * alpha[mt][h] + sum;
        }
}

template <class C>
__device__ __forceinline__ void rescale_o(float (&o)[C::M_TILES][C::O_TILES][4], const float (&alpha)[C::M_TILES][2]) {
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt) rescale = rescale || alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
            for (int nd = 0; nd < C::O_TILES; ++nd)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mt][nd][e] *= alpha[mt][e >> 1];
    }
}

template <class C>
__device__ __forceinline__ void online_softmax(float (&s)[C::M_TILES][C::S_TILES][4], float (&row_max)[C::M_TILES][2],
                                               float (&row_sum)[C::M_TILES][2], float (&o)[C::M_TILES][C::O_TILES][4]) {
    float alpha[C::M_TILES][2];
    softmax_update<C>(s, row_max, row_sum, alpha);
    rescale_o<C>(o, alpha);
}

// O += P V. P goes from the S accumulators straight into A fragments (no shared memory):
// the m16n8 accumulator layout of two adjacent n-tiles is the m16k16 A-fragment layout.
template <class C>
__device__ __forceinline__ void mma_pv(float (&o)[C::M_TILES][C::O_TILES][4], const float (&p)[C::M_TILES][C::S_TILES][4],
                                       u32 v_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < C::S_TILES / 2; ++kk) {   // 16 keys: two 8-column tiles of P
        u32 p_frag[C::M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < C::M_TILES; ++mt) {
            p_frag[mt][0] = pack2(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            p_frag[mt][1] = pack2(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            p_frag[mt][2] = pack2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            p_frag[mt][3] = pack2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int ndp = 0; ndp < C::O_TILES / 2; ++ndp) {
            u32 v_frag[4];   // keys 16*kk.. x dims 16*ndp..: b-fragments of two n-tiles
            ldmatrix_x4_trans(v_frag, v_tile + chunk_offset_split<C::V_ROW_BYTES, C::V_SWIZZLE>(
                                                   kk * 16 + (lane & 8), lane & 7, ndp * 2 + (lane >> 4)));
#pragma unroll
            for (int mt = 0; mt < C::M_TILES; ++mt) {
                mma_16816(o[mt][2 * ndp], p_frag[mt], v_frag[0], v_frag[1]);
                mma_16816(o[mt][2 * ndp + 1], p_frag[mt], v_frag[2], v_frag[3]);
            }
        }
    }
}

// Divide O by the row sums once, stage it in shared memory (this warp's rows only) so global
// stores are 16-byte and coalesced, and store LSE = scale * m + log(l); empty rows give O = 0,
// LSE = -inf. CHUNKS: the 16-byte chunks of an O row in HBM (fewer than DV / 8 where DV is padded).
template <class C, int CHUNKS = C::DV / 8>
__device__ __forceinline__ void store_output(float (&o)[C::M_TILES][C::O_TILES][4], const float (&row_max)[C::M_TILES][2],
                                             const float (&row_sum)[C::M_TILES][2], u32 o_tile, int warp_row, int lane,
                                             u16* o_rows, i64 o_row_stride, float* lse_rows, int rows_valid) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float l = quad_sum(row_sum[mt][h]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row = warp_row + mt * 16 + (lane >> 2) + 8 * h;
#pragma unroll
            for (int nd = 0; nd < C::O_TILES; ++nd)
                store_shared_u32(o_tile + chunk_offset<C::V_ROW_BYTES, C::V_SWIZZLE>(row, nd) + (lane & 3) * 4,
                                 pack2(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv));
            if ((lane & 3) == 0 && row < rows_valid)
                lse_rows[row] = l > 0.f ? row_max[mt][h] * C::SCALE + logf(l) : NEG_INF;
        }
    __syncwarp();
    constexpr int TOTAL = C::ROWS_PER_WARP * CHUNKS;
#pragma unroll
    for (int i = 0; i < (TOTAL + 31) / 32; ++i) {
        const int index = i * 32 + lane;
        const int row = warp_row + index / CHUNKS, chunk = index % CHUNKS;
        if ((TOTAL % 32 == 0 || index < TOTAL) && row < rows_valid)
            *reinterpret_cast<uint4*>(o_rows + row * o_row_stride + chunk * 8) =
                load_shared_v4(o_tile + chunk_offset<C::V_ROW_BYTES, C::V_SWIZZLE>(row, chunk));
    }
}
