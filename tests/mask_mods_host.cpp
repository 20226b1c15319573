// templates/mask_mods.cuh on the host: each warp is 32 std::threads whose shuffles, ballots and reductions
// meet at a barrier, so the device code runs as written (tests/test_mask_mods_cpu.py compiles and drives it).
// Reads: seq_kv q_len, the ids (seq_kv of them) or bounds count + bounds; writes per query tile its span and
// kv tiles, then per row the keys it sees ("row r: k k k ...") and per (warp, kv tile) whether it was tested.
#include <algorithm>
#include <barrier>
#include <climits>
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __restrict__
typedef uint32_t u32;
typedef int64_t i64;
struct int2 { int x, y; };
inline int2 make_int2(int x, int y) { return {x, y}; }
using std::max;
using std::min;
static const float NEG_INF = -INFINITY;
enum MaskKind { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

thread_local int this_lane;
static std::barrier<>* warp_barrier;
static int slot_int[32];
static u32 slot_u32[32];

template <class T>
T exchange(T* slots, T value, int source) {
    slots[this_lane] = value;
    warp_barrier->arrive_and_wait();
    const T out = slots[source];
    warp_barrier->arrive_and_wait();
    return out;
}
inline int __shfl_sync(u32, int v, int src) { return exchange(slot_int, v, src & 31); }
inline int __shfl_up_sync(u32, int v, int delta) { return exchange(slot_int, v, this_lane >= delta ? this_lane - delta : this_lane); }
inline u32 __ballot_sync(u32, bool p) {
    slot_u32[this_lane] = p;
    warp_barrier->arrive_and_wait();
    u32 out = 0;
    for (int l = 0; l < 32; ++l) out |= slot_u32[l] << l;
    warp_barrier->arrive_and_wait();
    return out;
}
inline int reduce(int v, bool want_max) {
    slot_int[this_lane] = v;
    warp_barrier->arrive_and_wait();
    int out = slot_int[0];
    for (int l = 1; l < 32; ++l) out = want_max ? max(out, slot_int[l]) : min(out, slot_int[l]);
    warp_barrier->arrive_and_wait();
    return out;
}
inline int __reduce_max_sync(u32, int v) { return reduce(v, true); }
inline int __reduce_min_sync(u32, int v) { return reduce(v, false); }
inline int __clz(u32 x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(u32 x) { return __builtin_ffs(x); }

// attention.cuh's accumulator layout and mask tests (the same lines)
inline int acc_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
inline int acc_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
template <class C>
bool key_visible(int row, int col, int kv_len, int diag) {
    bool visible = col < kv_len;
    if constexpr (C::MASK == MASK_CAUSAL) visible = visible && col <= row + diag;
    return visible;
}
template <class C>
bool tile_needs_mask(int row0, int rows, int col0, int cols, int kv_len, int diag) {
    bool needs = col0 + cols > kv_len;
    if constexpr (C::MASK == MASK_CAUSAL) needs = needs || col0 + cols - 1 > row0 + diag;
    return needs;
}

struct C {
    static constexpr int BR = TILE_Q, BC = TILE_KV, M_TILES = 1, S_TILES = TILE_KV / 8;
    static constexpr MaskKind MASK = (MaskKind)MASK_KIND;
    static constexpr bool DOCUMENTS = DOCUMENT_KIND != 0;
    static constexpr int PREFIX = PREFIX_KEYS;
};

#include "mask_mods.cuh"

int main() {
    int seq_kv, q_len, count = 0;
    if (scanf("%d %d", &seq_kv, &q_len) != 2) return 2;
    std::vector<int> ids(seq_kv + 1), bounds;
    if (DOCUMENT_KIND == 1)
        for (int i = 0; i < seq_kv; ++i) scanf("%d", &ids[i]);
    if (DOCUMENT_KIND == 2) {
        scanf("%d", &count);
        bounds.resize(count);
        for (int i = 0; i < count; ++i) scanf("%d", &bounds[i]);
    }
    const int diag = seq_kv - q_len;
    std::barrier<> barrier(32);
    warp_barrier = &barrier;
    for (int q0 = 0; q0 < q_len; q0 += C::BR) {
        // the producer: the kv_range macro's causal / none range, the prefix's, then the documents'
        int kv_hi = seq_kv;
        if (C::MASK == MASK_CAUSAL) kv_hi = min(kv_hi, q0 + C::BR + diag);
        int tile_begin = 0, tile_end = kv_hi > 0 ? (kv_hi + C::BC - 1) / C::BC : 0;
        if (C::PREFIX > 0) tile_end = prefix_tile_end<C>(tile_end, q0, diag);
        const int rows_valid = min(C::BR, q_len - q0), first = q0 + diag, last = q0 + rows_valid - 1 + diag;
        int2 span = make_int2(0, seq_kv);
        if (DOCUMENT_KIND == 1) span = document_span(ids.data(), first, last, seq_kv);
        if (DOCUMENT_KIND == 2) span = document_span_bounds(bounds.data(), count, first, last);
        if (DOCUMENT_KIND) narrow_to_documents<C>(tile_begin, tile_end, span);
        printf("tile %d span %d %d tiles %d %d\n", q0, span.x, span.y, tile_begin, tile_end);
        std::vector<std::vector<int>> seen(C::BR);
        std::vector<int> tested((C::BR / 16) * std::max(tile_end - tile_begin, 0));
        for (int warp = 0; warp < C::BR / 16; ++warp) {
            std::vector<std::thread> lanes;
            std::vector<std::vector<int>> lane_seen(32 * C::BR);
            for (int lane = 0; lane < 32; ++lane)
                lanes.emplace_back([&, lane] {
                    this_lane = lane;
                    const int warp_row = warp * 16;
                    DocumentRows docs{};
                    if (DOCUMENT_KIND == 1) {
                        const TileRowIds<C> row_ids = load_tile_row_ids<C>(ids.data(), first, rows_valid, lane);
                        docs = document_rows<C>(row_ids, first, span, warp_row, lane);
                    }
                    if (DOCUMENT_KIND == 2)
                        docs = document_rows_bounds<C>(bounds.data(), count, first, rows_valid, warp_row, lane);
                    for (int tile = tile_begin; tile < tile_end; ++tile) {
                        float s[1][C::S_TILES][4] = {};
                        const bool needs = tile_needs_mask_mods<C>(q0 + warp_row, tile * C::BC, seq_kv, diag, docs);
                        if (needs) apply_mask_mods<C>(s, q0 + warp_row, tile * C::BC, seq_kv, diag, lane, docs);
                        if (lane == 0) tested[warp * (tile_end - tile_begin) + tile - tile_begin] = needs;
                        for (int nt = 0; nt < C::S_TILES; ++nt)
                            for (int e = 0; e < 4; ++e) {
                                const int row = warp_row + acc_row(lane, e), col = tile * C::BC + nt * 8 + acc_col(lane, e);
                                if (s[0][nt][e] == 0.f && row < rows_valid && col < seq_kv) lane_seen[lane * C::BR + row].push_back(col);
                            }
                    }
                });
            for (auto& t : lanes) t.join();
            for (int lane = 0; lane < 32; ++lane)
                for (int r = 0; r < C::BR; ++r)
                    for (int col : lane_seen[lane * C::BR + r]) seen[r].push_back(col);
        }
        for (int r = 0; r < rows_valid; ++r) {
            std::sort(seen[r].begin(), seen[r].end());
            printf("row %d:", q0 + r);
            for (int col : seen[r]) printf(" %d", col);
            printf("\n");
        }
        printf("tested");
        for (int t : tested) printf(" %d", t);
        printf("\n");
    }
    return 0;
}
