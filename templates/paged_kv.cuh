// Paged KV cache (kv_cache = paged(page = N)): the device code of every kernel that reads K and V
// through a block table. fa2 (chunked prefill) loads a block's whole kv tile with all its threads;
// decode loads each warp's key slice of the tile with that warp's lanes. Key t of a sequence lies
// in the page that entry t >> PAGE_SHIFT of the sequence's block-table row names, at slot
// t & PAGE_MASK (page sizes are powers of two); `page_stride` elements separate pages, `row_stride`
// key slots. Keys at or past seq_kv are zero-filled and their entries never read (unused entries
// may hold anything). Every function takes the kernel's config C: PAGE_SIZE, PAGE_SHIFT,
// PAGE_MASK, the walk's flags (fa2: PAGE_PER_TILE; decode: PAGE_PER_SLICE, PAGES_TILE_SLICE) and
// fa2's ring (PAGE_RING, TILE_PAGES, PAGES_OFFSET, BC, THREADS).

// Entry `index` of a sequence's block-table row: the page that holds its keys index * PAGE_SIZE..
// Every global read of the table goes through here (fa2's ring also copies entries by cp.async).
__device__ __forceinline__ int table_entry(const int* table, int index) {
    return table[index];
}

// The page that holds key `key`.
template <class C>
__device__ __forceinline__ int page_of_key(const int* table, int key) {
    return table_entry(table, key >> C::PAGE_SHIFT);
}

// fa2: a page index its loads may follow. An entry outside [0, num_pages) reads page 0 instead (a
// page the cache holds: keys_in_table walks no key of a cache of no pages); the kernel's end-of-block
// check (paged_sequence_bad) then turns the sequence's rows NaN and reports the entry. A good entry
// is itself.
__device__ __forceinline__ int page_in_cache(int page, int num_pages) {
    return (unsigned)page < (unsigned)num_pages ? page : 0;
}

// fa2: the keys its loads may walk of a sequence whose kv_lens entry is `value`: value clamped to
// [0, table_pages * PAGE_SIZE] (the keys the block-table row names; none where the cache holds no
// page), so a bad kv_len reads no entry past the row; the end-of-block check makes its rows NaN. A
// good kv_len is itself.
template <class C>
__device__ __forceinline__ int keys_in_table(int value, int table_pages, int num_pages) {
    const i64 capacity = num_pages > 0 ? min((i64)table_pages * C::PAGE_SIZE, (i64)0x7fffffff) : 0;
    return (int)min(max((i64)value, (i64)0), capacity);
}

__device__ __forceinline__ int load_shared_s32(u32 address) {
    int value;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(value) : "r"(address) : "memory");
    return value;
}

// fa2: where a kv tile's page indices come from. With PAGE_RING the tile's entries (pages first..
// of this sequence) were copied into its slot of a shared-memory ring a pipeline step before its
// loads (copy_tile_pages), so the loads never wait on a global read; without, they read the block
// table row itself. Every index it hands out is in the cache (page_in_cache).
template <class C>
struct TilePages {
    // Ring entries a thread holds in registers: a tile's few pages (read back to back, one wait for
    // all, instead of a dependent shared read in front of each page's copies); 1 = none held.
    static constexpr int HELD = C::PAGE_RING > 0 && !C::PAGE_PER_TILE && C::TILE_PAGES <= 4 ? C::TILE_PAGES : 1;
    const int* table;   // this sequence's block-table row
    u32 slot;           // PAGE_RING: the tile's ring slot (shared-memory address)
    int first;          // the page of the tile's first key (PAGE_RING with PAGE_PER_TILE: the tile's page itself)
    int num_pages;      // the pages the cache holds
    int held[HELD];
    __device__ __forceinline__ int operator()(int key) const {   // the page of key `key` of this tile
        if constexpr (C::PAGE_RING > 0 && C::PAGE_PER_TILE) return first;
        else if constexpr (C::PAGE_RING > 0)
            return page_in_cache(load_shared_s32(slot + ((key >> C::PAGE_SHIFT) - first) * 4), num_pages);
        else return page_in_cache(page_of_key<C>(table, key), num_pages);
    }
    __device__ __forceinline__ int entry(int index) const {      // the tile's page `index` (a constant after unrolling)
        if constexpr (HELD > 1) return held[index];
        else if constexpr (C::PAGE_RING > 0) return page_in_cache(load_shared_s32(slot + index * 4), num_pages);
        else return page_in_cache(table_entry(table, first + index), num_pages);
    }
};

// Tile j's entries live in slot j % PAGE_RING of the ring at `ring` (the Shared view's pages()).
template <class C>
__device__ __forceinline__ u32 page_slot(u32 ring, int tile) {
    return ring + (C::PAGE_RING > 0 ? tile % C::PAGE_RING : 0) * C::TILE_PAGES * 4;
}

