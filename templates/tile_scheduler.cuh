// The dynamic tile scheduler (`launch dynamic`): a persistent kernel whose producer thread takes
// each next work item from a global counter, so a block that finishes a short item takes the next
// one at once instead of a position fixed at launch. The first gridDim.x items go to the blocks in
// order; item gridDim.x + n goes to whichever producer takes ticket n. counter[0] is the next
// ticket, counter[1] the producers that have taken their last one. The producer names each item to
// its consumers through a shared slot published by Q's full barrier (mbarrier arrive releases, the
// consumers' wait acquires); an index past the last item tells them to stop.

// The next item of this block: a ticket from the counter, past the first gridDim.x.
__device__ __forceinline__ int take_item(int* counter) {
    int ticket;
    asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(ticket) : "l"(counter) : "memory");
    return ticket + (int)gridDim.x;
}

// Called once per block by its producer after the ticket that ended its walk. The last producer to
// get here knows every other one has taken its last ticket, so no take of this launch is left: it
// puts both words back to zero for the next launch on the stream (no host sync, no memset launch;
// a CUDA graph replays it as captured).
__device__ __forceinline__ void finish_items(int* counter) {
    if (atomic_add_acq_rel(counter + 1, 1) == (int)gridDim.x - 1) {
        asm volatile("st.relaxed.gpu.global.s32 [%0], 0;\n" :: "l"(counter) : "memory");
        asm volatile("st.relaxed.gpu.global.s32 [%0], 0;\n" :: "l"(counter + 1) : "memory");
    }
}

__device__ __forceinline__ int load_shared_s32(u32 address) {
    int value;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(value) : "r"(address) : "memory");
    return value;
}
