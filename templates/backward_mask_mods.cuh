// Mask modifications of the warp-specialized backward (templates/backward_ws.cu.j2): the hopper forward's
// `mask = document` and `mask = prefix(n)` (mask_mods.cuh, pasted before this) seen from the keys. A block
// owns the keys [k0, k0 + BC) and walks the q tiles whose queries can see one of them; S^T's rows are keys
// and its columns queries, so each key row's document interval bounds the query positions that see it.

// The rows of S^T as mask_mods.cuh's document_rows reads them: the block's BC keys.
template <class C>
struct KeyRows : C { static constexpr int BR = C::BC; };

// The keys' documents, [start of k0's document, end of the last key's): the query positions that can see a
// key of the tile (positions of no document bound it by themselves). Empty past the sequence's keys.
__device__ __forceinline__ int2 key_tile_span(const int* __restrict__ ids, int k0, int bc, int seq_kv) {
    return k0 < seq_kv ? document_span(ids, k0, min(k0 + bc, seq_kv) - 1, seq_kv) : make_int2(0, 0);
}
__device__ __forceinline__ int2 key_tile_span_bounds(const int* __restrict__ bounds, int count, int k0, int bc,
                                                     int seq_kv) {
    return k0 < seq_kv ? document_span_bounds(bounds, count, k0, min(k0 + bc, seq_kv) - 1) : make_int2(0, 0);
}

// The sequence's row of document_ids or document_bounds, computed again where a role reads it: the empty asm
// keeps the compiler from holding it, or what was read through it, in registers across the role split (the
// producer warpgroup's setmaxnreg leaves it few).
__device__ __forceinline__ const int* documents_again(const int* documents, int batch, i64 stride) {
    asm volatile("" : "+l"(documents));
    return documents + batch * stride;
}

// Narrow the queries [q_lo, q_hi) that see the kv tile at k0 by the mask modifications: prefix(n) is causal
// past the prefix (a tile of prefix keys is seen by every query), documents keep the queries at positions in
// the keys' documents (`span`, key positions; query i sits at i + diag).
template <class C>
__device__ __forceinline__ void narrow_queries(int& q_lo, int& q_hi, int k0, int diag, int2 span) {
    if constexpr (C::PREFIX > 0)
        if (k0 >= C::PREFIX) q_lo = max(q_lo, k0 - diag);
    if constexpr (C::DOCUMENTS) {
        q_lo = max(q_lo, span.x - diag);
        q_hi = min(q_hi, span.y - diag);
    }
}

// The start of the document of key position p (p itself where it is in no document).
__device__ __forceinline__ int document_start(const int* __restrict__ ids, int p) {
    const int doc = ids[p];
    if (doc < 0) return p;
    int lo = 0, hi = p;   // the first t with ids[t] == doc lies in [lo, hi]: by contiguity false, then true
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ids[mid] == doc) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}
__device__ __forceinline__ int document_start_bounds(const int* __restrict__ bounds, int count, int p) {
    const int2 keys = bounds_interval(bounds, count, p);
    return keys.y > keys.x ? keys.x : p;
}

// The first kv tile whose keys' documents reach the q tile whose first query sits at key position `first`
// (< seq_kv): the tile of that query's document's start (0 for a query before the keys). The kv tiles'
// document spans only grow with the tile, so the tiles that see a q tile are contiguous from the later of
// this one and the spec's mask's first (first_kv_tile).
template <class C>
__device__ __forceinline__ int document_first_kv_tile(const int* __restrict__ ids, int first) {
    return first < 0 ? 0 : document_start(ids, first) / C::BC;
}
template <class C>
__device__ __forceinline__ int document_first_kv_tile_bounds(const int* __restrict__ bounds, int count, int first) {
    return first < 0 ? 0 : document_start_bounds(bounds, count, first) / C::BC;
}

// The documents of a quad's two key rows (acc rows lane / 4 and lane / 4 + 8 of the warp's 16 keys): the query
// positions [start, end) that see each (empty for a key of no document), one number per lane of the quad (lane
// 4 i + j holds row i's start, row i's end, row i + 8's start, row i + 8's end for j = 0..3). Held for the
// whole q loop in one register beside dK and dV: the mask's tests read them back by shuffles and reductions.
struct KeyDocuments { int share; };

__device__ __forceinline__ KeyDocuments key_documents_of(const DocumentRows& rows, int lane) {
    const int j = lane & 3;
    return {j == 0 ? rows.start[0] : j == 1 ? rows.end[0] : j == 2 ? rows.start[1] : rows.end[1]};
}

// The elementwise mask of a consumer's S^T slice (C: SliceC; 16 keys from k0 + warp_row by C::BR query columns
// from q0): the keys past seq_kv, the spec's mask, each key's document interval (`keys`) and the prefix. A
// (warp, q tile) pair every element of which is visible is left alone; whether it was tested is returned.
template <class C>
__device__ __forceinline__ bool mask_scores_mods(float (&acc_s)[1][C::BR / 8][4], int k0, int q0, int warp_row,
                                                 int lane, bool kv_end, int seq_kv, int diag,
                                                 const KeyDocuments& keys) {
    const int key_lo = k0 + warp_row, pos_lo = q0 + diag;   // the warp's first key, the slice's first query's position
    bool edge = kv_end;
    if constexpr (C::DOCUMENTS) {   // the positions every key of the warp is seen by: the latest start, earliest end
        int share = keys.share;
        asm volatile("" : "+r"(share));   // reduced here, per q tile, rather than held across the q loop
        const bool starts = (lane & 1) == 0;
        const int full_lo = __reduce_max_sync(0xffffffffu, starts ? share : -0x7fffffff - 1);
        const int full_hi = __reduce_min_sync(0xffffffffu, starts ? 0x7fffffff : share);
        edge = edge || pos_lo < full_lo || pos_lo + C::BR > full_hi;
    }
    if constexpr (C::MASK == MASK_CAUSAL) edge = edge || key_lo + 15 > pos_lo;
    if constexpr (C::MASK == MASK_WINDOW)
        edge = edge || key_lo + 15 > pos_lo + C::WINDOW_RIGHT || key_lo < pos_lo + C::BR - 1 - C::WINDOW_LEFT;
    if constexpr (C::PREFIX > 0) edge = edge || (key_lo + 16 > C::PREFIX && key_lo + 15 > pos_lo);
    if (!edge) return false;
    int start[2] = {0, 0}, end[2] = {0, 0};
    if constexpr (C::DOCUMENTS) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            start[h] = __shfl_sync(0xffffffffu, keys.share, (lane & ~3) | (2 * h));
            end[h] = __shfl_sync(0xffffffffu, keys.share, (lane & ~3) | (2 * h + 1));
        }
    }
#pragma unroll
    for (int nt = 0; nt < C::BR / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key_lo + (lane >> 2) + 8 * (e >> 1), pos = pos_lo + nt * 8 + (lane & 3) * 2 + (e & 1);
            bool visible = key < seq_kv;
            if constexpr (C::MASK == MASK_CAUSAL) visible = visible && key <= pos;
            if constexpr (C::MASK == MASK_WINDOW)
                visible = visible && key >= pos - C::WINDOW_LEFT && key <= pos + C::WINDOW_RIGHT;
            if constexpr (C::DOCUMENTS) visible = visible && pos >= start[e >> 1] && pos < end[e >> 1];
            if constexpr (C::PREFIX > 0) visible = visible && (key <= pos || key < C::PREFIX);
            if (!visible) acc_s[0][nt][e] = NEG_INF;
        }
    return true;
}
