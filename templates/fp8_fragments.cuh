// decode's FP8 path `dequant fragments`: ldmatrix on the e4m3 rings, converted in registers (reads
// decode's C and W; after fp8_kv.cuh).
// FP8 fragments: ldmatrix reads the e4m3 ring itself. A row of an 8x8 b16 matrix is 16 e4m3
// values, so lane (g = lane / 4, t = lane % 4) of a plain ldmatrix gets 4 consecutive values
// (dims 16c + 4t .. 4t+3) of key row g, and of a transposed one 2 dims (16c + 2g, +1) of keys 2t
// and 2t+1. Neither is the m16n8k16 fragment of 16-bit values, so the MMAs take the bytes in
// the order they come, which the sums allow:
//   Q K^T: the MMA's k index (the head dim) runs in the order lanes hold K: the B fragment's k
//   pairs (2t, 2t+1) and (2t+8, 2t+9) are dims 16ks + 4t + 0..1 and 2..3, and Q's A fragment is
//   loaded in the same order (load_q_fragments_fp8). The scores come out in the usual layout.
//   P V: the even and the odd dims of a 16-dim chunk c are two 8-column n tiles (O tiles 2c and
//   2c+1): the transposed word's bytes 0, 2 are key 2t, 2t+1 of dim 16c + 2g, bytes 1, 3 of dim
//   16c + 2g + 1 (one prmt sorts them). A lane then holds O columns 16c + 4t + 0..3 across its
//   two tiles; fp8_o_quad_columns puts them in column order for the combine (QUAD_COLUMNS).
// Both rings are XOR-swizzled (chunk_offset: swizzle_xor) or padded to an odd number of chunks,
// so each 8-row matrix of an ldmatrix reads 8 different bank groups.
__device__ __forceinline__ void q_fragment_fp8(u32 (&frag)[4], u32 q_tile, int mt, int ks, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {   // rows g and g + 8: a0, a2 and a1, a3
        const u32 address = q_tile + chunk_offset<C::QK_ROW_BYTES, C::QK_SWIZZLE>(mt * 16 + (lane >> 2) + 8 * h,
                                                                                    2 * ks + ((lane & 3) >> 1))
                            + (lane & 1) * 8;   // dims 16ks + 4t .. 4t+3: 8 bytes of a 16-byte chunk
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(frag[h]), "=r"(frag[2 + h]) : "r"(address));
    }
}
__device__ __forceinline__ void load_q_fragments_fp8(u32 (&q_regs)[W::Q_REG_TILES][W::D / 16][4], u32 q_tile, int lane) {
#pragma unroll
    for (int mt = 0; mt < W::Q_REG_TILES; ++mt)
#pragma unroll
        for (int ks = 0; ks < W::D / 16; ++ks) q_fragment_fp8(q_regs[mt][ks], q_tile, mt, ks, lane);
}

// P V runs in fp16 whatever Q's dtype: e4m3 -> f16 is one cvt (-> bf16 four), and P in [0, 1] keeps
// more bits in fp16 (11 significant, subnormal below 2^-14) than in bf16 (8); fp32 accumulators.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 h;
    asm("{ .reg .b16 p; cvt.u16.u32 p, %1; cvt.rn.f16x2.e4m3x2 %0, p; }" : "=r"(h) : "r"(pair));
    return h;
}
__device__ __forceinline__ u32 pack2_f16(float low, float high) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
    return r;
}
__device__ __forceinline__ void mma_16816_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// S = Q K^T on this warp's key slice, K's fragments straight from the e4m3 ring; Q's from registers,
// or (Q_IN_REGISTERS false: large head dims) from shared memory, two k steps at a time.
__device__ __forceinline__ void mma_qk_fp8(float (&s)[W::M_TILES][W::S_TILES][4], const u32 (&q_regs)[W::Q_REG_TILES][W::D / 16][4],
                                           u32 q_tile, u32 k_ring, int lane) {
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < W::S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kp = 0; kp < W::D / 32; ++kp) {   // 32 dims: two k steps
        u32 q_frag[W::M_TILES][2][4];
#pragma unroll
        for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if constexpr (C::Q_IN_REGISTERS) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) q_frag[mt][i][r] = q_regs[mt][2 * kp + i][r];
                } else {
                    q_fragment_fp8(q_frag[mt][i], q_tile, mt, 2 * kp + i, lane);
                }
            }
