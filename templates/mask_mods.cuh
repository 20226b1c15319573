// Mask modifications of the hopper forward (mods/model.py): `mask = document` (packed sequences: query
// i, at key position i + kv_len - q_len, sees key j when both lie in one document of document_ids) and
// `mask = prefix(n)` (key j visible when j <= i + kv_len - q_len or j < n). Pasted only into kernels
// whose plan has one; C::DOCUMENTS and C::PREFIX (0: none) say which.
//
// Documents are contiguous runs of one id (the host checks it: mods/checks.check_document_ids); a
// negative id is padding, in no document. So a document is an interval of keys, [start, end), found
// by binary search from any position inside it, and a query row sees the keys of its document's
// interval: the per-element test is two compares, like a window's, with no key's id read.

// The padding id every negative id is read as.
constexpr int NO_DOCUMENT = -1;

// [start of the document of key position `first`, end of the document of `last`): every key a query
// row at positions first..last can see (positions of no document bound it by themselves). `first`
// may be negative (rows before the keys see none), last < seq_kv. Two binary searches, interleaved
// so their loads overlap: by contiguity, "ids[t] is first's document" is false then true over
// [0, first], and "ids[t] is not last's document" false then true over (last, seq_kv].
__device__ __forceinline__ int2 document_span(const int* __restrict__ ids, int first, int last, int seq_kv) {
    if (last < 0) return make_int2(0, 0);   // no row lies among the keys
    const int f = max(first, 0);
    const int doc_f = ids[f], doc_l = ids[last];
    int a_lo = doc_f < 0 ? f : 0, a_hi = f;                       // the first t with ids[t] == doc_f is in [a_lo, a_hi]
    int b_lo = last + 1, b_hi = doc_l < 0 ? last + 1 : seq_kv;   // the first t == seq_kv or with ids[t] != doc_l
    while (a_lo < a_hi || b_lo < b_hi) {
        const int a_mid = (a_lo + a_hi) >> 1, b_mid = (b_lo + b_hi) >> 1;
        const int id_a = ids[a_lo < a_hi ? a_mid : f], id_b = ids[b_lo < b_hi ? b_mid : last];
        if (a_lo < a_hi) {
            if (id_a == doc_f) a_hi = a_mid;
            else a_lo = a_mid + 1;
        }
        if (b_lo < b_hi) {
            if (id_b != doc_l) b_hi = b_mid;
            else b_lo = b_mid + 1;
        }
    }
    return make_int2(a_lo, b_lo);
}

// Narrow a work item's kv tiles [begin, end) to those that hold a key of `span`.
template <class C>
__device__ __forceinline__ void narrow_to_documents(int& tile_begin, int& tile_end, int2 span) {
    if (span.y <= span.x) {
        tile_end = tile_begin;
        return;
    }
    tile_begin = max(tile_begin, span.x / C::BC);
    tile_end = max(tile_begin, min(tile_end, (span.y + C::BC - 1) / C::BC));
}

// The producer hands the consumers its span through this shared slot, published by Q's full barrier.
__device__ __forceinline__ void store_document_span(u32 slot, int2 span) {
    asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" :: "r"(slot), "r"(span.x), "r"(span.y) : "memory");
}
__device__ __forceinline__ int2 load_document_span(u32 slot) {
    int2 span;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(span.x), "=r"(span.y) : "r"(slot) : "memory");
    return span;
}

// A thread's two accumulator rows' documents as key intervals [start, end) (empty for a row of no
// document), and the keys [full_lo, full_hi) every row of its warp sees: a kv tile inside them needs
// no per-element document test.
struct DocumentRows { int start[2], end[2]; int full_lo, full_hi; };

// The ids of the block's query rows 0..BR-1 (row r at key position q0 + r + diag; rows past
// rows_valid or before the keys read as NO_DOCUMENT), 32 rows per register: lane l holds row 32 j + l.
template <class C>
struct TileRowIds { int id[C::BR / 32]; };

template <class C>
__device__ __forceinline__ TileRowIds<C> load_tile_row_ids(const int* __restrict__ ids, int first, int rows_valid,
                                                             int lane) {
    TileRowIds<C> rows;
#pragma unroll
    for (int j = 0; j < C::BR / 32; ++j) {
        const int r = 32 * j + lane, p = first + r;
        rows.id[j] = r < rows_valid && p >= 0 ? max(ids[p], NO_DOCUMENT) : NO_DOCUMENT;
    }
    return rows;
}

// Every row's document interval from the tile's ids: a document starts at a row whose id differs
// from the row before (a boundary, from the warp's ballots); a row's document starts at the last
// boundary at or before it, or, with none, where the first row's does (span.x: the producer's search);
// it ends at the first boundary after it, or, with none, where the last row's does (span.y).
template <class C>
__device__ __forceinline__ DocumentRows document_rows(const TileRowIds<C>& rows, int first, int2 span, int warp_row,
                                                      int lane) {
    constexpr int CHUNKS = C::BR / 32;
    u32 boundary[CHUNKS];
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const int up = __shfl_up_sync(0xffffffffu, rows.id[j], 1);
        const int wrap = __shfl_sync(0xffffffffu, rows.id[j > 0 ? j - 1 : 0], 31);
        const int before = lane > 0 ? up : (j > 0 ? wrap : rows.id[0]);   // row 0 starts no document here
        boundary[j] = __ballot_sync(0xffffffffu, rows.id[j] != before);
    }
    const int chunk = warp_row / 32;   // this warp's 16 rows lie in one 32-row chunk
    int mine = NO_DOCUMENT;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j)
        if (j == chunk) mine = rows.id[j];
    DocumentRows out;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp_row + (lane >> 2) + 8 * h;
        const int id = __shfl_sync(0xffffffffu, mine, r % 32);
        int last = -1, next = C::BR;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) {
            const int bit = r - 32 * j;   // r's bit in chunk j (outside 0..31: r is in another chunk)
            const u32 upto = bit >= 31 ? 0xffffffffu : (bit < 0 ? 0u : (2u << bit) - 1u);
            const u32 at_or_before = boundary[j] & upto, after = boundary[j] & ~upto;
            if (at_or_before) last = 32 * j + 31 - __clz(at_or_before);
            if (after && next == C::BR) next = 32 * j + __ffs(after) - 1;
        }
        const bool none = id == NO_DOCUMENT;
        out.start[h] = none ? 0 : (last > 0 ? first + last : span.x);
        out.end[h] = none ? 0 : (next < C::BR ? first + next : span.y);
    }
    const int start = max(out.start[0], out.start[1]), end = min(out.end[0], out.end[1]);
    out.full_lo = __reduce_max_sync(0xffffffffu, start);
    out.full_hi = __reduce_min_sync(0xffffffffu, end);
    return out;
}

