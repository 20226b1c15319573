// Mask modifications of the warp-specialized backward (templates/backward_ws.cu.j2): the hopper forward's
// `mask = document` and `mask = prefix(n)` (mask_mods.cuh, pasted before this) seen from the keys. A block
// owns the keys [k0, k0 + BC) and walks the q tiles whose queries can see one of them; S^T's rows are keys
// and its columns queries, so each key row's document interval bounds the query positions that see it.

// The rows of S^T as mask_mods.cuh's document_rows reads them: the block's BC keys.
template <class C>
struct KeyRows : C { static constexpr int BR = C::BC; };

// The first t in [lo, hi] where `pred` (false, then true; true at hi) holds, found by a whole warp: each round
// its lanes test 32 positions spread over the interval, which shrinks about 31-fold (a 16k-key search takes
// three dependent loads, where a binary search takes fourteen). Every lane returns the same t.
template <class Pred>
__device__ __forceinline__ int warp_first_true(int lo, int hi, int lane, Pred pred) {
    while (lo < hi) {
        const int step = (hi - lo + 30) / 31;   // lane 31 tests hi (clamped)
        const int f = __ffs(__ballot_sync(0xffffffffu, pred(min(lo + lane * step, hi)))) - 1;
        const int next_hi = min(lo + f * step, hi);
        lo = f > 0 ? lo + (f - 1) * step + 1 : next_hi;   // just past the last position tested false
        hi = next_hi;
    }
    return lo;
}

// The keys' documents, [start of k0's document, end of the last key's): the query positions that can see a
// key of the tile (positions of no document bound it by themselves). Empty past the sequence's keys. By a
// whole warp (warp_first_true), few registers: it runs before the roles' setmaxnreg.
__device__ __forceinline__ int2 key_tile_span(const int* __restrict__ ids, int k0, int bc, int seq_kv, int lane) {
    if (k0 >= seq_kv) return make_int2(0, 0);
    const int last = min(k0 + bc, seq_kv) - 1;
    const int doc_f = ids[k0], doc_l = ids[last];
    const int start = doc_f < 0 ? k0 : warp_first_true(0, k0, lane, [&](int t) { return ids[t] == doc_f; });
    const int end = doc_l < 0 ? last + 1 : warp_first_true(last + 1, seq_kv, lane, [&](int t) {
        return t >= seq_kv || ids[t] != doc_l;
    });
    return make_int2(start, end);
}

// bounds_interval by a whole warp: the document d of key position p is the first with bounds[d + 1] > p.
__device__ __forceinline__ int2 bounds_interval_warp(const int* __restrict__ bounds, int count, int p, int lane) {
    if (p < 0 || count < 2 || p < bounds[0] || p >= bounds[count - 1]) return make_int2(0, 0);
    const int d = warp_first_true(0, count - 2, lane, [&](int t) { return bounds[t + 1] > p; });
    return make_int2(bounds[d], bounds[d + 1]);
}

__device__ __forceinline__ int2 key_tile_span_bounds(const int* __restrict__ bounds, int count, int k0, int bc,
                                                     int seq_kv, int lane) {
    if (k0 >= seq_kv) return make_int2(0, 0);
    const int last = min(k0 + bc, seq_kv) - 1;
    const int2 a = bounds_interval_warp(bounds, count, k0, lane), b = bounds_interval_warp(bounds, count, last, lane);
    return make_int2(a.y > a.x ? a.x : k0, b.y > b.x ? b.y : last + 1);
}

// A pointer computed again where a role reads through it: the empty asm keeps the compiler from holding it, or
// what was read through it, in registers across the role split (the producer warpgroup's setmaxnreg leaves few).
template <class T>
__device__ __forceinline__ const T* again(const T* p, i64 offset) {
    asm volatile("" : "+l"(p));
    return p + offset;
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

// The first kv tile whose keys' documents reach the q tile whose first query sits at key position `first`
// (< seq_kv): the tile of the start of that query's document (of the query itself where it is in none; 0 for a
// query before the keys). The kv tiles' document spans only grow with the tile, so the tiles that see a q tile
// are contiguous from the later of this one and the spec's mask's first (first_kv_tile). By a whole warp.
template <class C>
__device__ __forceinline__ int document_first_kv_tile(const int* __restrict__ ids, int first, int lane) {
    if (first < 0) return 0;
    const int doc = ids[first];
    return (doc < 0 ? first : warp_first_true(0, first, lane, [&](int t) { return ids[t] == doc; })) / C::BC;
}
template <class C>
__device__ __forceinline__ int document_first_kv_tile_bounds(const int* __restrict__ bounds, int count, int first,
                                                             int lane) {
    if (first < 0) return 0;
    const int2 keys = bounds_interval_warp(bounds, count, first, lane);
    return (keys.y > keys.x ? keys.x : first) / C::BC;
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
