// Verification of drafted tokens against the target model: the pure decision rules of
// speculative decoding, free of models and actors so they can be tested for exactness.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "specmesh/model/sampler.hpp"
#include "specmesh/speculation/token_tree.hpp"

namespace specmesh {

// What one verification yields: the first `accepted` draft tokens stand, then the target
// contributes `next` (the correction after a rejection, the bonus token when all were accepted).
struct Verdict {
  int accepted = 0;
  int32_t next = -1;
};

// Greedy target. target_logits holds draft.size()+1 rows of n_vocab: row i is the target's
// logits after the context plus draft[0..i). Accepts while draft[i] is the row's argmax
// (lowest id on ties, as Sampler::argmax); next is the argmax of the first mismatching row,
// or of the last row when every draft token matched.
Verdict verify_greedy(std::span<const int32_t> draft, const float* target_logits, int n_vocab);

// Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023). p holds k+1 target
// distributions (p[i] after the context plus draft[0..i)), q the k draft distributions the
// draft tokens were drawn from (draft[i] ~ q[i]). draft[i] is accepted with probability
// min(1, p_i(x)/q_i(x)); on the first rejection next ~ normalise(max(0, p_i - q_i)) (p_i itself
// when that residual is zero); after k acceptances next ~ p_k. The emitted tokens are then
// distributed exactly as sampling from the target alone. Distributions need not be normalised
// (each is divided by its sum). rng supplies one uniform() per examined draft token, then one
// sample_from() for next. Throws std::invalid_argument on mismatched sizes, a draft token
// outside the vocabulary or with zero draft probability, or a negative / non-finite / all-zero
// distribution.
Verdict verify_stochastic(std::span<const int32_t> draft, std::span<const std::vector<float>> p,
                          std::span<const std::vector<float>> q, Sampler& rng);

// A drafted token tree: node i holds tokens[i] and follows parents[i] (-1: directly after the
// context). Nodes are in topological order (parents[i] < i); siblings are tried in index order.
// A chain of k tokens is parents = {-1, 0, 1, ..., k-2}.
struct TreeVerdict {
  std::vector<int> path;  // accepted nodes, from the context outward
  int32_t next = -1;      // the target's token after the accepted path
  int accepted() const { return int(path.size()); }
};

// Greedy target over a tree. target_logits holds n+1 rows of n_vocab: row 0 after the context,
// row i+1 after the context plus the path to node i. From the context, descend into the first
// child whose token is the row's argmax; stop when none is, and take that argmax as next.
TreeVerdict verify_tree_greedy(std::span<const int32_t> tokens, std::span<const int> parents,
                               const float* target_logits, int n_vocab);

// Multi-draft speculative sampling over a tree (SpecInfer, Miao et al. 2024). p holds n+1
// target distributions indexed as the rows above; q[i] is the draft distribution node i's
// token was drawn from. At each node the children are tried in order against a residual that
// starts as the node's target distribution: child x is accepted with probability
// min(1, r(x)/q_child(x)), otherwise r <- normalise(max(0, r - q_child)) and the next child is
// tried; when all are rejected (or the node is a leaf) next ~ r. Exact (the emitted tokens are
// distributed as the target's) when each child's token is an independent draw from its q given
// its parent path; sampling siblings with replacement and deterministic drafts (one-hot q)
// both qualify, sampling siblings without replacement does not. A chain gives the same verdict
// as verify_stochastic with the same rng. Throws std::invalid_argument as verify_stochastic,
// and on a parent index that is not an earlier node.
TreeVerdict verify_tree_stochastic(std::span<const int32_t> tokens, std::span<const int> parents,
                                   std::span<const std::vector<float>> p,
                                   std::span<const std::vector<float>> q, Sampler& rng);

// Multi-draft speculative sampling over a TokenTree in its layout (SpecInfer's MSS, with
// Sequoia's correction for siblings drawn without replacement, and merged proposals). At a node
// the residual r starts as the target's p; the proposals of its children are tried draft by
// draft, each draft's in its draw order (token x drawn from q), and one is accepted with probability min(1, r(x)/q(x)); on rejection r <- norm(max(0, r - q))
// and, when the proposal's group drew without replacement, q <- norm(q with q(x) = 0) for the
// group's later proposals at that node. When all are rejected next ~ r. The emitted tokens are
// then distributed exactly as the target's. p: n+1 target distributions, p[0] after the
// context and p[k+1] after layout node k; the verdict's path holds layout indices. (Greedy
// trees verify with verify_tree_greedy over layout.tokens and layout.parents.)
// `target(row, out)` writes the target distribution of a row into out; the walk asks only for
// the rows it reaches (the accepted path's), not for every node's.
using TargetRow = std::function<void(size_t row, std::vector<float>& out)>;
TreeVerdict verify_tree_proposals(const TokenTree& tree, const TokenTree::Layout& layout, const TargetRow& target,
                                  Sampler& rng);
// The same with every row's distribution given.
TreeVerdict verify_tree_proposals(const TokenTree& tree, const TokenTree::Layout& layout,
                                  std::span<const std::vector<float>> p, Sampler& rng);

}  // namespace specmesh
