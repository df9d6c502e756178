#include "specmesh/model/attention_mask.hpp"

#include <stdexcept>
#include <string>

namespace specmesh {

AttentionMask AttentionMask::tree(std::span<const int32_t> parent, std::span<const int32_t> pos) {
  const size_t n = parent.size();
  if (pos.size() != n) throw std::invalid_argument("tree mask: parents and positions differ in length");
  auto fail = [](size_t i, const std::string& why) {
    throw std::invalid_argument("tree mask: node " + std::to_string(i) + " " + why);
  };
  AttentionMask m;
  m.tree_ = true;
  m.spans_.resize(n);
  if (n == 0) return m;
  m.prefix_ = pos[0];
  // The path from the root to the previous node: in DFS pre-order a node's parent is on it
  // (or the node is a new root), which is also what makes every subtree contiguous.
  std::vector<int32_t> path;
  for (size_t i = 0; i < n; ++i) {
    const int32_t p = parent[i];
    while (!path.empty() && path.back() != p) {
      const int32_t done = path.back();
      path.pop_back();
      m.spans_[done].end = int32_t(i);
    }
    if (p >= 0 && path.empty()) fail(i, "has parent " + std::to_string(p) + ", which is not on the DFS path (nodes must be in DFS pre-order)");
    if (p < -1) fail(i, "has parent " + std::to_string(p));
    const int32_t want = p < 0 ? m.prefix_ : pos[p] + 1;
    if (pos[i] != want)
      fail(i, "is at position " + std::to_string(pos[i]) + ", expected " + std::to_string(want) + " (prefix + depth)");
    m.spans_[i].start = int32_t(i);
    path.push_back(int32_t(i));
  }
  for (int32_t open : path) m.spans_[open].end = int32_t(n);
  return m;
}

}  // namespace specmesh
