// Drafts a token tree on one draft pipeline by expansion, a level per run: the roots are the
// draft's top widths[0] tokens after the accepted text, and every node at depth d that the draft
// is confident about (its top probability at least p_accept) gets widths[d + 1] children: the
// top ones at temperature 0, drawn without replacement otherwise. A chain is the widths
// 1,1,...,1.
//
// In the draft's KV cache every branch lives in a sequence of its own (1..63; sequence 0 holds
// the accepted tokens): a node's first child continues its parent's sequence, the others get
// new sequences that borrow the parent's history by a metadata copy, so one causal run per level
// carries the whole frontier and each node sees exactly its ancestors. After verification the
// accepted path's cells join sequence 0 by a range copy and every branch sequence is dropped:
// range operations, no recomputation and no data copies.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/strategy.hpp"
#include "specmesh/speculation/token_tree.hpp"

namespace specmesh {

class TreeDrafter {
 public:
  TreeDrafter(StrategyHost& host, std::string role, int draft_id, std::vector<int> widths, int max_nodes,
              float p_accept);

  // Starts a tree after the host's accepted tokens, at most max_depth levels deep (fewer than
  // the shape near the end of the context).
  void start(size_t max_depth);
  // Feeds a draft run's logits; true when they were this drafter's (the tree may then be done).
  bool on_logits(uint64_t run, const Logits& l);
  bool done() const { return awaited_ == 0; }
  const TokenTree& tree() const { return tree_; }
  const std::string& role() const { return role_; }

  // After verification: `accepted` are the tokens that followed the context. The cells of the
  // accepted nodes this drafter fed join sequence 0; every branch sequence is released.
  void commit(const std::vector<int32_t>& accepted);
  // Follows a context shift (Strategy::context_shifted) in the draft's sequence 0; between
  // trees (after commit), when the draft's cache holds no branch.
  void context_shifted(int n_keep, int n_discard) { shift_cached(cached_, n_keep, n_discard); }

 private:
  void expand(const std::vector<int32_t>& nodes, const std::vector<float>& rows);
  int new_seq();
  // Whether a node's cell is in the draft's cache: every node that has a level below it was
  // fed to draft that level.
  bool fed(int32_t node) const { return size_t(tree_.node(size_t(node)).depth) + 1 < depth_; }

  StrategyHost& h_;
  std::string role_;
  int draft_id_;
  std::vector<int> widths_;
  size_t depth_ = 0;                 // levels of the tree being grown (at most widths_.size())
  size_t max_nodes_;
  float p_accept_;
  std::vector<int32_t> cached_;      // sequence 0 of the draft's cache
  TokenTree tree_;
  std::vector<int> seq_of_;          // per node: its branch sequence in the draft's cache
  std::vector<int32_t> ids_;         // scratch: token ids ranked by logit
  std::vector<int32_t> frontier_;    // nodes of the run in flight (empty: the context row)
  int32_t base_ = 0;                 // position of the roots
  int next_seq_ = 1;
  uint64_t awaited_ = 0;
};

}  // namespace specmesh
