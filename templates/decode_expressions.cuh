// score_mod and mask_mod in decode: the kernel's device functions score_mod_of, mask_mod_of and mask_mod_box
// (lower/expressions.py spells them; macros.j2 pastes them above this header) applied to a warp's S accumulators
// of decode's packed (head, query) rows and to the split's kv tiles.
//
// The indices: b is the block's batch entry, h block row r's head (kv_head * kv_group + r / q_len), q_idx its
// query's position in the sequence (r % q_len + kv_len - q_len, as causal and ALiBi place it), kv_idx the key's
// position (a paged cache's logical one), q_len the queries per sequence, kv_len the sequence's keys.
//
// S is in raw units (the softmax computes exp(SCALE * (s - m))): score_mod sees SCALE * s and its result goes back
// as f / SCALE, like softcap's. mask_mod turns the scores of keys it hides to -inf, on top of the spec's mask.
//
// Tiles: mask_mod_box's answer over the block's rows (every head and position they hold) and a kv tile's keys. A
// tile that cannot be true is not loaded (the split's range is narrowed to its first and last visible tile and
// the walk steps over the empty ones between), a warp's key slice that cannot be false is not tested per element.

// The block's rows as the expressions see them: this thread's rows' heads and positions, and the box of all the
// block's rows. Padding rows (past rows_valid) take the last valid row's indices and positions before 0 (a
// sequence shorter than its queries) read at 0 when C::EXPR_CLAMP, so an aux read stays in the tensor the host
// checked; neither is ever stored.
struct DecodeExprRows {
    int head[W::M_TILES][2], q_idx[W::M_TILES][2];
    int b, q_len, kv_len, kv_last;   // kv_last: the sequence's last key, where past-the-end keys read
    int h_lo, h_hi, q_lo, q_hi;      // the block's heads (one when mask_mod reads no h) and query positions
    ExprAux aux;

    // mask_mod's class over the block's rows and keys [kv_lo, kv_hi]: empty only if empty for every head, full
    // only if full for every head.
    __device__ __forceinline__ int keys_class(int kv_lo, int kv_hi) const {
        bool can_true = false, can_false = false;
        for (int h = h_lo; h <= h_hi; ++h) {
            const int c = mask_mod_box(b, h, q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len);
            can_true |= c != TILE_EMPTY;
            can_false |= c != TILE_FULL;
        }
        return !can_true ? TILE_EMPTY : (!can_false ? TILE_FULL : TILE_PARTIAL);
    }
    __device__ __forceinline__ bool empty(int tile) const {
        return keys_class(tile * C::BC, min(tile * C::BC + C::BC, kv_len) - 1) == TILE_EMPTY;
    }
    // the next tile after `tile` that can hold a visible key (end when none does)
    __device__ __forceinline__ int next(int tile, int end) const {
        do ++tile;
        while (tile < end && empty(tile));
        return tile;
    }
    // does mask_mod hide any key of the warp's slice from key0 for some row? (false: no per-element test)
    __device__ __forceinline__ bool slice_needs_test(int key0) const {
        return keys_class(key0, max(min(key0 + C::KEYS_PER_WARP, kv_len) - 1, key0)) != TILE_FULL;
    }
    __device__ __forceinline__ bool slice_needs_clamp(int key0) const {
        return C::EXPR_CLAMP && key0 + C::KEYS_PER_WARP - 1 > kv_last;
    }
};

__device__ __forceinline__ int expr_position(int query, int diag) {
    const int position = query + diag;
    return C::EXPR_CLAMP ? max(position, 0) : position;
}

// The rows of block rows row0 .. row0 + rows_valid - 1 (rows_valid >= 1) of kv head kv_head in batch entry b.
__device__ __forceinline__ DecodeExprRows decode_expr_rows(int b, int kv_head, int kv_group, int row0, int rows_valid,
                                                           int q_len, int seq_kv, int lane, const ExprAux& aux) {
    const int diag = seq_kv - q_len, last = row0 + rows_valid - 1;
    const int head0 = kv_head * kv_group;
    DecodeExprRows x;
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int packed = min(row0 + mt * 16 + acc_row(lane, 2 * h), last);
            x.head[mt][h] = head0 + packed / q_len;
            x.q_idx[mt][h] = expr_position(packed % q_len, diag);
        }
    const bool one_head = row0 / q_len == last / q_len;
    x.b = b;
    x.q_len = q_len;
    x.kv_len = seq_kv;
    x.kv_last = max(seq_kv - 1, 0);
    x.h_lo = head0 + row0 / q_len;
    x.h_hi = C::MASK_MOD_READS_HEAD ? head0 + last / q_len : x.h_lo;
    x.q_lo = expr_position(one_head ? row0 % q_len : 0, diag);
    x.q_hi = expr_position(one_head ? last % q_len : q_len - 1, diag);
    x.aux = aux;
    return x;
}

// [tile_begin, tile_end) narrowed to its first and last tile that can hold a visible key (empty when none does).
__device__ __forceinline__ void narrow_to_mask_mod(int& tile_begin, int& tile_end, const DecodeExprRows& x) {
    while (tile_begin < tile_end && x.empty(tile_begin)) ++tile_begin;
    while (tile_end > tile_begin && x.empty(tile_end - 1)) --tile_end;
}

template <bool CLAMP>
__device__ __forceinline__ void expression_scores_at(float (&s)[W::M_TILES][W::S_TILES][4], const DecodeExprRows& x,
                                                     int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < W::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + nt * 8 + acc_col(lane, e);
                s[mt][nt][e] = score_mod_of(s[mt][nt][e] * C::SCALE, x.b, x.head[mt][e >> 1], x.q_idx[mt][e >> 1],
                                            CLAMP ? min(key, x.kv_last) : key, x.q_len, x.kv_len, x.aux) * C::INV_SCALE;
            }
}

// s = score_mod(SCALE s) / SCALE on the warp's key slice from key0. Only a slice reaching past the sequence's end
// clamps its keys: inside it each element's key is the lane's plus a constant.
__device__ __forceinline__ void expression_scores(float (&s)[W::M_TILES][W::S_TILES][4], const DecodeExprRows& x,
                                                  int key0, int lane) {
    if (x.slice_needs_clamp(key0)) expression_scores_at<true>(s, x, key0, lane);
    else expression_scores_at<false>(s, x, key0, lane);
}

// mask_mod's per-element test on the warp's key slice from key0: the keys it hides become -inf.
__device__ __forceinline__ void apply_mask_mod(float (&s)[W::M_TILES][W::S_TILES][4], const DecodeExprRows& x,
                                               int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < W::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + nt * 8 + acc_col(lane, e);
                if (!mask_mod_of(x.b, x.head[mt][e >> 1], x.q_idx[mt][e >> 1], C::EXPR_CLAMP ? min(key, x.kv_last) : key,
                                 x.q_len, x.kv_len, x.aux))
                    s[mt][nt][e] = NEG_INF;
            }
}
