#include "specmesh/devices/latency_tables.hpp"

#include <array>

namespace specmesh {

namespace {

constexpr std::array<OpLatency, 19> kLayer1 = {{
    {"LayerNorm", 12454}, {"Matmul", 109174}, {"ShardedToInterleaved", 4299},
    {"NLPCreateHeadsDecode", 21048}, {"RotaryEmbeddingLlama", 4828}, {"RotaryEmbeddingLlama", 4827},
    {"PagedUpdateCache", 13166}, {"PagedUpdateCache", 13049}, {kAttentionOp, 69853},
    {"InterleavedToSharded", 1701}, {"NLPConcatHeadsDecode", 3055}, {"Matmul", 76389},
    {"Binary", 1823}, {"LayerNorm", 12487}, {"Matmul", 141261}, {"Matmul", 141772},
    {"Binary", 30204}, {"Matmul", 252556}, {"Binary", 2654},
}};
constexpr std::array<OpLatency, 19> kHead1 = {{
    {"Embeddings", 5745}, {"Embeddings", 5639}, {"Transpose", 13808}, {"Transpose", 13512},
    {"Slice", 2091}, {"Slice", 2089}, {"InterleavedToSharded", 1694}, {"InterleavedToSharded", 1759},
    {"Reshard", 3386}, {"LayerNorm", 13243}, {"Matmul", 546986}, {"ShardedToInterleaved", 9003},
    {"Matmul", 545955}, {"ShardedToInterleaved", 8833}, {"Matmul", 545707},
    {"ShardedToInterleaved", 8944}, {"Matmul", 547068}, {"ShardedToInterleaved", 9055},
    {"Concat", 29186},
}};

constexpr std::array<OpLatency, 24> kLayer2 = {{
    {"AllGather", 19567}, {"LayerNorm", 12471}, {"Matmul", 56690}, {"ShardedToInterleaved", 2541},
    {"NLPCreateHeadsDecode", 10972}, {"RotaryEmbeddingLlama", 4834}, {"RotaryEmbeddingLlama", 4820},
    {"PagedUpdateCache", 8447}, {"PagedUpdateCache", 8383}, {kAttentionOp, 64309},
    {"InterleavedToSharded", 1833}, {"NLPConcatHeadsDecode", 2320}, {"Matmul", 41730},
    {"ReduceScatter", 21842}, {"Binary", 1621}, {"AllGather", 20887}, {"LayerNorm", 12486},
    {"Matmul", 76942}, {"Matmul", 77430}, {"Binary", 16543}, {"Matmul", 128695},
    {"ReduceScatter", 19108}, {"Reshard", 3233}, {"Binary", 1620},
}};
// The paper's text shows the 17048 ns Concat twice in this column; with both the rows exceed the
// printed total by exactly one Concat, so we keep one (the rest then matches within 42 ns).
constexpr std::array<OpLatency, 15> kHead2 = {{
    {"Embeddings", 5549}, {"Embeddings", 5767}, {"Transpose", 13570}, {"Transpose", 13590},
    {"Slice", 2094}, {"Slice", 2222}, {"InterleavedToSharded", 1748}, {"InterleavedToSharded", 1743},
    {"AllGather", 20607}, {"LayerNorm", 12931}, {"Matmul", 546309}, {"ShardedToInterleaved", 8779},
    {"Matmul", 546729}, {"ShardedToInterleaved", 8992}, {"Concat", 17048},
}};

constexpr std::array<OpLatency, 24> kLayer4 = {{
    {"AllGather", 22378}, {"LayerNorm", 12485}, {"Matmul", 39022}, {"ShardedToInterleaved", 2057},
    {"NLPCreateHeadsDecode", 6269}, {"RotaryEmbeddingLlama", 4837}, {"RotaryEmbeddingLlama", 4834},
    {"PagedUpdateCache", 6260}, {"PagedUpdateCache", 6342}, {kAttentionOp, 56024},
    {"InterleavedToSharded", 1694}, {"NLPConcatHeadsDecode", 1955}, {"Matmul", 24505},
    {"ReduceScatter", 24753}, {"Binary", 1517}, {"AllGather", 22055}, {"LayerNorm", 13423},
    {"Matmul", 39711}, {"Matmul", 39791}, {"Binary", 15800}, {"Matmul", 68424},
    {"ReduceScatter", 24764}, {"Reshard", 3212}, {"Binary", 1496},
}};
constexpr std::array<OpLatency, 12> kHead4 = {{
    {"Embeddings", 5622}, {"Embeddings", 5767}, {"Transpose", 13328}, {"Transpose", 13585},
    {"Slice", 2088}, {"Slice", 2193}, {"InterleavedToSharded", 1795}, {"InterleavedToSharded", 1703},
    {"AllGather", 24259}, {"LayerNorm", 12906}, {"Matmul", 546508}, {"ShardedToInterleaved", 8775},
}};

constexpr std::array<OpLatency, 25> kLayer8 = {{
    {"AllGather", 34069}, {"LayerNorm", 12507}, {"Matmul", 35745}, {"ShardedToInterleaved", 1620},
    {"NLPCreateHeadsDecode", 3976}, {"RotaryEmbeddingLlama", 4839}, {"RotaryEmbeddingLlama", 4837},
    {"PagedUpdateCache", 5007}, {"PagedUpdateCache", 5078}, {kAttentionOp, 50096},
    {"InterleavedToSharded", 1708}, {"NLPConcatHeadsDecode", 1774}, {"Reshard", 2274},
    {"AllGatherMatmul", 88825}, {"Reshard", 2847}, {"Binary", 1464}, {"AllGather", 54386},
    {"LayerNorm", 15771}, {"Matmul", 22705}, {"Matmul", 22899}, {"Binary", 15804},
    {"Matmul", 38486}, {"ReduceScatter", 59572}, {"Reshard", 2817}, {"Binary", 1441},
}};
constexpr std::array<OpLatency, 12> kHead8 = {{
    {"Embeddings", 5641}, {"Embeddings", 5607}, {"Transpose", 13717}, {"Transpose", 13680},
    {"Slice", 2095}, {"Slice", 2092}, {"InterleavedToSharded", 1707}, {"InterleavedToSharded", 1726},
    {"AllGather", 43463}, {"LayerNorm", 12909}, {"Matmul", 276107}, {"ShardedToInterleaved", 5716},
}};

const std::array<WormholeLatencyTable, 4> kWormhole = {{
    {1, "Table 4", kLayer1, 846747, kHead1, 2313703},
    {2, "Table 5", kLayer2, 555015, kHead2, 1207636},
    {4, "Table 6", kLayer4, 387584, kHead4, 638529},
    {8, "Table 7", kLayer8, 440451, kHead8, 384460},
}};

constexpr std::array<H100Row, 5> kH100 = {{
    {1 * 1024, 13, 95, 244.6, 249.3, 262.0},
    {32 * 1024, 29, 100, 214.2, 231.3, 246.0},
    {64 * 1024, 49, 100, 191.4, 209.7, 237.8},
    {96 * 1024, 56, 100, 178.2, 194.2, 224.9},
    {128 * 1024, 63, 101, 169.3, 184.8, 217.5},
}};

}  // namespace

std::span<const WormholeLatencyTable> wormhole_llama31_8b_tables() { return kWormhole; }

std::span<const H100Row> h100_llama3_8b_table() { return kH100; }

}  // namespace specmesh
