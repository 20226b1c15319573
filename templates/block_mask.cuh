// Block-sparse attention, `mask = blocks(q = BLOCK_Q, kv = BLOCK_KV)` (mods/model.py): block_mask[b, h, i /
// BLOCK_Q, j / BLOCK_KV] != 0 marks the blocks of scores that are computed. The kernel's tiles divide the
// blocks (the layout checks it), so a q tile lies in one row of the table and a kv tile in one of its
// entries: a tile is computed whole or skipped whole, and no score needs a per-element test for the blocks
// (the spec's own mask and kv_len still take theirs).
//
// Per work item the producer's copying thread reads the q tile's row of the table once and lists the kv
// tiles it keeps (within the item's causal / window / kv_len range) in shared memory: a count, then one
// 2-byte tile index per entry. The list is published by Q's full barrier; the producer and the consumers
// then walk positions 0..count-1 of it, so the ring, the pipelined ops and an item with no tile (O = 0,
// LSE = -inf) are those of a contiguous range. Two lists alternate by the item's round: the producer writes
// the next item's while the consumers still read this one's (the one it overwrites was read by the
// consumers of two items back, which freed Q before the producer loaded the last item's).

// The q tile at q0's row of block_mask for (batch, head); a stride of 0 broadcasts a dimension of 1. 32-bit offsets
// (the host refuses tables of 2^31 entries or more): the producer warpgroup has few registers.
template <class C>
__device__ __forceinline__ const int* block_mask_row(const int* __restrict__ block_mask, i64 batch_stride,
                                                     i64 head_stride, int kv_blocks, int batch, int head, int q0) {
    return block_mask + (batch * (int)batch_stride + head * (int)head_stride + (q0 / C::BLOCK_Q) * kv_blocks);
}

// A list's count sits at its start; its tile indices follow from byte 16.
constexpr u32 LISTED_TILES_AT = 16;

__device__ __forceinline__ int listed_tile(u32 list, int position) {
    unsigned short tile;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(tile) : "r"(list + LISTED_TILES_AT + 2 * position) : "memory");
    return tile;
}

__device__ __forceinline__ int listed_count(u32 list) {
    int count;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(count) : "r"(list) : "memory");
    return count;
}

// List the kv tiles of [tile_begin, tile_end) whose block is nonzero in `row`; returns how many (at most
// the layout's LISTED_TILES: the host refuses longer sequences). One thread, with the producer's few registers:
// the row's 128-byte lines are prefetched first, so their latencies overlap, then read 4 entries a load (one
// 16-byte load where the row starts on 16 bytes: kv_blocks % 4 == 0; the 4 stay inside the row then).
template <class C>
__device__ __forceinline__ int list_visible_tiles(const int* __restrict__ row, int kv_blocks, int tile_begin,
                                                  int tile_end, u32 list) {
    constexpr int TILES_PER_BLOCK = C::BLOCK_KV / C::BC;
    int count = 0;
    if (tile_begin < tile_end) {
        const int first = tile_begin / TILES_PER_BLOCK, last = (tile_end - 1) / TILES_PER_BLOCK;
        for (int block = first & ~31; block <= last; block += 32)
            asm volatile("prefetch.global.L1 [%0];\n" :: "l"(row + block));
        const bool vectors = (kv_blocks & 3) == 0 && (reinterpret_cast<unsigned long long>(row) & 15) == 0;
        for (int block = vectors ? first & ~3 : first; block <= last; block += 4) {
            int entry[4];
            if (vectors) {
                const int4 four = __ldg(reinterpret_cast<const int4*>(row + block));
                entry[0] = four.x, entry[1] = four.y, entry[2] = four.z, entry[3] = four.w;
            } else {
#pragma unroll
                for (int u = 0; u < 4; ++u) entry[u] = block + u <= last ? __ldg(row + block + u) : 0;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (entry[u] == 0 || block + u < first || block + u > last) continue;
                const int lo = max((block + u) * TILES_PER_BLOCK, tile_begin);
                const int hi = min((block + u + 1) * TILES_PER_BLOCK, tile_end);
                for (int tile = lo; tile < hi; ++tile, ++count)
                    asm volatile("st.shared.u16 [%0], %1;\n"
                                 :: "r"(list + LISTED_TILES_AT + 2 * count), "h"((unsigned short)tile) : "memory");
            }
        }
    }
    asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(list), "r"(count) : "memory");
    return count;
}

