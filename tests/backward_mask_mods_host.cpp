// templates/backward_mask_mods.cuh on the host, over tests/mask_mods_host.cpp's warp of std::threads (its
// shuffles, ballots and reductions; its main is renamed away): the warp-specialized backward's view of the
// document and prefix masks (tests/test_backward_mask_mods_cpu.py compiles and drives it). Reads: seq_kv q_len,
// the ids (seq_kv of them) or bounds count + bounds; writes per kv tile its key span and q tiles, per key the
// queries it is visible to ("key k: q q ..."), per (key warp, q tile) whether it was tested, and per q tile the
// first kv tile that ordered dQ waits for.
#define main forward_mask_mods_main
#include "mask_mods_host.cpp"
#undef main
#include "backward_mask_mods.cuh"

// The consumer's slice of S^T: all BR query columns (the keys split: each consumer owns 64 keys).
struct SliceC : C { static constexpr int BR = TILE_Q; };

// Run `body(lane)` on one warp of 32 threads (the warp searches and the documents kernel: lane 0's result).
template <class F>
void on_warp(F body) {
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
            this_lane = lane;
            body(lane);
        });
    for (auto& t : lanes) t.join();
}

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
    for (int k0 = 0; k0 < seq_kv; k0 += C::BC) {
        // backward_ws.cu.j2's q_range region: the spec's mask (none or causal here), then narrow_queries
        int q_lo = 0, q_hi = k0 < seq_kv ? q_len : 0;
        if (C::MASK == MASK_CAUSAL) q_lo = max(q_lo, k0 - diag);
        int2 span = make_int2(0, 0);   // the documents kernel's
        on_warp([&](int lane) {
            int2 mine = make_int2(0, 0);
            if (DOCUMENT_KIND == 1) mine = key_tile_span(ids.data(), k0, C::BC, seq_kv, lane);
            if (DOCUMENT_KIND == 2) mine = key_tile_span_bounds(bounds.data(), count, k0, C::BC, seq_kv, lane);
            if (lane == 0) span = mine;
        });
        narrow_queries<C>(q_lo, q_hi, k0, diag, span);
        const int tile_begin = q_lo / C::BR;
        const int tiles = q_hi > q_lo ? (q_hi + C::BR - 1) / C::BR - tile_begin : 0;
        printf("kv %d span %d %d tiles %d %d\n", k0, span.x, span.y, tile_begin, tile_begin + tiles);
        const bool kv_end = k0 + C::BC > seq_kv;
        std::vector<std::vector<int>> seen(C::BC);
        std::vector<int> tested((C::BC / 16) * tiles);
        for (int warp = 0; warp < C::BC / 16; ++warp) {
            std::vector<std::thread> lanes;
            std::vector<std::vector<int>> lane_seen(32 * C::BC);
            for (int lane = 0; lane < 32; ++lane)
                lanes.emplace_back([&, lane] {
                    this_lane = lane;
                    const int warp_row = warp * 16;
                    KeyDocuments keys{};
                    if (DOCUMENT_KIND == 1) {
                        const TileRowIds<KeyRows<C>> key_ids = load_tile_row_ids<KeyRows<C>>(ids.data(), k0, seq_kv - k0, lane);
                        keys = key_documents_of(document_rows<KeyRows<C>>(key_ids, k0, span, warp_row, lane), lane);
                    }
                    if (DOCUMENT_KIND == 2)
                        keys = key_documents_of(document_rows_bounds<KeyRows<C>>(bounds.data(), count, k0, seq_kv - k0,
                                                                                 warp_row, lane), lane);
                    for (int t = 0; t < tiles; ++t) {
                        const int q0 = (tile_begin + t) * C::BR;
                        float s[1][SliceC::BR / 8][4] = {};
                        const bool needs = mask_scores_mods<SliceC>(s, k0, q0, warp_row, lane, kv_end, seq_kv, diag, keys);
                        if (lane == 0) tested[warp * tiles + t] = needs;
                        for (int nt = 0; nt < SliceC::BR / 8; ++nt)
                            for (int e = 0; e < 4; ++e) {
                                const int key = warp_row + acc_row(lane, e), q = q0 + nt * 8 + acc_col(lane, e);
                                if (s[0][nt][e] == 0.f && q < q_len && k0 + key < seq_kv)
                                    lane_seen[lane * C::BC + key].push_back(q);
                            }
                    }
                });
            for (auto& t : lanes) t.join();
            for (int lane = 0; lane < 32; ++lane)
                for (int r = 0; r < C::BC; ++r)
                    for (int q : lane_seen[lane * C::BC + r]) seen[r].push_back(q);
        }
        for (int r = 0; r < C::BC && k0 + r < seq_kv; ++r) {
            std::sort(seen[r].begin(), seen[r].end());
            printf("key %d:", k0 + r);
            for (int q : seen[r]) printf(" %d", q);
            printf("\n");
        }
        printf("tested");
        for (int t : tested) printf(" %d", t);
        printf("\n");
    }
    for (int q0 = 0; q0 < q_len; q0 += C::BR) {   // ordered dQ: the first kv tile that adds to each q tile
        int first = 0;
        on_warp([&](int lane) {
            int mine = 0;
            if (DOCUMENT_KIND == 1) mine = document_first_kv_tile<C>(ids.data(), q0 + diag, lane);
            if (DOCUMENT_KIND == 2) mine = document_first_kv_tile_bounds<C>(bounds.data(), count, q0 + diag, lane);
            if (lane == 0) first = mine;
        });
        printf("first %d %d\n", q0, first);
    }
    return 0;
}