#pragma unroll
        for (int np = 0; np < W::S_TILES / 2; ++np) {   // 16 keys: two n tiles
            u32 k8[4];   // [keys 0-7, chunk 2kp], [keys 8-15, 2kp], [keys 0-7, 2kp+1], [keys 8-15, 2kp+1]
            ldmatrix_x4(k8, k_ring + chunk_offset_split<C::K8_ROW_BYTES, C::K8_SWIZZLE>(np * 16 + (lane & 8), lane & 7,
                                                                                         2 * kp + (lane >> 4)));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 b0 = dequant_e4m3x2(k8[i]), b1 = dequant_e4m3x2(k8[i] >> 16);
#pragma unroll
                for (int mt = 0; mt < W::M_TILES; ++mt) mma_16816(s[mt][2 * np + (i & 1)], q_frag[mt][i >> 1], b0, b1);
            }
        }
    }
}

// O += P V in fp16, V's fragments straight from the e4m3 ring (transposed ldmatrix); O tiles 2c /
// 2c+1 hold the even / odd dims of chunk c.
__device__ __forceinline__ void mma_pv_fp8(float (&o)[W::M_TILES][W::O_TILES][4], const float (&p)[W::M_TILES][W::S_TILES][4],
                                           u32 v_ring, int lane) {
#pragma unroll
    for (int kk = 0; kk < W::S_TILES / 2; ++kk) {   // 16 keys: two 8-column tiles of P
        u32 p_frag[W::M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < W::M_TILES; ++mt) {
            p_frag[mt][0] = pack2_f16(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            p_frag[mt][1] = pack2_f16(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            p_frag[mt][2] = pack2_f16(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            p_frag[mt][3] = pack2_f16(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int cp = 0; cp < W::DV / 32; ++cp) {   // 32 dims: chunks 2cp, 2cp+1
            u32 v8[4];   // [keys 0-7, chunk 2cp], [keys 8-15, 2cp], [keys 0-7, 2cp+1], [keys 8-15, 2cp+1]
            ldmatrix_x4_trans(v8, v_ring + chunk_offset_split<C::V8_ROW_BYTES, C::V8_SWIZZLE>(kk * 16 + (lane & 8), lane & 7,
                                                                                               2 * cp + (lane >> 4)));
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // bytes (0, 2): keys 2t, 2t+1 of the even dim; (1, 3): of the odd dim
                const u32 low = __byte_perm(v8[2 * i], 0u, 0x3120), high = __byte_perm(v8[2 * i + 1], 0u, 0x3120);
                const u32 even0 = e4m3x2_to_f16x2(low), even1 = e4m3x2_to_f16x2(high);
                const u32 odd0 = e4m3x2_to_f16x2(low >> 16), odd1 = e4m3x2_to_f16x2(high >> 16);
#pragma unroll
                for (int mt = 0; mt < W::M_TILES; ++mt) {
                    mma_16816_f16(o[mt][4 * cp + 2 * i], p_frag[mt], even0, even1);
                    mma_16816_f16(o[mt][4 * cp + 2 * i + 1], p_frag[mt], odd0, odd1);
                }
            }
        }
    }
}

// A lane's O tiles 2c (dims 16c + 4t, +2) and 2c+1 (16c + 4t + 1, +3) -> columns 16c + 4t + 0..3 in
// the order combine_warp_states<C, true> stores them: swap the middle two of each row half.
__device__ __forceinline__ void fp8_o_quad_columns(float (&o)[W::M_TILES][W::O_TILES][4]) {
#pragma unroll
    for (int mt = 0; mt < W::M_TILES; ++mt)
#pragma unroll
        for (int c = 0; c < W::O_TILES / 2; ++c)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float t = o[mt][2 * c][2 * h + 1];
                o[mt][2 * c][2 * h + 1] = o[mt][2 * c + 1][2 * h];
                o[mt][2 * c + 1][2 * h] = t;
            }
}
