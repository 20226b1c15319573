// Device helpers shared by every family: integer types, PTX wrappers for cp.async, ldmatrix,
// mma.sync and conversions, and the shared-memory tile layout. No standard headers, so NVRTC
// and nvcc both compile the output with no include paths.
// The kernel defines TILE_DTYPE, the PTX spelling of its 16-bit input type, before this header.
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

// 32-bit shared-memory address of a generic pointer (what cp.async and ldmatrix take).
// blockIdx.x through a volatile read: the compiler re-reads it where it is used instead of
// keeping values derived from it live across the kv loop (a register at the 255 limit).
__device__ __forceinline__ int block_index_x() {
    int block;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
    return block;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// What a swizzled row's chunk index is XORed with: rows of 128 bytes or more, the row's low 3 bits;
// rows of 64 or 32 bytes (e4m3 tiles of head dim 64 / 32) share a 128-byte line with 1 or 3 others,
// so the XOR takes the row bits above those (2 or 1 bits: the row's chunk count). Either way the 8
// consecutive rows one ldmatrix matrix reads hit 8 different 16-byte bank groups (layout.py swizzles
// only rows of 32, 64 or a multiple of 128 bytes).
template <int ROW_BYTES>
__device__ __forceinline__ int swizzle_xor(int row) {
    constexpr int SHIFT = ROW_BYTES >= 128 ? 0 : ROW_BYTES == 64 ? 1 : 2;
    constexpr int MASK = ROW_BYTES >= 128 ? 7 : ROW_BYTES / 16 - 1;
    return (row >> SHIFT) & MASK;
}

// Byte offset of 16-byte chunk `chunk` in row `row` of a tile. Swizzled tiles XOR the chunk with
// swizzle_xor(row) so that the 8 rows one ldmatrix reads hit 8 different bank groups; padded
// tiles (head dims that are not multiples of 64) add 16 bytes per row for the same effect.
template <int ROW_BYTES, bool SWIZZLE>
__device__ __forceinline__ u32 chunk_offset(int row, int chunk) {
    return row * ROW_BYTES + ((SWIZZLE ? (chunk ^ swizzle_xor<ROW_BYTES>(row)) : chunk) << 4);
}

// The same offset for a row split as row8 + r7, row8 a multiple of 8 and r7 = row & 7: written so
// that the XOR depends only on the thread (r7) and the compile-time chunk, which lets the compiler
// fold it instead of keeping one precomputed address per fragment in registers.
template <int ROW_BYTES, bool SWIZZLE>
__device__ __forceinline__ u32 chunk_offset_split(int row8, int r7, int chunk) {
    return (row8 + r7) * ROW_BYTES + ((SWIZZLE ? (chunk ^ swizzle_xor<ROW_BYTES>(r7)) : chunk) << 4);
}

// 16-byte global->shared copy that zero-fills when `valid` is false (rows past the sequence end).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING)); }

// Cooperative copy of a ROWS x (CHUNKS*8) tile of 16-bit values; rows >= rows_valid read as zero.
// When the threads cover whole rows per pass, each thread keeps one chunk column and steps down
// by ROW_STEP rows: one base address and one stride instead of an address per copy (registers),
// and with ROW_STEP a multiple of 8 the swizzle of every pass is the first pass's.
// `thread` is the caller's index among the THREADS that share the copy (a warp's lane when one
// warp loads its own rows).
template <int ROWS, int CHUNKS, int ROW_BYTES, bool SWIZZLE, int THREADS>
__device__ __forceinline__ void load_tile_async(u32 tile, const u16* src, i64 row_stride, int rows_valid,
                                                int thread = (int)threadIdx.x) {
    constexpr int TOTAL = ROWS * CHUNKS;
    if constexpr (THREADS % CHUNKS == 0 && TOTAL % THREADS == 0) {
        constexpr int ROW_STEP = THREADS / CHUNKS;
        const int row0 = thread / CHUNKS, chunk = thread % CHUNKS;
        const u16* from = src + row0 * row_stride + chunk * 8;
        const u32 to = tile + chunk_offset<ROW_BYTES, SWIZZLE>(row0, chunk);
#pragma unroll
        for (int i = 0; i < TOTAL / THREADS; ++i) {
            const int row = row0 + i * ROW_STEP;
            const bool valid = row < rows_valid;
            const u32 dst = (ROW_STEP % 8 == 0 || !SWIZZLE) ? to + i * ROW_STEP * ROW_BYTES
                                                             : tile + chunk_offset<ROW_BYTES, SWIZZLE>(row, chunk);
            cp_async_16(dst, valid ? from + i * ROW_STEP * row_stride : src, valid);
        }
    } else {
#pragma unroll
        for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
            const int index = i * THREADS + thread;
            if (TOTAL % THREADS == 0 || index < TOTAL) {
                const int row = index / CHUNKS, chunk = index % CHUNKS;
                const bool valid = row < rows_valid;
                cp_async_16(tile + chunk_offset<ROW_BYTES, SWIZZLE>(row, chunk),
                            src + (valid ? row * row_stride + chunk * 8 : 0), valid);
            }
        }
    }
}

// Head dims padded to the mma width (layout.mma_width): zero chunks REAL_CHUNKS.. of every row of
// a ROWS-row tile once. The loads copy only a row's real chunks, so the zeros stay; the MMAs read them.
template <int ROWS, int CHUNKS, int REAL_CHUNKS, int ROW_BYTES, bool SWIZZLE, int THREADS>
__device__ __forceinline__ void zero_pad_chunks(u32 tile) {
    constexpr int PAD = CHUNKS - REAL_CHUNKS;
    for (int i = threadIdx.x; i < ROWS * PAD; i += THREADS)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n"
                     :: "r"(tile + chunk_offset<ROW_BYTES, SWIZZLE>(i / PAD, REAL_CHUNKS + i % PAD)), "r"(0u));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// D += A * B for one m16n8k16 tensor-core tile, TILE_DTYPE inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TILE_DTYPE "." TILE_DTYPE ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values -> one register of two TILE_DTYPE values, `low` in the low half.
__device__ __forceinline__ u32 pack2(float low, float high) {
    u32 r;
    asm("cvt.rn." TILE_DTYPE "x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void store_shared_u32(u32 address, u32 value) {
    asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(address), "r"(value));
}
__device__ __forceinline__ uint4 load_shared_v4(u32 address) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
    return v;
}

// Loads of other blocks' partials bypass L1 (its lines are not coherent across SMs).
// Device-scope atomic add with acquire-release semantics: publishes the writes ordered before it
// (by a barrier, for the whole block) to whoever acquires the counter after it.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int value) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(value) : "memory");
    return old;
}
__device__ __forceinline__ float load_cg(const float* p) {
    float x;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(x) : "l"(p));
    return x;
}
__device__ __forceinline__ float4 load_cg4(const float* p) {
    float4 x;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
    return x;
}

// Max over the 4 threads of a quad: they hold the same two rows of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
