// combine_warp_states<C>: merge the online-softmax states of warps that processed disjoint key
// ranges of the same query rows (split-K), through shared memory. Written for FA1's warps along
// kv; meant for every family that splits a tile's keys across warps (decode too).
//
// Contract
//   Called by every thread of the block (it contains __syncthreads), after each warp has folded
//   its own keys in with attention.cuh's online_softmax / mma_pv. Each warp holds, for the same
//   ROWS = C::M_TILES * 16 rows, in the m16n8 accumulator layout:
//     row_max[mt][h]  its running max of the raw (unscaled) scores, equal across a quad
//                     (-inf for a row none of its keys is visible to)
//     row_sum[mt][h]  this thread's partial row sum of P = exp(scale (s - row_max)); the quad's
//                     four values add up to the warp's l
//     o[mt][nd][e]    the warp's unnormalised sum of P V (fp32); with QUAD_COLUMNS (decode's FP8
//                     fragments) the O tiles 2c, 2c+1 of a lane hold columns 16c + 4t + 0..3 (t = lane % 4),
//                     in that order, instead of 8nd + 2t + 0..1
//   C needs: WARPS, M_TILES, O_TILES, SCALE_LOG2, COMBINE_ROW_FLOATS (>= O_TILES * 8; a padded
//   row of the fp32 O tile).
//   `scratch` points at COMBINE_BYTES >= 4 * (ROWS * COMBINE_ROW_FLOATS + (WARPS + 2) * ROWS)
//   bytes of shared memory, laid out as float arrays:
//     o_sum[ROWS][COMBINE_ROW_FLOATS]   the combined unnormalised O, scaled to m
//     m_part[WARPS][ROWS]               each warp's row max (used internally)
//     m[ROWS]                           the combined row max (raw scores; -inf: no visible key)
//     l[ROWS]                           the combined row sum of exp(scale (s - m))
//   `rows_valid` (default: every row) limits the O rows combined to the first rows_valid: rows
//   past it (decode's padding of a kv group to a 16-row mma tile) are left unwritten in o_sum.
//   On return (after a __syncthreads) o_sum, m and l hold the combined state of every row; the
//   caller normalises (O = o_sum / l, 0 where l == 0) and stores. The registers are consumed
//   (o and row_sum are rescaled in place). The warps add into o_sum in warp order, so results
//   are deterministic (bitwise identical run to run). Reuse of `scratch` afterwards needs a
//   barrier after the caller has read it.
// It uses fast_exp2, quad_sum, NEG_INF (common.cuh).
// Shared-memory combine of split-K warp states; the contract is above.
template <class C, bool QUAD_COLUMNS = false>
__device__ __forceinline__ void combine_warp_states(float (&o)[C::M_TILES][C::O_TILES][4], const float (&row_max)[C::M_TILES][2],
                                                    float (&row_sum)[C::M_TILES][2], float* scratch, int warp, int lane,
                                                    int rows_valid = C::M_TILES * 16) {
    constexpr int ROWS = C::M_TILES * 16;
    float* o_sum = scratch;
    float* m_part = o_sum + ROWS * C::COMBINE_ROW_FLOATS;
    float* m_all = m_part + C::WARPS * ROWS;
    float* l_all = m_all + ROWS;
    // 1. Publish every warp's row maxima.
    if ((lane & 3) == 0) {
#pragma unroll
        for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) m_part[warp * ROWS + mt * 16 + (lane >> 2) + 8 * h] = row_max[mt][h];
    }
    __syncthreads();
    // 2. Rescale this warp's state to the max over all warps: exp(scale (m_warp - m)).
    float l_warp[C::M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = mt * 16 + (lane >> 2) + 8 * h;
            float m = m_part[row];
#pragma unroll
            for (int w = 1; w < C::WARPS; ++w) m = fmaxf(m, m_part[w * ROWS + row]);
            // A row no warp saw a key of keeps m = -inf; use 0 so exp never sees -inf - -inf.
            const float m_scaled = m == NEG_INF ? 0.f : m * C::SCALE_LOG2;
            const float alpha = fast_exp2(row_max[mt][h] * C::SCALE_LOG2 - m_scaled);
            l_warp[mt][h] = quad_sum(row_sum[mt][h] * alpha);
#pragma unroll
            for (int nd = 0; nd < C::O_TILES; ++nd) {
                o[mt][nd][2 * h] *= alpha;
                o[mt][nd][2 * h + 1] *= alpha;
            }
            if (warp == 0 && (lane & 3) == 0) m_all[row] = m;
        }
    // 3. Add the warps' rescaled O and l into o_sum and l, one warp at a time (deterministic order).
#pragma unroll 1
    for (int turn = 0; turn < C::WARPS; ++turn) {
        if (warp == turn) {
#pragma unroll
            for (int mt = 0; mt < C::M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = mt * 16 + (lane >> 2) + 8 * h;
                    if (row >= rows_valid) continue;   // padding rows: nobody reads their O
#pragma unroll
                    for (int nd = 0; nd < C::O_TILES; ++nd) {
                        const int col = QUAD_COLUMNS ? (nd >> 1) * 16 + 4 * (lane & 3) + 2 * (nd & 1) : nd * 8 + 2 * (lane & 3);
                        float2* cell = reinterpret_cast<float2*>(o_sum + row * C::COMBINE_ROW_FLOATS + col);
                        float2 value = make_float2(o[mt][nd][2 * h], o[mt][nd][2 * h + 1]);
                        if (turn > 0) {
                            const float2 before = *cell;
                            value.x += before.x;
                            value.y += before.y;
                        }
                        *cell = value;
                    }
                    if ((lane & 3) == 0) l_all[row] = turn > 0 ? l_all[row] + l_warp[mt][h] : l_warp[mt][h];
                }
        }
        __syncthreads();
    }
}
