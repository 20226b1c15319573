// Index bounds: a kernel that reads kv_lens (and a paged cache's block table) checks the entries
// its block reads before it reads K or V through them. A sequence with a bad entry loads no kv
// tile (its tile range is empty: `keys_read` = 0), its output rows and LSE become NaN, and the first bad entry goes to
// the error word (runtime/device_errors.py: [code, tensor, batch, index, value, bound]), which
// the host reads without a copy. Every block of a bad sequence finds it (each checks the whole
// sequence), so every split of a split-KV launch writes NaN partials. The paged check is
// paged_kv.cuh's paged_sequence_bad, next to the cache's other block-table reads. fa2's paged chunked
// prefill checks after its kv loop instead: its loads walk a bad kv_len clamped to the table row and
// a bad entry as page 0 (in bounds, read and then discarded), and the check makes the rows NaN.
// Kernels whose kv range is worked out once (fa1, fa2 on wgmma, hopper) give a bad sequence no key
// and make its rows NaN where it costs no register (each template says where).

// The error word's codes and tensors (the host's device_errors.CODES and TENSORS).
constexpr int INDEX_PAGE_OUT_OF_RANGE = 1, INDEX_LEN_OVER_TABLE = 2, INDEX_LEN_NEGATIVE = 3, INDEX_LEN_OVER_K = 4,
              INDEX_OFFSET_OUT_OF_RANGE = 5, INDEX_OFFSET_DECREASING = 6, INDEX_SEQUENCE_OVER_MAX = 7,
              INDEX_DESCALE_INVALID = 8, INDEX_DESCALE_ZERO_V_BLOCK = 9;
constexpr int INDEX_TENSOR_BLOCK_TABLE = 1, INDEX_TENSOR_KV_LENS = 2, INDEX_TENSOR_CU_SEQLENS_Q = 3,
              INDEX_TENSOR_CU_SEQLENS_K = 4, INDEX_TENSOR_Q_DESCALE = 5, INDEX_TENSOR_K_DESCALE = 6,
              INDEX_TENSOR_V_DESCALE = 7;
// Word 0 while the winning report writes the others: the host reads a code only after its fields.
constexpr int INDEX_REPORT_WRITING = -1;

#define QUIET_NAN __int_as_float(0x7fffffff)

// The first report since the host last cleared the words wins; later ones leave them as they are.
__device__ __forceinline__ void report_bad_index(int* words, int code, int tensor, int batch, int index, int value,
                                              int bound) {
    if (atomicCAS(words, 0, INDEX_REPORT_WRITING) != 0) return;
    volatile int* fields = words;
    fields[1] = tensor;
    fields[2] = batch;
    fields[3] = index;
    fields[4] = value;
    fields[5] = bound;
    __threadfence_system();
    atomicExch(words, code);
}

// Contiguous K and V: is kv_lens[batch] outside [0, kv_len] (the keys k holds)? No kv_lens: no.
__device__ __forceinline__ bool contiguous_len_bad(const int* kv_lens, int batch, int kv_len) {
    if (!kv_lens) return false;
    const int value = kv_lens[batch];
    return value < 0 || value > kv_len;
}

// The report of a bad contiguous kv_lens entry, by the one thread that makes it.
__device__ __forceinline__ void report_contiguous_len(const int* kv_lens, int batch, int kv_len, int* words) {
    const int value = kv_lens[batch];
    report_bad_index(words, value < 0 ? INDEX_LEN_NEGATIVE : INDEX_LEN_OVER_K, INDEX_TENSOR_KV_LENS, batch, 0, value,
                     kv_len);
}

// Both at once, where the check costs no registers at the kernel's start: the entry is the same
// for the whole block; thread 0 reports it.
__device__ __forceinline__ bool contiguous_sequence_bad(const int* kv_lens, int batch, int kv_len, int* words) {
    if (!contiguous_len_bad(kv_lens, batch, kv_len)) return false;
    if (threadIdx.x == 0) report_contiguous_len(kv_lens, batch, kv_len, words);
    return true;
}

// Packed sequences: sequence s is rows start .. end - 1 (cu_seqlens[s], cu_seqlens[s + 1]) of a tensor of
// `total` rows. Offsets outside the tensor or going down are bad (the rows they name are not the sequence's).
__device__ __forceinline__ bool offsets_bad(int start, int end, int total) {
    return start < 0 || end < start || end > total;
}

// The report of sequence s's bad offsets in `cu_seqlens` (tensor code `tensor`), by the one thread that makes it:
// the first entry found out of range, or the end below the start.
__device__ __forceinline__ void report_offsets(const int* cu_seqlens, int s, int total, int tensor, int* words) {
    const int start = cu_seqlens[s], end = cu_seqlens[s + 1];
    if (start < 0 || start > total)
        report_bad_index(words, INDEX_OFFSET_OUT_OF_RANGE, tensor, s, s, start, total);
    else if (end < start)
        report_bad_index(words, INDEX_OFFSET_DECREASING, tensor, s, s + 1, end, start);
    else
        report_bad_index(words, INDEX_OFFSET_OUT_OF_RANGE, tensor, s, s + 1, end, total);
}

// Is packed sequence s bad: its query or key offsets, or more queries than the work list covers (`max_q`: a list
// built from max_seqlen_q holds that many rows of every sequence)?
__device__ __forceinline__ bool packed_sequence_bad(int q_start, int q_end, int k_start, int k_end, int total_q,
                                                    int total_k, int max_q) {
    return offsets_bad(q_start, q_end, total_q) || offsets_bad(k_start, k_end, total_k) || q_end - q_start > max_q;
}

// The report of a bad packed sequence s, by the one thread that makes it.
__device__ __forceinline__ void report_packed_sequence(const int* cu_seqlens_q, const int* cu_seqlens_k, int s,
                                                       int total_q, int total_k, int max_q, int* words) {
    const int q_start = cu_seqlens_q[s], q_end = cu_seqlens_q[s + 1];
    if (offsets_bad(q_start, q_end, total_q))
        report_offsets(cu_seqlens_q, s, total_q, INDEX_TENSOR_CU_SEQLENS_Q, words);
    else if (offsets_bad(cu_seqlens_k[s], cu_seqlens_k[s + 1], total_k))
        report_offsets(cu_seqlens_k, s, total_k, INDEX_TENSOR_CU_SEQLENS_K, words);
    else
        report_bad_index(words, INDEX_SEQUENCE_OVER_MAX, INDEX_TENSOR_CU_SEQLENS_Q, s, s + 1, q_end - q_start, max_q);
}

// The softmax state of a bad sequence's rows (which load no kv tile), set once after it is
// initialised so that they store NaN O and LSE: acc = m = NaN and a positive partial row sum.
// attention.cuh's store (O = acc / l, LSE = m * SCALE + log(l) where l > 0) gives NaN; decode's
// warp combine makes l NaN too, which its store lets through.
template <class C>
__device__ __forceinline__ void poison_rows(float (&acc_o)[C::M_TILES][C::O_TILES][4], float (&row_max)[C::M_TILES][2],
                                            float (&row_sum)[C::M_TILES][2]) {
#pragma unroll
    for (int mt = 0; mt < C::M_TILES; ++mt) {
#pragma unroll
        for (int nd = 0; nd < C::O_TILES; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][nd][e] = QUIET_NAN;
        row_max[mt][0] = row_max[mt][1] = QUIET_NAN;
        row_sum[mt][0] = row_sum[mt][1] = 1.f;
    }
}
