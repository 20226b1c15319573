// score_mod and mask_mod in the hopper forward: the kernel's device functions score_mod_of, mask_mod_of and
// mask_mod_box (lower/expressions.py spells them from the spec's trees; macros.j2 pastes them above this
// header) applied to the consumer's S accumulators and to the work item's kv tiles.
//
// S is in raw units (the softmax computes exp(SCALE * (s - m))): score_mod sees the scaled score SCALE * s
// and its result goes back as f / SCALE, like softcap's (score_mods.cuh). mask_mod turns the scores of keys
// it hides to -inf, on top of the spec's mask, kv_len, documents and prefix (mask_mods.cuh).
//
// Tiles: mask_mod_box gives mods/intervals.py's answer over a box of indices (can the mask be false, can it
// be true). A kv tile whose box over the work item's rows cannot be true is skipped by the producer and the
// consumers alike (both walk MaskModTiles::next); one whose box over a warp's 16 rows cannot be false needs
// no per-element test.

// A work item's values of the expressions' variables (besides q_idx, kv_idx) and its aux tensors. q_last
// and kv_last are the launch's last query and key: elements past them (a partial tile's, masked or never
// stored) read at them when C::EXPR_CLAMP, so an aux read stays inside the tensor the host checked.
struct ExprItem { int b, h, q_len, kv_len, q_last, kv_last; ExprAux aux; };

// The kv tiles of a work item that can hold a visible key: [begin, end) narrowed to the first and last
// such tile, `next` steps over the empty ones between. The producer and the consumers build it from the
// same item, so they visit the same tiles in the same order (the ring's positions count only these).
struct MaskModTiles {
    int b, h, q_lo, q_hi, q_len, kv_len, tile_kv;

    __device__ __forceinline__ bool empty(int tile) const {
        const int kv_lo = tile * tile_kv, kv_hi = min(kv_lo + tile_kv, kv_len) - 1;
        return mask_mod_box(b, h, q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len) == TILE_EMPTY;
    }
    __device__ __forceinline__ int next(int tile, int end) const {
        do ++tile;
        while (tile < end && empty(tile));
        return tile;
    }
};

// The item's tiles, and its [tile_begin, tile_end) narrowed to the visible ones (empty when none is).
// `rows`: the item's query rows q0 .. q0 + rows - 1 that lie in the sequence (>= 1).
template <class C>
__device__ __forceinline__ MaskModTiles narrow_to_mask_mod(int& tile_begin, int& tile_end, int b, int h, int q0,
                                                           int rows, int q_len, int kv_len) {
    const MaskModTiles tiles{b, h, q0, q0 + rows - 1, q_len, kv_len, C::BC};
    while (tile_begin < tile_end && tiles.empty(tile_begin)) ++tile_begin;
    while (tile_end > tile_begin && tiles.empty(tile_end - 1)) --tile_end;
    return tiles;
}

// Does mask_mod hide any key of this warp's 16 rows (from row0) in the kv tile at col0? (false: a full tile)
template <class C>
__device__ __forceinline__ bool tile_needs_mask_mod(const ExprItem& x, int row0, int col0) {
    const int q_lo = min(row0, x.q_last), q_hi = min(row0 + 15, x.q_last);
    const int kv_hi = max(min(col0 + C::BC, x.kv_len) - 1, col0);
    return mask_mod_box(x.b, x.h, q_lo, q_hi, col0, kv_hi, x.q_len, x.kv_len) != TILE_FULL;
}

// The indices an element's expression reads: past the launch's last query or key, clamped onto it when `clamp`.
template <bool CLAMP>
__device__ __forceinline__ int2 expr_point(const ExprItem& x, int row, int col) {
    if constexpr (CLAMP) return make_int2(min(row, x.q_last), min(col, x.kv_last));
    return make_int2(row, col);
}

// Does the warp's 16 rows (from row0) by the tile's keys (from col0) reach past the launch's last query or key?
template <class C>
__device__ __forceinline__ bool tile_needs_clamp(const ExprItem& x, int row0, int col0) {
    return C::EXPR_CLAMP && (row0 + 15 > x.q_last || col0 + C::BC - 1 > x.kv_last);
}

template <class C, bool CLAMP>
__device__ __forceinline__ void expression_scores_at(float (&s)[C::M_TILES][C::S_TILES][4], const ExprItem& x, int row0,
                                                     int col0, int lane) {
#pragma unroll
    for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int2 at = expr_point<CLAMP>(x, row0 + acc_row(lane, e), col0 + nt * 8 + acc_col(lane, e));
            s[0][nt][e] = score_mod_of(s[0][nt][e] * C::SCALE, x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux)
                          * C::INV_SCALE;
        }
}

// s = score_mod(SCALE s) / SCALE for each element of the warp's 16 rows (row0..) and the tile's keys (col0..).
// Only a tile at the sequences' ends clamps its indices: inside them each element's indices are the lane's plus
// constants, which the compiler folds into the reads' offsets.
template <class C>
__device__ __forceinline__ void expression_scores(float (&s)[C::M_TILES][C::S_TILES][4], const ExprItem& x, int row0,
                                                  int col0, int lane) {
    static_assert(C::M_TILES == 1, "a thread's two rows are its only accumulator rows");
    if (tile_needs_clamp<C>(x, row0, col0)) expression_scores_at<C, true>(s, x, row0, col0, lane);
    else expression_scores_at<C, false>(s, x, row0, col0, lane);
}
