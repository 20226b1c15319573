// mask_mod's per-element test in the hopper forward, pasted after mask_mods.cuh and expressions.cuh into kernels whose
// spec has a mask_mod (their plan has mask_mods: the spec's mask, documents and prefix come from mask_mods.cuh).

// mask_mods.cuh's mask, documents and prefix, and mask_mod, in one pass: the keys any of them hides become -inf
// (indices clamped wherever the expressions read aux; two passes would hold the elements' indices twice).
template <class C>
__device__ __forceinline__ void apply_mask_mods_and_mask_mod(float (&s)[C::M_TILES][C::S_TILES][4], int row0, int col0,
                                                             int kv_len, int diag, int lane, const DocumentRows& docs,
                                                             const ExprItem& x) {
    static_assert(C::M_TILES == 1, "a thread's two rows are its only accumulator rows");
#pragma unroll
    for (int nt = 0; nt < C::S_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + acc_row(lane, e), col = col0 + nt * 8 + acc_col(lane, e);
            const int2 at = expr_point<C::EXPR_CLAMP>(x, row, col);
            if (!(mask_mods_visible<C>(row, col, kv_len, diag, docs, e)
                  && mask_mod_of(x.b, x.h, at.x, at.y, x.q_len, x.kv_len, x.aux)))
                s[0][nt][e] = NEG_INF;
        }
}
