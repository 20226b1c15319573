// score_mod and mask_mod in the warp-specialized backward, pasted after expressions.cuh (ExprItem, expr_point) and
// block_mask.cuh (the marked steps) into kernels whose spec has an expression.
//
// A consumer's S^T slice (C: SliceC) holds 16 keys (rows, from key_lo = k0 + warp_row) by C::BR query columns (from
// q_lo): element (nt, e) is key key_lo + (lane >> 2) + 8 (e >> 1) and query q_lo + nt * 8 + (lane & 3) * 2 + (e & 1),
// the transpose of the forward's S. S^T is in raw units like the forward's S: score_mod sees SCALE s and its result
// goes back as f / SCALE (expressions.cuh). dS^T = P^T (dP^T - D) is the gradient of the modified raw score; that of
// the raw score is it times f'(SCALE s): the SCALEs cancel, so the derivative multiplies dS^T as it is.
//
// mask_mod's steps: before the roles split, warp 0 evaluates mask_mod_box over each (query head, q tile) step of
// its kv tile (the step's query rows inside q_len by the tile's keys inside kv_len) and marks the steps it can show a
// key of in block_mask.cuh's shared bits; every role then walks the marked steps, so the ring and the barriers count
// the same steps, and an empty step is never loaded, computed or added to dQ.

// The element's query and key indices for the expressions, clamped onto the launch's last ones when CLAMP.
template <class C, bool CLAMP>
__device__ __forceinline__ int2 expr_point_t(const ExprItem& x, int key_lo, int q_lo, int nt, int e, int lane) {
    return expr_point<CLAMP>(x, q_lo + nt * 8 + (lane & 3) * 2 + (e & 1), key_lo + (lane >> 2) + 8 * (e >> 1));
}

// Does the slice reach past the launch's last query or key (where an aux read must clamp its indices)?
template <class C>
__device__ __forceinline__ bool slice_needs_clamp(const ExprItem& x, int key_lo, int q_lo) {
    return C::EXPR_CLAMP && (q_lo + C::BR - 1 > x.q_last || key_lo + 15 > x.kv_last);
}

template <class C, bool CLAMP>
__device__ __forceinline__ void expression_scores_t_at(float (&s)[1][C::BR / 8][4], const ExprItem& x, int key_lo,
                                                       int q_lo, int lane) {
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int2 at = expr_point_t<C, CLAMP>(x, key_lo, q_lo, nt, e, lane);
            s[0][nt][e] = score_mod_of(s[0][nt][e] * C::SCALE, x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux)
                          * C::INV_SCALE;
        }
}

// S^T = score_mod(SCALE S^T) / SCALE over the slice.
template <class C>
__device__ __forceinline__ void expression_scores_t(float (&s)[1][C::BR / 8][4], const ExprItem& x, int key_lo, int q_lo,
                                                    int lane) {
    if (slice_needs_clamp<C>(x, key_lo, q_lo)) expression_scores_t_at<C, true>(s, x, key_lo, q_lo, lane);
    else expression_scores_t_at<C, false>(s, x, key_lo, q_lo, lane);
}

// mask_mod's per-element test on the slice, only where its box over the slice (queries inside q_len, keys inside
// kv_len) can be false: a slice the mask keeps whole pays none. The keys it hides become -inf (P^T = 0).
template <class C>
__device__ __forceinline__ void mask_mod_scores_t(float (&s)[1][C::BR / 8][4], const ExprItem& x, int key_lo, int q_lo,
                                                  int lane) {
    const int q_first = min(q_lo, x.q_last), q_hi = min(q_lo + C::BR - 1, x.q_last);
    const int kv_hi = max(min(key_lo + 16, x.kv_len) - 1, key_lo);
    if (mask_mod_box(x.b, x.h, q_first, q_hi, key_lo, kv_hi, x.q_len, x.kv_len) == TILE_FULL) return;
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int2 at = expr_point_t<C, C::EXPR_CLAMP>(x, key_lo, q_lo, nt, e, lane);
            if (!mask_mod_of(x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux)) s[0][nt][e] = NEG_INF;
        }
}

// Is the step (query head h, the q tile at q0) of the kv tile at k0 able to show a key? The same answer for every
// role and block that asks: the query rows inside q_len, the keys inside seq_kv.
template <class C>
__device__ __forceinline__ bool mask_mod_step_visible(int b, int h, int q0, int k0, int q_len, int seq_kv) {
    return mask_mod_box(b, h, q0, min(q0 + C::BR, q_len) - 1, k0, min(k0 + C::BC, seq_kv) - 1, q_len, seq_kv)
           != TILE_EMPTY;
}

// Warp 0 marks the steps of this kv tile that mask_mod can show a key of: 32 steps a ballot, into block_mask.cuh's
// bits (a count, then one bit per step from MARKED_STEPS_AT).
template <class C>
__device__ __forceinline__ void mark_mask_mod_steps(int b, int head0, int group, int tile_begin, int tiles, int k0,
                                                    int q_len, int seq_kv, u32 bits, int lane) {
    const int steps = tiles * group;
    int marked = 0;
    for (int first = 0; first < steps; first += 32) {
        const int step = first + lane;
        const bool visible = step < steps && mask_mod_step_visible<C>(b, head0 + step / tiles,
                                                                      (tile_begin + step % tiles) * C::BR, k0, q_len,
                                                                      seq_kv);
        const u32 word = __ballot_sync(0xffffffffu, visible);
        if (lane == 0)
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(bits + MARKED_STEPS_AT + first / 8), "r"(word) : "memory");
        marked += __popc(word);
    }
    if (lane == 0) asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(bits), "r"(marked) : "memory");
}

// Deterministic dQ: kv tile j adds to q tile i's rows after the kv tiles of [first, j) that mark the step (h, i),
// by the same test they mark it with. Counted by a writer warp, 32 tiles a round.
template <class C>
__device__ __forceinline__ int mask_mod_tiles_before(int b, int h, int q0, int q_len, int seq_kv, int first, int kv_tile,
                                                     int lane) {
    int count = 0;
#pragma unroll 1   // the producer warpgroup's few registers
    for (int tile = kv_tile - 1 - lane; tile >= first; tile -= 32)
        count += mask_mod_step_visible<C>(b, h, q0, tile * C::BC, q_len, seq_kv);
    return __reduce_add_sync(0xffffffffu, count);
}
