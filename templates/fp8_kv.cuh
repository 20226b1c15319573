// decode's FP8 KV cache (kv_dtype = e4m3): the conversion every path shares and K's scale on the scores.
// Reads decode's C (DEQUANT_VIA_F32) and W (one warp's key slice).
// FP8 KV cache: two e4m3 -> two compute-type values (low byte -> low half), exactly: every e4m3
// value (normal, subnormal, NaN) is an fp16 value and a bf16 value. sm_89+ converts to f16x2 in
// one cvt; for bf16 the halves go through f32 (PTX has no e4m3 -> bf16x2 on sm_90).
__device__ __forceinline__ u32 dequant_e4m3x2(u32 pair) {
    u32 h;
    asm("{ .reg .b16 p; cvt.u16.u32 p, %1; cvt.rn.f16x2.e4m3x2 %0, p; }" : "=r"(h) : "r"(pair));
    if constexpr (C::DEQUANT_VIA_F32) {
        float low, high;
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
            : "=f"(low), "=f"(high) : "r"(h));
        return pack2(low, high);
    }
    return h;
}

// K's dequantization scale, folded into the scores (fp32) before the mask and the softmax.
__device__ __forceinline__ void scale_scores(float (&s)[W::M_TILES][W::S_TILES][4], float scale) {
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < W::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale;
}
