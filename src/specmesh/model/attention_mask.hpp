// Which tokens of a batch see which, beyond what the KV cache's sequences and positions say.
//
// Causal: a token sees every cell of its sequences at its position or before (the cache's
// rule, batch tokens included). Tree: the batch is a token tree in DFS pre-order; node i
// carries the span [start_i, end_i) of one DFS counter (start_i = i, end_i = i + the size of
// its subtree), so key j is an ancestor-or-self of query i exactly when
//   start_j <= start_i  and  end_i <= end_j.
// Tree tokens also see the committed prefix (cached positions below `prefix`) and nothing
// else of the cache. The state is two integers per node plus the prefix length: O(N), where
// ancestor lists cost O(N * depth) and per-token visible lists O(N * ctx).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "specmesh/kernels/tree_attention.hpp"  // TreeSpan

namespace specmesh {

class AttentionMask {
 public:
  // The causal mask (the default).
  AttentionMask() = default;

  // A tree from parent links: parent[i] is the batch index of node i's parent, or -1 for a
  // root (its parent is the committed prefix). Nodes must be in DFS pre-order (every subtree
  // contiguous, parents first) and at RoPE positions prefix + depth; throws
  // std::invalid_argument naming the first node that breaks either rule.
  static AttentionMask tree(std::span<const int32_t> parent, std::span<const int32_t> pos);

  bool is_tree() const { return tree_; }
  size_t size() const { return spans_.size(); }
  // Positions below this are the committed prefix every tree node sees.
  int32_t prefix() const { return prefix_; }
  const std::vector<TreeSpan>& spans() const { return spans_; }

  // Query i sees key j (both tree nodes): j is i or one of its ancestors.
  bool sees(size_t i, size_t j) const {
    return tree_sees(spans_[i], spans_[j]);
  }
  // Bytes of mask state (the O(N) claim, measurable).
  size_t bytes() const { return spans_.size() * sizeof(TreeSpan) + sizeof(prefix_); }

 private:
  bool tree_ = false;
  int32_t prefix_ = 0;
  std::vector<TreeSpan> spans_;
};

}  // namespace specmesh
