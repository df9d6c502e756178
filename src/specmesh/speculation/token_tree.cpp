#include "specmesh/speculation/token_tree.hpp"

#include <algorithm>
#include <functional>

namespace specmesh {

int32_t TokenTree::add(int32_t parent, int32_t token, Proposal proposal) {
  std::vector<int32_t>& siblings = parent < 0 ? roots_ : nodes_[size_t(parent)].children;
  for (int32_t s : siblings)
    if (nodes_[size_t(s)].token == token) {
      nodes_[size_t(s)].proposals.push_back(std::move(proposal));
      return s;
    }
  const int32_t id = int32_t(nodes_.size());
  TreeNode n;
  n.token = token;
  n.parent = parent;
  n.depth = parent < 0 ? 0 : nodes_[size_t(parent)].depth + 1;
  n.proposals.push_back(std::move(proposal));
  nodes_.push_back(std::move(n));
  // `siblings` may dangle after push_back: look the list up again.
  (parent < 0 ? roots_ : nodes_[size_t(parent)].children).push_back(id);
  return id;
}

void TokenTree::merge(const TokenTree& other) {
  std::function<void(int32_t, int32_t)> graft = [&](int32_t from, int32_t onto) {
    const TreeNode& src = other.nodes_[size_t(from)];
    int32_t here = -1;
    for (const Proposal& p : src.proposals) here = add(onto, src.token, p);
    for (int32_t c : src.children) graft(c, here);
  };
  for (int32_t r : other.roots_) graft(r, -1);
}

int32_t TokenTree::depth() const {
  int32_t d = 0;
  for (const TreeNode& n : nodes_) d = std::max(d, n.depth + 1);
  return d;
}

TokenTree::Layout TokenTree::layout() const {
  Layout l;
  std::vector<int32_t> at(nodes_.size(), -1);
  // Iterative pre-order walk (trees can be deep chains); children in their stored order.
  std::vector<int32_t> stack(roots_.rbegin(), roots_.rend());
  while (!stack.empty()) {
    const int32_t i = stack.back();
    stack.pop_back();
    const TreeNode& n = nodes_[size_t(i)];
    at[size_t(i)] = int32_t(l.order.size());
    l.order.push_back(i);
    l.tokens.push_back(n.token);
    l.parents.push_back(n.parent < 0 ? -1 : at[size_t(n.parent)]);
    l.depths.push_back(n.depth);
    stack.insert(stack.end(), n.children.rbegin(), n.children.rend());
  }
  return l;
}

std::vector<std::vector<int32_t>> TokenTree::branches() const {
  std::vector<std::vector<int32_t>> out;
  for (int32_t i : layout().order) {
    if (!nodes_[size_t(i)].children.empty()) continue;
    std::vector<int32_t> path;
    for (int32_t a = i; a >= 0; a = nodes_[size_t(a)].parent) path.push_back(a);
    std::reverse(path.begin(), path.end());
    out.push_back(std::move(path));
  }
  return out;
}

size_t expansion_size(std::span<const int> widths) {
  // Saturates: a shape too large to count is too large to draft.
  constexpr size_t kCap = size_t(1) << 40;
  size_t total = 0, level = 1;
  for (int w : widths) {
    level = std::min(kCap, level * size_t(std::clamp(w, 0, 1 << 16)));
    total = std::min(kCap, total + level);
  }
  return total;
}

}  // namespace specmesh
