#include "specmesh/speculation/tree_drafter.hpp"

#include <algorithm>
#include <memory>
#include <numeric>

#include "specmesh/speculation/pipeline_ops.hpp"

namespace specmesh {

TreeDrafter::TreeDrafter(StrategyHost& host, std::string role, int draft_id, std::vector<int> widths, int max_nodes,
                         float p_accept)
    : h_(host),
      role_(std::move(role)),
      draft_id_(draft_id),
      widths_(std::move(widths)),
      max_nodes_(size_t(std::max(1, max_nodes))),
      p_accept_(p_accept) {}

void TreeDrafter::start(size_t max_depth) {
  depth_ = std::min(widths_.size(), max_depth);
  tree_ = TokenTree{};
  seq_of_.clear();
  frontier_.clear();
  next_seq_ = 1;
  awaited_ = feed(h_, role_, cached_, sync_cache(h_, role_, cached_, h_.tokens()), 1);
  base_ = int32_t(cached_.size());
}

bool TreeDrafter::on_logits(uint64_t run, const Logits& l) {
  if (l.pipeline != role_ || run != awaited_) return false;
  const size_t n_rows = frontier_.empty() ? 1 : frontier_.size();
  const std::vector<float> rows = rows_of(l, n_rows, h_.vocab(), run);
  expand(frontier_.empty() ? std::vector<int32_t>{-1} : frontier_, rows);
  return true;
}

int TreeDrafter::new_seq() { return next_seq_ < h_.sequences() ? next_seq_++ : -1; }

void TreeDrafter::expand(const std::vector<int32_t>& parents, const std::vector<float>& rows) {
  const int V = h_.vocab();
  std::vector<KvOp> ops;
  std::vector<int32_t> next;
  for (size_t k = 0; k < parents.size(); ++k) {
    const int32_t u = parents[k];
    const float* row = rows.data() + k * size_t(V);
    const size_t depth = u < 0 ? 0 : size_t(tree_.node(size_t(u)).depth) + 1;
    if (depth >= depth_ || top_probability(row, V) < p_accept_) continue;
    const size_t room = max_nodes_ > tree_.size() ? max_nodes_ - tree_.size() : 0;
    const size_t want = std::min(size_t(widths_[depth]), room);

    // The children: the top tokens, or draws without replacement from the draft's distribution.
    std::vector<int32_t> picks;
    std::shared_ptr<const std::vector<float>> q;
    if (h_.sampler().greedy() && want == 1) {
      picks.push_back(Sampler::argmax(row, V));
    } else if (h_.sampler().greedy()) {
      ids_.resize(size_t(V));
      std::iota(ids_.begin(), ids_.end(), 0);
      const size_t n = std::min(want, ids_.size());
      std::partial_sort(ids_.begin(), ids_.begin() + n, ids_.end(),
                        [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      picks.assign(ids_.begin(), ids_.begin() + n);
    } else {
      q = std::make_shared<const std::vector<float>>(h_.sampler().distribution(row, V));
      std::vector<float> left = *q;
      // Each draw zeroes one token with mass; none left ends the draws.
      size_t with_mass = size_t(std::count_if(left.begin(), left.end(), [](float v) { return v > 0; }));
      for (size_t j = 0; j < want && with_mass > 0; ++j, --with_mass) {
        const int32_t x = h_.sampler().sample_from(left);
        picks.push_back(x);
        left[size_t(x)] = 0.0f;
      }
    }

    const int32_t pos = base_ + int32_t(depth);
    for (size_t j = 0; j < picks.size(); ++j) {
      // The first child continues its parent's branch; the others (and every root) open one.
      int seq = (u >= 0 && j == 0) ? seq_of_[size_t(u)] : new_seq();
      if (seq < 0) break;  // every branch sequence is in use
      if (u < 0) ops.push_back({KvOpKind::copy, 0, seq, 0, base_});
      else if (j > 0) ops.push_back({KvOpKind::copy, seq_of_[size_t(u)], seq, 0, pos});
      const int32_t id = tree_.add(u, picks[j], {draft_id_, q ? draft_id_ : -1, q, int(j)});
      seq_of_.resize(tree_.size(), 0);
      seq_of_[size_t(id)] = seq;
      if (depth + 1 < depth_) next.push_back(id);
    }
  }
  if (!ops.empty()) h_.kv_ops(role_, std::move(ops));
  frontier_ = std::move(next);
  if (frontier_.empty()) {
    awaited_ = 0;
    return;
  }
  Batch b;
  for (int32_t c : frontier_)
    b.add(tree_.node(size_t(c)).token, base_ + tree_.node(size_t(c)).depth, seq_bit(seq_of_[size_t(c)]), true);
  awaited_ = h_.launch(role_, b, false);
}

void TreeDrafter::commit(const std::vector<int32_t>& accepted) {
  int32_t at = -1;
  size_t m = 0;
  for (int32_t t : accepted) {
    const auto& kids = at < 0 ? tree_.roots() : tree_.node(size_t(at)).children;
    auto it = std::find_if(kids.begin(), kids.end(), [&](int32_t c) { return tree_.node(size_t(c)).token == t && fed(c); });
    if (it == kids.end()) break;
    at = *it;
    ++m;
  }
  std::vector<KvOp> ops;
  if (m > 0) ops.push_back({KvOpKind::copy, seq_of_[size_t(at)], 0, base_, base_ + int32_t(m)});
  if (next_seq_ > 1) ops.push_back({KvOpKind::keep, 0, -1, -1, -1});  // every branch sequence goes, in one sweep
  if (!ops.empty()) h_.kv_ops(role_, std::move(ops));
  cached_.insert(cached_.end(), accepted.begin(), accepted.begin() + int32_t(m));
  tree_ = TokenTree{};
  next_seq_ = 1;
}

}  // namespace specmesh
