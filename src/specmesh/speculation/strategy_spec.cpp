// Standard speculative decoding: the draft proposes a chain, the target verifies it in one
// run (greedy matching at temperature 0, exact rejection sampling otherwise). With a tree shape
// (`tree`), or several drafts (roles draft, draft2, ...), the drafts propose token trees that
// merge into one, and the target verifies the whole tree in one run (SpecInfer).
#include <algorithm>

#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/speculation/tree_drafter.hpp"
#include "specmesh/speculation/verify.hpp"

namespace specmesh {

namespace {


// Draft k tokens (fewer when the draft's confidence drops below p_accept), verify them in one
// target batch: greedy matching, or exact stochastic verification at temperature > 0.
class Speculative final : public Strategy {
 public:
  explicit Speculative(StrategyHost& h) : h_(h), draft_sampler_(h.sampler().params()) {}

  void start() override { next_round(); }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == kDraftRole) {
      if (run == awaited_draft_) on_draft(run, l);
    } else if (run == awaited_target_) {
      on_verify(run, l);
    }
  }

  // A shift comes from the last accept() of a verification, when nothing is in flight.
  bool context_shifted(int n_keep, int n_discard) override {
    shift_cached(target_cached_, n_keep, n_discard);
    shift_cached(draft_cached_, n_keep, n_discard);
    return true;
  }

 private:
  // The drafts a verification may carry: n_draft, fewer near the end of the context (the
  // drafts go at positions tokens().size() onwards).
  int draft_room() const { return std::min(n_draft_, h_.n_ctx() - int(h_.tokens().size())); }

  void next_round() { draft_room() > 0 ? draft_next() : verify(); }

  void draft_next() {
    std::vector<int32_t> want = h_.tokens();
    want.insert(want.end(), drafts_.begin(), drafts_.end());
    awaited_draft_ = feed(h_, kDraftRole, draft_cached_, sync_cache(h_, kDraftRole, draft_cached_, want), 1);
  }

  void on_draft(uint64_t run, const Logits& l) {
    auto row = rows_of(l, 1, h_.vocab(), run);
    const float conf = top_probability(row.data(), h_.vocab());
    const bool confident = conf >= p_accept_;
    if (confident) {
      if (h_.sampler().greedy()) {
        drafts_.push_back(Sampler::argmax(row.data(), h_.vocab()));
      } else {
        q_.push_back(draft_sampler_.distribution(row.data(), h_.vocab()));
        drafts_.push_back(h_.sampler().sample_from(q_.back()));
      }
    }
    if (confident && int(drafts_.size()) < draft_room()) return draft_next();
    verify();
  }

  void verify() {
    // The last accepted token and the drafts, with logits for each of them.
    std::vector<int32_t> pending = sync_cache(h_, kTargetRole, target_cached_, h_.tokens());
    pending.insert(pending.end(), drafts_.begin(), drafts_.end());
    awaited_target_ = feed(h_, kTargetRole, target_cached_, pending, drafts_.size() + 1);
  }

  void on_verify(uint64_t run, const Logits& l) {
    const size_t k = drafts_.size();
    auto rows = rows_of(l, k + 1, h_.vocab(), run);
    Verdict v;
    if (h_.sampler().greedy()) {
      v = verify_greedy(drafts_, rows.data(), h_.vocab());
    } else {
      std::vector<std::vector<float>> p;
      for (size_t i = 0; i <= k; ++i) p.push_back(h_.sampler().distribution(rows.data() + i * h_.vocab(), h_.vocab()));
      v = verify_stochastic(drafts_, p, q_, h_.sampler());
    }
    SpecMetrics& m = h_.metrics();
    m.drafted += k;
    m.verified(v.accepted);
    std::vector<int32_t> proposal(drafts_.begin(), drafts_.begin() + v.accepted);
    drafts_.clear();
    q_.clear();
    for (int32_t t : proposal)
      if (!h_.accept(t)) return;
    if (!h_.accept(v.next)) return;
    next_round();
  }