template <class C>
__device__ __forceinline__ TilePages<C> tile_pages(const int* table, u32 ring, int tile, int seq_kv, int num_pages) {
    TilePages<C> pages{table, page_slot<C>(ring, tile), (tile * C::BC) >> C::PAGE_SHIFT, num_pages};
    if constexpr (C::PAGE_RING > 0 && C::PAGE_PER_TILE)   // one lookup serves K and V
        pages.first = tile * C::BC < seq_kv ? page_in_cache(load_shared_s32(pages.slot), num_pages) : 0;
    if constexpr (TilePages<C>::HELD > 1) {
#pragma unroll
        for (int j = 0; j < TilePages<C>::HELD; ++j)
            pages.held[j] = page_in_cache(load_shared_s32(pages.slot + j * 4), num_pages);
    }
    return pages;
}

// fa2: tile `tile`'s entries into its ring slot, by cp.async into the caller's open group (ASYNC),
// or by plain loads and stores (the caller syncs).
template <class C, bool ASYNC>
__device__ __forceinline__ void copy_tile_pages(const int* table, u32 ring, int tile, int seq_kv) {
    const int first = (tile * C::BC) >> C::PAGE_SHIFT;
    const u32 slot = page_slot<C>(ring, tile);
    if (threadIdx.x < C::TILE_PAGES)   // threads past the entries skip the loop (and ptxas keeps fewer registers live)
        for (int e = threadIdx.x; e < C::TILE_PAGES; e += C::THREADS) {
            if ((first + e) << C::PAGE_SHIFT >= seq_kv) break;
            if constexpr (ASYNC)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                             :: "r"(slot + e * 4), "l"(table + first + e) : "memory");
            else
                store_shared_u32(slot + e * 4, table_entry(table, first + e));
        }
}

// fa2: keys key0.. of one kv tile (ROWS rows, CHUNKS 16-byte chunks of each) of K or V, this kv
// head's rows at `head_rows`, pages from `pages`, loaded by the block's THREADS threads. A tile
// inside one page (PAGE_PER_TILE) takes one lookup and contiguous rows. Else each thread keeps one
// chunk column and steps down ROW_STEP rows a pass, as load_tile_async does; when tiles start on a
// page (BC a multiple of PAGE_SIZE) and ROW_STEP <= PAGE_SIZE its rows of pass i lie in page
// i * ROW_STEP / PAGE_SIZE of the tile, so it looks up one entry per page, not per row; tiles that
// straddle pages look up every row. Rows that don't split evenly over the threads (head dims padded
// on chip) look up an entry per copy, one copy at a time.
template <class C, int ROWS, int CHUNKS, int ROW_BYTES, bool SWIZZLE, int THREADS>
__device__ __forceinline__ void load_paged_tile(u32 tile, const u16* head_rows, const TilePages<C>& pages,
                                                i64 page_stride, i64 row_stride, int key0, int seq_kv) {
    constexpr int TOTAL = ROWS * CHUNKS;
    if constexpr (C::PAGE_PER_TILE) {
        const int page = key0 < seq_kv ? pages(key0) : 0;
        load_tile_async<ROWS, CHUNKS, ROW_BYTES, SWIZZLE, THREADS>(
            tile, head_rows + page * page_stride + (key0 & C::PAGE_MASK) * row_stride, row_stride, seq_kv - key0);
    } else if constexpr (THREADS % CHUNKS == 0 && TOTAL % THREADS == 0) {
        constexpr int ROW_STEP = THREADS / CHUNKS;
        constexpr bool PAGE_PER_PASSES = C::BC % C::PAGE_SIZE == 0 && ROW_STEP <= C::PAGE_SIZE;
        const int row0 = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
        const u16* from = head_rows + chunk * 8;
        const u32 to = tile + chunk_offset<ROW_BYTES, SWIZZLE>(row0, chunk);
        const u16* page_rows = from;
#pragma unroll
        for (int i = 0; i < TOTAL / THREADS; ++i) {
            const int row = row0 + i * ROW_STEP, key = key0 + row;
            const bool valid = key < seq_kv;   // once false, false for the rest of the tile
            if (!PAGE_PER_PASSES)
                page_rows = from + (valid ? pages(key) : 0) * page_stride;
            else if ((i * ROW_STEP) % C::PAGE_SIZE == 0)
                page_rows = from + (valid ? pages.entry(i * ROW_STEP / C::PAGE_SIZE) : 0) * page_stride;
            const u32 dst = (ROW_STEP % 8 == 0 || !SWIZZLE) ? to + i * ROW_STEP * ROW_BYTES
                                                             : tile + chunk_offset<ROW_BYTES, SWIZZLE>(row, chunk);
            cp_async_16(dst, valid ? page_rows + (key & C::PAGE_MASK) * row_stride : head_rows, valid);
        }
    } else {   // not unrolled: an address per copy, live at once, would spill
#pragma unroll 1
        for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
            const int index = i * THREADS + threadIdx.x;
            if (TOTAL % THREADS == 0 || index < TOTAL) {
                const int row = index / CHUNKS, chunk = index % CHUNKS, key = key0 + row;
                const bool valid = key < seq_kv;
                cp_async_16(tile + chunk_offset<ROW_BYTES, SWIZZLE>(row, chunk),
                            valid ? head_rows + pages(key) * page_stride + (key & C::PAGE_MASK) * row_stride
                                        + chunk * 8 : head_rows, valid);
            }
        }
    }
}

