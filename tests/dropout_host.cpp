// templates/philox.cuh and dropout.cuh on the host: a warp is 32 std::threads whose shuffles meet at a
// barrier, so the device code runs as written (tests/test_dropout_cpu.py compiles and drives it).
// Reads: mode ("words": then count, key0 key1, count counters of 4 words; prints each call's 4 words), or
// "tile" / "transposed" then seed lo, seed hi, offset, batch, heads, head, row0, col0: "tile" runs the forward's
// dropout_scores on a tile of ones held as one warp's accumulators (16 query rows from row0 x TILE_KV keys from
// col0), "transposed" the backward's mark_dropped on S^T (16 key rows from row0 x TILE_KV queries from
// col0); each prints, per kept element, "query key".
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
typedef uint32_t u32;
struct uint4 { u32 x, y, z, w; };
inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }
inline u32 __umulhi(u32 a, u32 b) { return (u32)(((uint64_t)a * b) >> 32); }

thread_local int this_lane;
static std::barrier<>* warp_barrier;
static u32 slot_u32[32];
inline u32 __shfl_sync(u32, u32 v, int source) {
    slot_u32[this_lane] = v;
    warp_barrier->arrive_and_wait();
    const u32 out = slot_u32[source & 31];
    warp_barrier->arrive_and_wait();
    return out;
}
inline u32 __shfl_xor_sync(u32 mask, u32 v, int lanes) { return __shfl_sync(mask, v, this_lane ^ lanes); }
u32 pack2(float, float);   // the backward's fragments: not run here

#include "../templates/philox.cuh"
#include "../templates/dropout.cuh"

struct C {
    static constexpr int M_TILES = 1, S_TILES = TILE_KV / 8;
    static constexpr u32 DROP_THRESHOLD = THRESHOLD;
};

int main() {
    char mode[16];
    if (scanf("%15s", mode) != 1) return 1;
    if (!strcmp(mode, "words")) {
        unsigned count, k0, k1;
        if (scanf("%u %u %u", &count, &k0, &k1) != 3) return 1;
        for (unsigned i = 0; i < count; ++i) {
            uint4 c;
            if (scanf("%u %u %u %u", &c.x, &c.y, &c.z, &c.w) != 4) return 1;
            const uint4 w = philox4x32_10(c, k0, k1);
            printf("%u %u %u %u\n", w.x, w.y, w.z, w.w);
        }
        return 0;
    }
    unsigned long long seed_lo, seed_hi, offset;
    int batch, heads, head, row0, col0;
    if (scanf("%llu %llu %llu %d %d %d %d %d", &seed_lo, &seed_hi, &offset, &batch, &heads, &head, &row0, &col0) != 8)
        return 1;
    const DropoutRng rng = dropout_rng(seed_lo | seed_hi << 32, offset, batch, heads, head);
    std::barrier<> barrier(32);
    warp_barrier = &barrier;
    static float tile[32][C::S_TILES][4];
    const bool transposed = !strcmp(mode, "transposed");
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
            this_lane = lane;
            float p[1][C::S_TILES][4];
            for (int nt = 0; nt < C::S_TILES; ++nt)
                for (int e = 0; e < 4; ++e) p[0][nt][e] = 1.f;
            if (transposed) {   // the dropped ones come back negative
                mark_dropped<C::S_TILES>(p, rng, row0, col0, lane, C::DROP_THRESHOLD);
                for (int nt = 0; nt < C::S_TILES; ++nt)
                    for (int e = 0; e < 4; ++e) p[0][nt][e] = p[0][nt][e] > 0.f ? 1.f : 0.f;
            } else {
                dropout_scores<C>(p, rng, row0, col0, lane);
            }
            memcpy(tile[lane], p[0], sizeof tile[lane]);
        });
    for (auto& t : lanes) t.join();
    for (int lane = 0; lane < 32; ++lane)   // attention.cuh's accumulator layout: acc_row, acc_col
        for (int nt = 0; nt < C::S_TILES; ++nt)
            for (int e = 0; e < 4; ++e)
                if (tile[lane][nt][e] != 0.f) {
                    const int row = row0 + (lane >> 2) + 8 * (e >> 1), col = col0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                    printf("%d %d\n", transposed ? col : row, transposed ? row : col);
                }
    return 0;
}