  StrategyHost& h_;
  const int n_draft_ = h_.params().integer("n_draft");
  const float p_accept_ = h_.params().real("p_accept");
  Sampler draft_sampler_;  // the draft's distribution uses the same transforms as the target's
  std::vector<int32_t> target_cached_, draft_cached_, drafts_;
  std::vector<std::vector<float>> q_;
  uint64_t awaited_target_ = 0, awaited_draft_ = 0;
};

// The draft roles the setup has: draft, then draft2, draft3, ... while they exist.
std::vector<std::string> draft_roles(const StrategyHost& h) {
  std::vector<std::string> roles = {kDraftRole};
  while (h.has_role(draft_role(int(roles.size())))) roles.push_back(draft_role(int(roles.size())));
  return roles;
}

// Tree speculation: every draft grows a tree (the `tree` shape, or a chain of n_draft), the
// trees merge by common prefix, and one target run verifies them all with a tree mask.
//
// In the target's cache the tree's cells carry sequence 0 (so they see the committed context)
// and one branch sequence per leaf they lead to. After the verdict, sequence 0 leaves the tree,
// the accepted path's cells rejoin it by a range copy along one of its branches, and every
// branch sequence is dropped: the rejected nodes' cells are freed, the accepted ones stay where
// they are, at the positions (prefix + depth) they already have.
class TreeSpeculative final : public Strategy {
 public:
  explicit TreeSpeculative(StrategyHost& h) : h_(h) {
    std::vector<int> shape = h.params().list("tree");
    if (shape.empty()) shape.assign(size_t(h.params().integer("n_draft")), 1);
    const auto roles = draft_roles(h);
    for (size_t i = 0; i < roles.size(); ++i)
      drafters_.emplace_back(h, roles[i], int(i), shape, h.params().integer("tree_nodes"), h.params().real("p_accept"));
  }

  void start() override { draft(); }

