// Reading 16-bit values (TILE_DTYPE, common.cuh) as floats: the backward kernels and the ring merge.
// Two 16-bit values of one register -> two floats.
__device__ __forceinline__ float2 unpack2(u32 x) {
    float2 r;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32." TILE_DTYPE " %0, lo; cvt.f32." TILE_DTYPE " %1, hi; }"
        : "=f"(r.x), "=f"(r.y) : "r"(x));
    return r;
}
