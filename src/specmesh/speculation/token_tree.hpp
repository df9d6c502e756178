// A drafted token tree (SpecInfer): nodes after the committed context, each a token proposed by
// one or more drafts. Drafts grow it in any order (expansion adds a level at a time); layout()
// puts it in DFS pre-order, the order the target verifies it in one run with an interval mask.
//
// Merging: when two drafts propose the same token after the same path the tree keeps one node
// holding both proposals (draft id, the distribution it was drawn from, its draw group, its
// place among the draft's draws), and their subtrees merge the same way. Verification tries the
// proposals at a node draft by draft, each draft's in the order it drew them — never in an order
// that depends on which tokens happened to coincide, which would bias it — so a merged token is
// accepted with the probability two separate siblings would give it, and an accepted node
// continues with the children of both drafts.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "specmesh/model/sampler.hpp"

namespace specmesh {

struct Proposal {
  int draft = 0;  // which draft proposed the token
  // Siblings drawn together without replacement share a group (the draft's distribution at
  // their parent); after one is rejected the later ones of its group are tested against that
  // distribution with the rejected tokens taken out. -1: an independent draw.
  int group = -1;
  std::shared_ptr<const std::vector<float>> q;  // the draft distribution it was drawn from (stochastic only)
  int rank = 0;  // its place in the draft's draws at the same parent
};

struct TreeNode {
  int32_t token = 0;
  int32_t parent = -1;  // -1: follows the committed context
  int32_t depth = 0;    // 0 for the roots
  std::vector<Proposal> proposals;
  std::vector<int32_t> children;  // in the order verification tries them
};

class TokenTree {
 public:
  // Adds `token` under `parent` (-1: the context) for a draft, merging with an existing child
  // of the same token; returns the node's index.
  int32_t add(int32_t parent, int32_t token, Proposal proposal);
  // Merges another tree (a second draft's) into this one by common prefix.
  void merge(const TokenTree& other);

  size_t size() const { return nodes_.size(); }
  bool empty() const { return nodes_.empty(); }
  const TreeNode& node(size_t i) const { return nodes_[i]; }
  const std::vector<int32_t>& roots() const { return roots_; }
  int32_t depth() const;  // longest path, in nodes

  // The tree in DFS pre-order: order[k] is the node stored at k; parent links remapped.
  struct Layout {
    std::vector<int32_t> order;
    std::vector<int32_t> tokens;
    std::vector<int32_t> parents;  // into the layout, -1 for roots
    std::vector<int32_t> depths;
  };
  Layout layout() const;

  // Root-to-leaf paths, one per leaf, as node indices; leaves in DFS order.
  std::vector<std::vector<int32_t>> branches() const;

 private:
  std::vector<TreeNode> nodes_;
  std::vector<int32_t> roots_;
};

// A tree's shape for expansion drafting: children per depth ("1,1,3,1"): the roots are the
// draft's top widths[0] tokens, each node at depth d gets widths[d + 1] children. The node count
// it implies, to check budgets before anything runs.
size_t expansion_size(std::span<const int> widths);

}  // namespace specmesh