  // A shift comes from the last accept() of a verification (the tree is never deeper than the
  // context has room for), after every cache dropped the tree's branches.
  bool context_shifted(int n_keep, int n_discard) override {
    shift_cached(target_cached_, n_keep, n_discard);
    for (TreeDrafter& d : drafters_) d.context_shifted(n_keep, n_discard);
    return true;
  }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == kTargetRole) {
      if (run == awaited_) on_verify(run, l);
      return;
    }
    for (TreeDrafter& d : drafters_)
      if (d.on_logits(run, l)) break;
    if (drafting_ && std::all_of(drafters_.begin(), drafters_.end(), [](const TreeDrafter& d) { return d.done(); }))
      verify();
  }

 private:
  // The tree hangs below the newest accepted token, its node at depth d at position
  // tokens().size() + d: it may be as deep as the context has room for.
  void draft() {
    drafting_ = true;
    const size_t room = size_t(std::max(0, h_.n_ctx() - int(h_.tokens().size())));
    for (TreeDrafter& d : drafters_) d.start(room);
  }

  void verify() {
    drafting_ = false;
    tree_ = drafters_[0].tree();
    for (size_t i = 1; i < drafters_.size(); ++i) tree_.merge(drafters_[i].tree());
    layout_ = tree_.layout();
    const size_t n = layout_.order.size();

    // The target's pending tokens (at least the newest accepted one) lead the batch as a chain;
    // the tree hangs below its last one.
    std::vector<int32_t> pending = sync_cache(h_, kTargetRole, target_cached_, h_.tokens());
    const int32_t p0 = int32_t(target_cached_.size());
    tree_pos_ = p0 + int32_t(pending.size());
    const size_t lead = pending.size();
    Batch b;
    for (size_t i = 0; i < lead; ++i) {
      b.add(pending[i], p0 + int32_t(i), seq_bit(0), i + 1 == lead);
      b.parent.push_back(int32_t(i) - 1);
    }
    // Branch sequences: one per leaf, and every node on the way to it.
    leaf_seq_.assign(n, 0);
    std::vector<SeqSet> seqs(n, seq_bit(0));
    int seq = 0;
    for (size_t k = n; k-- > 0;) {
      bool leaf = k + 1 == n || layout_.parents[k + 1] != int32_t(k);
      if (leaf) leaf_seq_[k] = ++seq;
    }
    for (size_t k = n; k-- > 0;) {
      seqs[k] |= leaf_seq_[k] ? seq_bit(leaf_seq_[k]) : 0;
      if (layout_.parents[k] >= 0) {
        seqs[size_t(layout_.parents[k])] |= seqs[k];
        if (!leaf_seq_[size_t(layout_.parents[k])]) leaf_seq_[size_t(layout_.parents[k])] = leaf_seq_[k];
      }
    }
    for (size_t k = 0; k < n; ++k) {
      b.add(layout_.tokens[k], tree_pos_ + layout_.depths[k], seqs[k], true);
      b.parent.push_back(layout_.parents[k] < 0 ? int32_t(lead) - 1 : int32_t(lead) + layout_.parents[k]);
    }
    target_cached_.insert(target_cached_.end(), pending.begin(), pending.end());
    awaited_ = h_.launch(kTargetRole, b, false);
  }

  void on_verify(uint64_t run, const Logits& l) {
    const size_t n = layout_.order.size();
    const auto rows = rows_of(l, n + 1, h_.vocab(), run);
    TreeVerdict v;
    if (h_.sampler().greedy()) {
      v = verify_tree_greedy(layout_.tokens, layout_.parents, rows.data(), h_.vocab());
    } else {
      const int V = h_.vocab();
      auto target = [&](size_t row, std::vector<float>& out) { out = h_.sampler().distribution(rows.data() + row * V, V); };
      v = verify_tree_proposals(tree_, layout_, target, h_.sampler());
    }
    std::vector<int32_t> accepted;
    for (int k : v.path) accepted.push_back(layout_.tokens[size_t(k)]);

    // Keep the accepted path's cells, free the rest of the tree (see the class comment).
    std::vector<KvOp> ops = {{KvOpKind::remove, 0, -1, tree_pos_, -1}};
    if (!v.path.empty())
      ops.push_back({KvOpKind::copy, leaf_seq_[size_t(v.path.back())], 0, tree_pos_, tree_pos_ + int32_t(v.path.size())});
    ops.push_back({KvOpKind::keep, 0, -1, -1, -1});  // every branch sequence goes, in one sweep
    h_.kv_ops(kTargetRole, std::move(ops));
    target_cached_.insert(target_cached_.end(), accepted.begin(), accepted.end());
    for (TreeDrafter& d : drafters_) d.commit(accepted);

    SpecMetrics& m = h_.metrics();
    m.drafted += n;
    m.verified(int64_t(accepted.size()));
    for (int32_t t : accepted)
      if (!h_.accept(t)) return;
    if (!h_.accept(v.next)) return;
    draft();
  }

  StrategyHost& h_;
  std::vector<TreeDrafter> drafters_;
  bool drafting_ = false;
  TokenTree tree_;
  TokenTree::Layout layout_;
  std::vector<int> leaf_seq_;  // per layout node: a branch sequence through it
  int32_t tree_pos_ = 0;
  std::vector<int32_t> target_cached_;
  uint64_t awaited_ = 0;
};

}  // namespace

