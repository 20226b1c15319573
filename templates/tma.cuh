// Hopper's asynchronous copy engine (TMA) and the shared-memory barriers it completes on. The
// tensor maps are encoded on the host (tiledsl/tensor_maps.py) and passed by value as
// __grid_constant__ kernel parameters; NVRTC has no <cuda.h>, so the map is a plain 128-byte
// struct here.
struct __align__(64) TensorMap { unsigned long long words[16]; };

// mbarrier: an arrival count plus a transaction-byte count; a phase completes when both reach
// zero. Waiters name the parity of the phase they wait for (0, 1, 0, ... per round of a ring slot).
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(arrivals) : "memory");
}
// Make the initialised barriers visible to the copy engine before any thread uses them.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// The producer's arrival that also announces the bytes the copies of this phase will deliver.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// One box of a 4-d tensor (columns, rows, head, batch) into shared memory, completing `bytes` on `bar`.
// Rows past the tensor's end arrive as zeros (and still count as delivered bytes).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap& map, int c0, int c1, int c2, int c3, u32 bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap& map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

// Register reallocation between warpgroups (needs __launch_bounds__(threads, 1)).
template <int REGS>
__device__ __forceinline__ void registers_decrease() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void registers_increase() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS)); }

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` arrive, the syncing ones wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