// ---- the warp-specialized backward: one block per kv tile walks the (query head of its GQA group, q tile) steps
// whose block is nonzero: this kv tile's column of the table.
// Before the roles split, warp 0 reads the column once (a ballot per 32 steps) and marks the steps in shared bits
// (a count, then one bit per step from byte 16); the producer and the dQ writer each walk the marked steps in order,
// so their rings and barriers count the same steps, and the producer names each ring slot's step to the consumers
// (words 1..3 of the header, published by the slot's full barrier; the ring has at most 3 slots).
constexpr u32 MARKED_STEPS_AT = 16;

__device__ __forceinline__ void publish_step(u32 bits, int slot, int step) {
    asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(bits + 4 + 4 * slot), "r"(step) : "memory");
}
__device__ __forceinline__ int published_step(u32 bits, int slot) {
    int step;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(step) : "r"(bits + 4 + 4 * slot) : "memory");
    return step;
}

template <class C>
__device__ __forceinline__ void mark_visible_steps(const int* __restrict__ block_mask, i64 batch_stride,
                                                   i64 head_stride, int kv_blocks, int batch, int head0, int group,
                                                   int tile_begin, int tiles, int k0, u32 bits, int lane) {
    constexpr int LOADS = 4;
    const int steps = tiles * group, column = k0 / C::BLOCK_KV;
    int marked = 0;
    for (int base = 0; base < steps; base += 32 * LOADS) {
        int entry[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int step = base + 32 * u + lane;
            entry[u] = step < steps ? __ldg(block_mask_row<C>(block_mask, batch_stride, head_stride, kv_blocks, batch,
                                                              head0 + step / tiles,
                                                              (tile_begin + step % tiles) * C::BR) + column) : 0;
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const u32 word = __ballot_sync(0xffffffffu, entry[u] != 0);
            const int first = base + 32 * u;
            if (lane == 0 && first < steps)
                asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(bits + MARKED_STEPS_AT + first / 8), "r"(word)
                             : "memory");
            marked += __popc(word);
        }
    }
    if (lane == 0) asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(bits), "r"(marked) : "memory");
}

__device__ __forceinline__ int marked_step_count(u32 bits) {
    int count;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(count) : "r"(bits) : "memory");
    return count;
}

// The first marked step at or after `from` (one exists: the walk takes only the marked count).
__device__ __forceinline__ int next_marked_step(u32 bits, int from) {
    int word = from >> 5;
    u32 mask;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(mask) : "r"(bits + MARKED_STEPS_AT + 4 * word) : "memory");
    mask &= 0xffffffffu << (from & 31);
    while (mask == 0) {
        ++word;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(mask) : "r"(bits + MARKED_STEPS_AT + 4 * word) : "memory");
    }
    return word * 32 + __ffs(mask) - 1;
}

// Deterministic dQ: kv tile j adds to q tile i's rows after the kv tiles before it that see i, those of [first, j)
// whose block in i's row of the table is nonzero. Counted by the writer warp, 32 tiles a round.
template <class C>
__device__ __forceinline__ int visible_kv_tiles_before(const int* __restrict__ row, int first, int kv_tile, int lane) {
    constexpr int TILES_PER_BLOCK = C::BLOCK_KV / C::BC;
    int count = 0;
#pragma unroll 1   // the producer warpgroup's few registers (counting down holds one bound fewer)
    for (int tile = kv_tile - 1 - lane; tile >= first; tile -= 32) count += __ldg(row + tile / TILES_PER_BLOCK) != 0;
    return __reduce_add_sync(0xffffffffu, count);
}