StrategyInfo strategy_info_spec() {
  StrategyInfo s;
  s.name = "spec";
  s.summary = "the draft proposes up to `n_draft` tokens (stopping early when its confidence falls below `p_accept`), "
              "the target verifies them in one batch: greedy matching at temperature 0, exact rejection sampling "
              "otherwise (accept with min(1, p/q), resample from max(0, p - q)); with `tree` (children per depth) or "
              "further drafts (roles `draft2`, ...) the drafts grow token trees, merged by common prefix, that the "
              "target verifies in one run with a DFS-interval mask (SpecInfer; exact multi-draft sampling, children "
              "drawn without replacement)";
  s.roles = {kTargetRole, kDraftRole};
  s.default_for_roles = true;
  s.params = {
      {"n_draft", ParamType::Int, 1, 64, 4, "draft tokens per verification", {"--draft-n", "--n-draft"}},
      {"p_accept", ParamType::Float, 0, 1, 0.5, "draft confidence cutoff: drafting stops below it", {"--p-accept", "--pa"}},
      {"tree", ParamType::IntList, 1, 16, 0, "token tree: children per depth (1,1,3,1); verified in one target run", {"--tree"}, {}, 16},
      {"tree_nodes", ParamType::Int, 1, 512, 64, "most nodes of one draft's tree", {"--tree-nodes"}},
  };
  s.check = [](const StrategyParams& p, const SetupFacts& setup) {
    const std::vector<int>& tree = p.list("tree");
    if (tree.empty()) return;
    size_t drafts = 1;
    while (setup.roles.count(draft_role(int(drafts)))) ++drafts;
    const size_t nodes = expansion_size(tree), budget = size_t(p.integer("tree_nodes"));
    size_t leaves = 1;
    for (int w : tree) leaves = std::min<size_t>(leaves * size_t(w), 1 << 20);
    const std::string shape = format_int_list(tree);
    if (nodes > budget)
      throw ParamConflict("tree", "the tree " + shape + " has " + std::to_string(nodes) + " nodes, more than tree_nodes (" +
                                      std::to_string(budget) + ")");
    if (leaves * drafts > size_t(kMaxSeqs - 1))
      throw ParamConflict("tree", "the tree " + shape + " has " + std::to_string(leaves) + " leaves" +
                                      (drafts > 1 ? " per draft, " + std::to_string(drafts) + " drafts," : ",") +
                                      " more than the " + std::to_string(kMaxSeqs - 1) + " branches a KV cache can tell apart");
    if (setup.n_ctx > 0 && nodes * drafts + 2 > size_t(setup.n_ctx))
      throw ParamConflict("tree", "the tree " + shape + " (" + std::to_string(nodes * drafts) + " nodes) does not fit a context of " +
                                      std::to_string(setup.n_ctx) + " tokens");
  };
  // A chain uses the canonical sequence alone; a tree (or several drafts' merged chains) one
  // branch sequence per leaf besides it, on the target and in each draft's drafter.
  s.sequences = [](const StrategyParams& p, const std::set<std::string>& roles) {
    size_t drafts = 1;
    while (roles.count(draft_role(int(drafts)))) ++drafts;
    const std::vector<int>& tree = p.list("tree");
    if (tree.empty() && drafts == 1) return 1;
    size_t leaves = 1;
    for (int w : tree) leaves = std::min<size_t>(leaves * size_t(w), size_t(kMaxSeqs));
    return int(std::min<size_t>(1 + leaves * drafts, size_t(kMaxSeqs)));
  };
  // A verification holds the tree's nodes at positions up to its depth past the newest token,
  // which the context has room for; the drafters' trees merged in it are at most all their
  // nodes, and adding a node to a tree never lowers (nodes - depth), so the full trees are the
  // worst case. Each drafter's own cache holds one tree: no more. A single chain: none.
  s.spare_cells = [](const StrategyParams& p, const std::set<std::string>& roles) {
    int drafts = 1;
    while (roles.count(draft_role(drafts))) ++drafts;
    const std::vector<int>& tree = p.list("tree");
    const int depth = tree.empty() ? p.integer("n_draft") : int(tree.size());
    const int nodes = tree.empty() ? depth : int(std::min<size_t>(expansion_size(tree), size_t(p.integer("tree_nodes"))));
    return drafts * nodes - depth;
  };
  s.make = [](StrategyHost& h) -> std::unique_ptr<Strategy> {
    if (!h.params().list("tree").empty() || h.has_role("draft2")) return std::make_unique<TreeSpeculative>(h);
    return std::make_unique<Speculative>(h);
  };
  return s;
}

}  // namespace specmesh