// decode: one warp's key slice (ROWS keys from key0) of K or V, this kv head's rows at
// `head_rows`, pages from the sequence's block-table row `table`, loaded by the warp's lanes. With
// the slice inside one page (PAGE_PER_SLICE) one block-table read gives its base and the rows are
// contiguous; with whole pages tiling it (PAGES_TILE_SLICE) one read per page; else each row reads
// its own entry, once per tile.
template <class C, int ROWS, int CHUNKS, int ROW_BYTES, bool SWIZZLE>
__device__ __forceinline__ void load_paged_slice(u32 tile, const u16* head_rows, const int* table, i64 page_stride,
                                                 i64 row_stride, int key0, int seq_kv, int lane) {
    if constexpr (C::PAGE_PER_SLICE) {
        const int page = key0 < seq_kv ? page_of_key<C>(table, key0) : 0;
        load_tile_async<ROWS, CHUNKS, ROW_BYTES, SWIZZLE, 32>(
            tile, head_rows + page * page_stride + (key0 & C::PAGE_MASK) * row_stride, row_stride, seq_kv - key0, lane);
    } else if constexpr (C::PAGES_TILE_SLICE) {
        // key0 is a multiple of the slice, so page p's first key is slot 0; PAGE_SIZE is a
        // multiple of 8, so the swizzle of its rows is the rows' own.
        int page[ROWS / C::PAGE_SIZE];
#pragma unroll
        for (int p = 0; p < ROWS / C::PAGE_SIZE; ++p) {   // the entries first: their loads overlap
            const int key = key0 + p * C::PAGE_SIZE;
            page[p] = key < seq_kv ? page_of_key<C>(table, key) : 0;
        }
#pragma unroll
        for (int p = 0; p < ROWS / C::PAGE_SIZE; ++p)
            load_tile_async<C::PAGE_SIZE, CHUNKS, ROW_BYTES, SWIZZLE, 32>(
                tile + p * C::PAGE_SIZE * ROW_BYTES, head_rows + page[p] * page_stride, row_stride,
                seq_kv - (key0 + p * C::PAGE_SIZE), lane);
    } else {
        constexpr int TOTAL = ROWS * CHUNKS;
        static_assert(TOTAL % 32 == 0, "a slice is a multiple of 16 rows of an even number of 16-byte chunks");
#pragma unroll
        for (int i = 0; i < TOTAL / 32; ++i) {
            const int index = i * 32 + lane;
            const int row = index / CHUNKS, chunk = index % CHUNKS, key = key0 + row;
            const bool valid = key < seq_kv;
            const u16* src = valid ? head_rows + page_of_key<C>(table, key) * page_stride
                                         + (key & C::PAGE_MASK) * row_stride + chunk * 8 : head_rows;
            cp_async_16(tile + chunk_offset<ROW_BYTES, SWIZZLE>(row, chunk), src, valid);
        }
    }
}

// Paged K and V: is kv_lens[batch] outside [0, table_pages * PAGE_SIZE] (the keys the sequence's
// block-table row can name), or an entry of its first ceil(kv_len / PAGE_SIZE) pages outside
// [0, num_pages)? The block's THREADS threads read the entries between them; on a bad one thread 0
// finds the first again (the rare path) to report it. Called by every thread of the block: decode
// before its kv loop (a bad sequence then loads no kv tile), fa2 after it (its loads walked only
// keys_in_table's keys through page_in_cache's pages: the check before the loop would hold the
// values it reads through the loop of a kernel at the register limit).
template <class C>
__device__ __forceinline__ bool paged_sequence_bad(const int* kv_lens, const int* table, int batch, int table_pages,
                                                   int num_pages, int* words) {
    const int value = kv_lens[batch];
    const i64 capacity = (i64)table_pages * C::PAGE_SIZE;
    const bool len_bad = value < 0 || value > capacity;
    const int entries = len_bad ? 0 : (int)(((i64)value + C::PAGE_SIZE - 1) >> C::PAGE_SHIFT);
    bool entry_bad = false;
    for (int e = threadIdx.x; e < entries; e += C::THREADS) {
        const int page = table_entry(table, e);
        entry_bad |= page < 0 || page >= num_pages;
    }
    if (!__syncthreads_or(entry_bad) && !len_bad) return false;
    if (threadIdx.x == 0) {
        if (len_bad) {
            report_bad_index(words, value < 0 ? INDEX_LEN_NEGATIVE : INDEX_LEN_OVER_TABLE, INDEX_TENSOR_KV_LENS,
                             batch, 0, value, (int)min(capacity, (i64)0x7fffffff));
        } else {
            for (int e = 0; e < entries; ++e) {
                const int page = table_entry(table, e);
                if (page < 0 || page >= num_pages) {
                    report_bad_index(words, INDEX_PAGE_OUT_OF_RANGE, INDEX_TENSOR_BLOCK_TABLE, batch, e, page,
                                     num_pages);
                    break;
                }
            }
        }
    }
    return true;
}
