// Launch order of one-block-per-query-tile kernels (tiledsl/block_order.py).
// Launch order (block_order.py): the (batch, head) pairs cut into `order_groups` groups of equal
// size, one group after another; inside a group the longest query tiles of all its pairs first
// (under a causal mask later tiles see more keys).
struct BlockTile { int q_block, pair; };
// The (query tile, pair) of launch-order position `block` among `blocks` = q tiles x pairs: a
// persistent kernel walks positions itself, every other kernel takes its block index.
template <class C>
__device__ __forceinline__ BlockTile block_tile_at(u32 block, u32 blocks, int q_len, int order_groups) {
    // 32-bit unsigned is exact: pairs <= 65535 (checked at launch), so pairs * groups < 2^32.
    const u32 groups = order_groups;
    const u32 q_tiles = (q_len + C::BR - 1) / C::BR;
    const u32 pairs = blocks / q_tiles;
    const u32 pair_slot = block / q_tiles;
    const u32 group = ((pair_slot + 1) * groups - 1) / pairs;   // the last group starting at or before pair_slot
    const u32 start = group * pairs / groups;
    const u32 size = (group + 1) * pairs / groups - start;
    const u32 in_group = block - start * q_tiles;
    return {(int)(q_tiles - 1 - in_group / size), (int)(start + in_group % size)};
}
template <class C>
__device__ __forceinline__ BlockTile block_tile(int q_len, int order_groups) {
    return block_tile_at<C>(block_index_x(), gridDim.x, q_len, order_groups);
}
