// TriForce (Sun et al. 2024): hierarchical speculation over three views of one sequence.
//
//   small draft (role "draft", its own device)   StreamingLLM cache: `sink` tokens + a recent
//                                                 `window`, at positions re-indexed in the cache
//   middle level (the target's weights)           the target's cache through a partial view:
//                                                 the retrieval cache (KV sequence 1)
//   top level (the target's weights)              the full cache (KV sequence 0)
//
// Algorithm 1: the draft proposes gamma1 tokens, the middle level verifies them in one run
// (exact speculative sampling: it accepts while U < p_mid/q, then draws the correction from
// norm(max(0, p_mid - q)), or a bonus token from p_mid when all stood) and keeps going while
// it holds fewer than gamma2 tokens. It then hands its gamma2..gamma2+gamma1 tokens with their
// middle-level distributions to the top level, which verifies them against the full cache in
// one run with the same rule. Both levels use the exact residual (the public code draws the
// middle level's correction from p_mid, which is not exact), and a zero residual falls back to
// the level's own distribution (verify.hpp), so the output is distributed exactly as the
// target's; at temperature 0 both levels match greedily and the output is plain decoding's.
//
// Middle and top share the target's pipeline and stages (they may span processes): middle
// runs go to sequence 1, whose KV view the stages hold (protocol.hpp's view kinds), top runs to
// sequence 0, which has none. A round starts with sequence 1 = sequence 0's cells (a range
// copy: metadata, no data moves); the middle level's own rows are scratch and are dropped when
// the round ends. Generated tokens' entries come from the top level's run: they are sequence 0
// cells, which the retrieval view reads as "fresh" positions, each overwriting the least
// important entry (kv_view.hpp's RetrievalView). The retrieval cache is built on the stages
// (retrieval_cache.hpp) right after a run of the full cache whose last token is the newest
// one: the prompt's prefill, and every rebuild. A rebuild runs that newest token alone through
// the full cache and samples the next token from its logits (an exact plain step), then
// rebuilds from its query: every `rebuild_every` generated tokens, when the top level's
// rolling acceptance falls below `rebuild_below`, and whenever the next round could overwrite
// the sink (chunk 0).
//
// The draft's StreamingLLM cache is the one copy: its keys are stored post-RoPE at in-cache
// positions, so when the window is full its newer half is recomputed at the positions after
// the sink (one batched run of the smallest model every window/2 tokens). Nothing else is.
//
// Ablations (the paper's Table 2): `middle` = 0 lets the draft propose gamma2 tokens straight
// to the full cache (the tiny draft with StreamingLLM alone), `middle` = 2 gives the middle
// level a StreamingLLM view of the same budget instead of the retrieval cache, and
// `use_draft` = false lets the middle level propose by itself (retrieval without hierarchy).
#include <algorithm>
#include <deque>

#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/speculation/verify.hpp"

namespace specmesh {

namespace {

enum MiddleCache { kNoMiddle = 0, kRetrieval = 1, kStreaming = 2 };
constexpr int kMiddleSeq = 1;
// Top-level verifications the rolling acceptance averages over.
constexpr size_t kRollingWindow = 8;

class TriForce final : public Strategy {
 public:
  explicit TriForce(StrategyHost& h) : h_(h), draft_sampler_(h.sampler().params()) {}

  void start() override {
    // The draft prefills its StreamingLLM cache while the target prefills the full one; its
    // logits are not awaited.
    if (use_draft_) {
      const std::vector<int32_t> want = streamed(h_.tokens());
      if (want.size() > 1) feed(h_, kDraftRole, draft_cached_, sync_cache(h_, kDraftRole, draft_cached_, want), 1);
    }
    if (middle_ == kStreaming) h_.kv_ops(kTargetRole, {window_view_op(kMiddleSeq, chunk_, budget_ - chunk_)});
    full_step();
  }

  void on_logits(uint64_t run, const Logits& l) override {
    if (run == 0) return;
    if (run == awaited_draft_) return on_draft(run, l);
    if (run == awaited_full_step_) return on_full_step(run, l);
    if (run == awaited_middle_) return on_middle(run, l);
    if (run == awaited_top_) return on_top(run, l);
  }

  void abandon() override {
    for (uint64_t* r : {&awaited_full_step_, &awaited_middle_, &awaited_top_})
      if (*r) h_.cancel(kTargetRole, {std::exchange(*r, 0)});
    if (awaited_draft_) h_.cancel(kDraftRole, {std::exchange(awaited_draft_, 0)});
  }

 private:
  // --- the full cache alone: prefill and rebuilds --------------------------------------------

  // Runs the tokens the full cache lacks (the newest at least) and samples the next token
  // from the last row; the retrieval cache is then (re)built from that row's query.
  void full_step() {
    awaited_full_step_ = feed(h_, kTargetRole, full_cached_, sync_cache(h_, kTargetRole, full_cached_, h_.tokens()), 1);
  }