// Does any element of this warp's 16 rows (from row0) and the kv tile at col0 need the per-element
// test? The spec's mask's (kv_len, causal, window), a document that does not cover the tile for
// every row, or keys past the prefix and past the first row's diagonal.
template <class C>
__device__ __forceinline__ bool tile_needs_mask_mods(int row0, int col0, int kv_len, int diag, const DocumentRows& docs) {
    bool needs = tile_needs_mask<C>(row0, 16, col0, C::BC, kv_len, diag);
    if constexpr (C::DOCUMENTS) needs = needs || col0 < docs.full_lo || col0 + C::BC > docs.full_hi;
    if constexpr (C::PREFIX > 0) needs = needs || (col0 + C::BC > C::PREFIX && col0 + C::BC - 1 > row0 + diag);
    return needs;
}

// Is key `col` visible to query `row` (accumulator element e of its thread: its row's document) under the spec's
// mask, the row's document interval and the prefix?
template <class C>
__device__ __forceinline__ bool mask_mods_visible(int row, int col, int kv_len, int diag, const DocumentRows& docs,
                                                  int e) {
    bool visible = key_visible<C>(row, col, kv_len, diag);
    if constexpr (C::DOCUMENTS) visible = visible && col >= docs.start[e >> 1] && col < docs.end[e >> 1];
    if constexpr (C::PREFIX > 0) visible = visible && (col <= row + diag || col < C::PREFIX);
    return visible;
}

// The spec's mask, then each row's document interval and the prefix: invisible scores become -inf.
template <class C>
__device__ __forceinline__ void apply_mask_mods(float (&s)[C::M_TILES][C::S_TILES][4], int row0, int col0, int kv_len,
                                                int diag, int lane, const DocumentRows& docs) {
    static_assert(C::M_TILES == 1, "a thread's two rows are its only accumulator rows");
#pragma unroll
    for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + acc_row(lane, e), col = col0 + nt * 8 + acc_col(lane, e);
            if (!mask_mods_visible<C>(row, col, kv_len, diag, docs, e)) s[0][nt][e] = NEG_INF;
        }
}

// `mask = document(bounds)`: cu_seqlens-like offsets (count = documents + 1, non-decreasing, checked on
// the host) instead of ids. Key position p is in document d when bounds[d] <= p < bounds[d + 1] (an empty
// document owns no position); the keys [bounds[d], bounds[d + 1]) of p's document, or an empty interval.
__device__ __forceinline__ int2 bounds_interval(const int* __restrict__ bounds, int count, int p) {
    if (p < 0 || count < 2 || p < bounds[0] || p >= bounds[count - 1]) return make_int2(0, 0);
    int lo = 0, hi = count - 2;   // the last d with bounds[d] <= p lies in [lo, hi]
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (bounds[mid] <= p) lo = mid;
        else hi = mid - 1;
    }
    return make_int2(bounds[lo], bounds[lo + 1]);
}

// document_span's keys from bounds: the first row's document's start to the last row's document's end.
__device__ __forceinline__ int2 document_span_bounds(const int* __restrict__ bounds, int count, int first, int last) {
    if (last < 0) return make_int2(0, 0);
    const int f = max(first, 0);
    const int2 a = bounds_interval(bounds, count, f), b = bounds_interval(bounds, count, last);
    return make_int2(a.y > a.x ? a.x : f, b.y > b.x ? b.y : last + 1);
}

// document_rows from bounds: each of the thread's two rows searches the bounds itself (rows past
// rows_valid are in no document).
template <class C>
__device__ __forceinline__ DocumentRows document_rows_bounds(const int* __restrict__ bounds, int count, int first,
                                                             int rows_valid, int warp_row, int lane) {
    DocumentRows out;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp_row + (lane >> 2) + 8 * h;
        const int2 keys = r < rows_valid ? bounds_interval(bounds, count, first + r) : make_int2(0, 0);
        out.start[h] = keys.x;
        out.end[h] = keys.y;
    }
    const int start = max(out.start[0], out.start[1]), end = min(out.end[0], out.end[1]);
    out.full_lo = __reduce_max_sync(0xffffffffu, start);
    out.full_hi = __reduce_min_sync(0xffffffffu, end);
    return out;
}

// prefix(n): the kv tiles past both the last row's diagonal and the prefix hold no visible key.
template <class C>
__device__ __forceinline__ int prefix_tile_end(int tile_end, int q0, int diag) {
    const int keys = max(max(q0 + C::BR + diag, 0), C::PREFIX);
    return min(tile_end, (keys + C::BC - 1) / C::BC);
}
