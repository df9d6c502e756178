// Builds TriForce's retrieval cache (Sun et al. 2024, §4.2): which of the prompt's KV entries
// the middle level of the hierarchy (the target's own weights) reads, per layer and KV head.
//
// Scoring. The prompt's positions [0, fresh_from) split into chunks of `chunk` positions;
// chunk c's key is the mean of its post-RoPE keys in the KV head. Its score in KV head h is
// the dot product of that mean with the last query (the token at fresh_from - 1, the last one
// the context ran) summed over the query heads of h's group: for grouped-query attention the
// group shares h's keys, so the chunk serves every head of the group, and the sum ranks it by
// the attention logit the group as a whole gives it (with one query head per KV head this is
// the public code's score). No scale and no softmax: both preserve the order.
//
// The partial last chunk (when fresh_from is not a multiple of chunk) is scored by the mean of
// the keys it has and ranked like any other; its entries count one each against the budget.
//
// Ranking. Chunk 0 (the attention sink) comes first whatever its score, then the other chunks
// by descending score (the lower index first on ties); each chunk's positions in order. The
// view (RetrievalView) reads the best budget - f entries, f being the tokens generated since,
// so generated tokens overwrite the least important entries and the budget stays fixed.
//
// The view selects cells; nothing is copied. The cost of a build is one read of the prompt's
// keys per layer.
#pragma once

#include <cstdint>
#include <memory>

#include "specmesh/model/context.hpp"
#include "specmesh/model/kv_view.hpp"

namespace specmesh {

// Ranks sequence 0's entries at positions [0, fresh_from) of every layer of ctx. Throws
// std::invalid_argument when ctx's last forward pass did not end at position fresh_from - 1
// or sequence 0 holds no cell there, or chunk / budget are not positive.
std::shared_ptr<const RetrievalView> build_retrieval_view(const Context& ctx, int32_t fresh_from, int32_t chunk,
                                                          int32_t budget);

}  // namespace specmesh