  void on_full_step(uint64_t run, const Logits& l) {
    awaited_full_step_ = 0;
    const auto row = rows_of(l, 1, h_.vocab(), run);
    if (middle_ == kRetrieval) {
      fresh_from_ = int32_t(full_cached_.size());
      h_.kv_ops(kTargetRole, {retrieval_view_op(kMiddleSeq, fresh_from_, chunk_, budget_)});
      if (built_) ++h_.metrics().cache_rebuilds;
      built_ = true;
      rolling_.clear();
    }
    if (!h_.accept(h_.sampler().sample(row.data(), h_.vocab()))) return;
    round();
  }

  // --- one round of Algorithm 1 ---------------------------------------------------------

  void round() {
    if (rebuild_due()) return full_step();
    mid_.clear();
    mid_q_.clear();
    if (middle_ != kNoMiddle) {
      // Sequence 1 starts as sequence 0 (which holds every accepted token but the newest).
      h_.kv_ops(kTargetRole, {{KvOpKind::remove, kMiddleSeq, -1, -1, -1}, {KvOpKind::copy, 0, kMiddleSeq, -1, -1}});
      mid_cached_ = full_cached_;
    }
    propose();
  }

  // The next step of the lower level, or the top level's verification once the middle level
  // holds gamma2 tokens.
  void propose() {
    if (int(mid_.size()) >= gamma2_) return verify_top();
    drafts_.clear();
    draft_q_.clear();
    if (use_draft_) return draft_next();
    middle_run({});
  }

  bool rebuild_due() const {
    if (middle_ != kRetrieval) return false;
    const int32_t n = int32_t(h_.tokens().size());
    // The highest position a round's middle level queries is about n + gamma2 + gamma1; its
    // fresh entries must leave chunk 0 (the sink) alone.
    if (n + gamma1_ + gamma2_ + 1 - fresh_from_ > budget_ - chunk_) return true;
    if (rebuild_every_ > 0 && n - fresh_from_ >= rebuild_every_) return true;
    if (rolling_.size() < kRollingWindow) return false;
    int64_t acc = 0, drafted = 0;
    for (auto [a, d] : rolling_) acc += a, drafted += d;
    return drafted > 0 && double(acc) < rebuild_below_ * double(drafted);
  }

  // --- the small draft ---------------------------------------------------------------------

  // What the draft's cache should hold for `all`: the first `sink` tokens and the tokens from
  // the anchor on, at positions 0, 1, ... When the tail outgrows the window the anchor moves
  // so that half a window remains (those tokens are recomputed at their new positions).
  std::vector<int32_t> streamed(const std::vector<int32_t>& all) {
    const size_t n = all.size(), sink = size_t(sink_), window = size_t(window_);
    if (n <= sink + window && anchor_ <= sink) return all;
    anchor_ = std::max(anchor_, sink);
    if (n - std::min(n, anchor_) > window) anchor_ = n - std::max<size_t>(1, window / 2);
    anchor_ = std::min(anchor_, n - 1);  // a rejection may have cut the sequence below it
    std::vector<int32_t> out(all.begin(), all.begin() + ptrdiff_t(std::min(sink, anchor_)));
    out.insert(out.end(), all.begin() + ptrdiff_t(anchor_), all.end());
    return out;
  }

  void draft_next() {
    std::vector<int32_t> all = h_.tokens();
    all.insert(all.end(), mid_.begin(), mid_.end());
    all.insert(all.end(), drafts_.begin(), drafts_.end());
    awaited_draft_ = feed(h_, kDraftRole, draft_cached_, sync_cache(h_, kDraftRole, draft_cached_, streamed(all)), 1);
  }

  void on_draft(uint64_t run, const Logits& l) {
    awaited_draft_ = 0;
    const auto row = rows_of(l, 1, h_.vocab(), run);
    int32_t token;
    if (h_.sampler().greedy()) {
      token = Sampler::argmax(row.data(), h_.vocab());
      draft_q_.emplace_back();
    } else {
      draft_q_.push_back(draft_sampler_.distribution(row.data(), h_.vocab()));
      token = h_.sampler().sample_from(draft_q_.back());
    }
    drafts_.push_back(token);
    if (middle_ == kNoMiddle) {
      // The draft proposes straight to the full cache.
      mid_.push_back(token);
      mid_q_.push_back(std::move(draft_q_.back()));
      return propose();
    }
    if (int(drafts_.size()) < gamma1_) return draft_next();
    middle_run(drafts_);
  }

  // --- the middle level --------------------------------------------------------------------

  // One run of sequence 1 through the partial view: the tokens it lacks (the newest at least)
  // and the drafts, with logits for the last of the former and every draft.
  void middle_run(const std::vector<int32_t>& drafts) {
    std::vector<int32_t> want = h_.tokens();
    want.insert(want.end(), mid_.begin(), mid_.end());
    Batch b;
    for (size_t i = mid_cached_.size(); i < want.size(); ++i)
      b.add(want[i], int32_t(i), seq_bit(kMiddleSeq), i + 1 == want.size());
    for (size_t i = 0; i < drafts.size(); ++i)
      b.add(drafts[i], int32_t(want.size() + i), seq_bit(kMiddleSeq), true);
    mid_cached_ = want;
    middle_pos_ = int32_t(want.size());
    awaited_middle_ = h_.launch(kTargetRole, b, true);
  }

  void on_middle(uint64_t run, const Logits& l) {
    awaited_middle_ = 0;
    const size_t k = drafts_.size();
    const int V = h_.vocab();
    const auto rows = rows_of(l, k + 1, V, run);
    std::vector<std::vector<float>> p;
    Verdict v;
    if (h_.sampler().greedy()) {
      v = verify_greedy(drafts_, rows.data(), V);
    } else {
      for (size_t i = 0; i <= k; ++i) p.push_back(h_.sampler().distribution(rows.data() + i * V, V));
      v = verify_stochastic(drafts_, p, draft_q_, h_.sampler());
    }
    if (k > 0) {
      SpecMetrics& m = h_.metrics();
      m.middle_drafted += int64_t(k);
      m.middle_accepted += v.accepted;
      ++m.middle_verifications;
    }
    // The accepted drafts' rows stay in sequence 1 for the middle level's next run; the
    // rejected ones' go.
    mid_cached_.insert(mid_cached_.end(), drafts_.begin(), drafts_.begin() + v.accepted);
    if (size_t(v.accepted) < k)
      h_.kv_ops(kTargetRole, {{KvOpKind::remove, kMiddleSeq, -1, middle_pos_ + v.accepted, -1}});
    // Every token the middle level hands on is a draw from its own distribution at that row.
    for (int i = 0; i <= v.accepted; ++i) {
      mid_.push_back(i < v.accepted ? drafts_[size_t(i)] : v.next);
      if (!h_.sampler().greedy()) mid_q_.push_back(std::move(p[size_t(i)]));
    }
    propose();
  }

  // --- the top level ----------------------------------------------------------------------

  void verify_top() {
    std::vector<int32_t> pending = sync_cache(h_, kTargetRole, full_cached_, h_.tokens());
    pending.insert(pending.end(), mid_.begin(), mid_.end());
    awaited_top_ = feed(h_, kTargetRole, full_cached_, pending, mid_.size() + 1);
  }

  void on_top(uint64_t run, const Logits& l) {
    awaited_top_ = 0;
    const size_t k = mid_.size();
    const int V = h_.vocab();
    const auto rows = rows_of(l, k + 1, V, run);
    Verdict v;
    if (h_.sampler().greedy()) {
      v = verify_greedy(mid_, rows.data(), V);
    } else {
      std::vector<std::vector<float>> p;
      for (size_t i = 0; i <= k; ++i) p.push_back(h_.sampler().distribution(rows.data() + i * V, V));
      v = verify_stochastic(mid_, p, mid_q_, h_.sampler());
    }
    SpecMetrics& m = h_.metrics();
    m.drafted += int64_t(k);
    m.verified(v.accepted);
    rolling_.emplace_back(v.accepted, int64_t(k));
    if (rolling_.size() > kRollingWindow) rolling_.pop_front();
    for (int i = 0; i < v.accepted; ++i)
      if (!h_.accept(mid_[size_t(i)])) return;
    if (!h_.accept(v.next)) return;
    // The rejected tokens' cells leave sequence 0 now, before the next round copies it.
    sync_cache(h_, kTargetRole, full_cached_, h_.tokens());
    round();
  }

  StrategyHost& h_;
  const int budget_ = h_.params().integer("budget");
  const int chunk_ = h_.params().integer("chunk");
  const int gamma1_ = h_.params().integer("gamma1");
  const int gamma2_ = h_.params().integer("gamma2");
  const int sink_ = h_.params().integer("sink");
  const int window_ = h_.params().integer("window");
  const int rebuild_every_ = h_.params().integer("rebuild_every");
  const double rebuild_below_ = h_.params().number("rebuild_below");
  const int middle_ = h_.params().integer("middle");
  const bool use_draft_ = h_.params().flag("use_draft");
  Sampler draft_sampler_;  // the draft's distribution uses the same transforms as the target's

  std::vector<int32_t> full_cached_;   // sequence 0: the full cache
  std::vector<int32_t> mid_cached_;    // sequence 1: what the middle level's rows attend to
  std::vector<int32_t> draft_cached_;  // the draft's StreamingLLM cache, by in-cache position
  size_t anchor_ = 0;                  // first token of the draft's recent window
  int32_t fresh_from_ = 0;             // the retrieval cache was built over positions before it
  bool built_ = false;
  int32_t middle_pos_ = 0;             // position of the first draft in the awaited middle run

  std::vector<int32_t> drafts_, mid_;
  std::vector<std::vector<float>> draft_q_, mid_q_;
  std::deque<std::pair<int64_t, int64_t>> rolling_;  // (accepted, proposed) per top verification
  uint64_t awaited_draft_ = 0, awaited_full_step_ = 0, awaited_middle_ = 0, awaited_top_ = 0;
};

}  // namespace

StrategyInfo strategy_info_triforce() {
  StrategyInfo s;
  s.name = "triforce";
  s.summary = "TriForce: the draft (role `draft`, StreamingLLM cache of `sink` + `window` tokens at re-indexed "
              "positions) proposes `gamma1` tokens to the target over a retrieval cache of `budget` KV entries per "
              "layer and KV head (chunks of `chunk` scored by the last query, chunk 0 kept, generated tokens "
              "overwriting the least important entries, rebuilt every `rebuild_every` tokens and when the rolling "
              "acceptance falls below `rebuild_below`), which keeps drafting while it holds fewer than `gamma2` tokens "
              "and hands them to the target over its full cache, verified in one run; exact residual sampling at both "
              "levels; `middle` and `use_draft` give the paper's ablations";
  s.roles = {kTargetRole, kDraftRole};
  s.params = {
      {"budget", ParamType::Int, 1, 1 << 20, 64, "retrieval cache: KV entries per layer and KV head (a multiple of chunk)"},
      {"chunk", ParamType::Int, 1, 4096, 8, "retrieval cache: positions per scored chunk"},
      {"gamma1", ParamType::Int, 1, 64, 2, "draft tokens per middle-level verification"},
      {"gamma2", ParamType::Int, 1, 256, 6, "middle-level tokens per full-cache verification (at least)"},
      {"sink", ParamType::Int, 0, 1 << 20, 16, "draft's StreamingLLM cache: first tokens always kept"},
      {"window", ParamType::Int, 1, 1 << 20, 240, "draft's StreamingLLM cache: recent tokens kept"},
      {"rebuild_every", ParamType::Int, 0, 1 << 20, 64, "rebuild the retrieval cache every this many tokens (0: never)"},
      {"rebuild_below", ParamType::Float, 0, 1, 0.5,
       "rebuild the retrieval cache when the full cache accepts fewer than this share of the middle level's tokens "
       "(over its last 8 verifications)"},
      {"middle", ParamType::Int, 0, 2, 1,
       "middle level's cache: 1 retrieval, 2 StreamingLLM of the same budget, 0 none (the draft proposes gamma2 "
       "tokens to the full cache)"},
      {"use_draft", ParamType::Bool, 0, 1, 1, "the draft proposes to the middle level (false: the middle level drafts itself)"},
  };
  s.check = [](const StrategyParams& p, const SetupFacts& setup) {
    const int budget = p.integer("budget"), chunk = p.integer("chunk"), g1 = p.integer("gamma1"), g2 = p.integer("gamma2");
    const auto n = [](int v) { return std::to_string(v); };
    if (budget % chunk != 0)
      throw ParamConflict("budget", "budget " + n(budget) + " is not a multiple of chunk (" + n(chunk) +
                                        "): the retrieval cache holds whole chunks");
    if (budget - chunk < g1 + g2 + 2)
      throw ParamConflict("budget", "budget " + n(budget) + " leaves " + n(budget - chunk) +
                                        " entries beside chunk 0, fewer than one round's gamma1 + gamma2 + 2 = " +
                                        n(g1 + g2 + 2) + " generated tokens");
    if (setup.n_ctx > 0 && budget >= setup.n_ctx)
      throw ParamConflict("budget", "budget " + n(budget) + " is not below the context of " + n(setup.n_ctx) +
                                        " tokens: the retrieval cache would be the whole cache");
    if (setup.n_ctx > 0 && p.integer("sink") + p.integer("window") + g1 + 1 > setup.n_ctx)
      throw ParamConflict("window", "sink + window + gamma1 + 1 = " +
                                        n(p.integer("sink") + p.integer("window") + g1 + 1) + " exceeds the context of " +
                                        n(setup.n_ctx) + " tokens");
    if (p.integer("middle") == kNoMiddle && !p.flag("use_draft"))
      throw ParamConflict("use_draft", "middle = 0 (no middle level) needs the draft: nothing would propose");
  };
  s.make = [](StrategyHost& h) -> std::unique_ptr<Strategy> { return std::make_unique<TriForce>(h); };
  return s;
}

}  // namespace specmesh
