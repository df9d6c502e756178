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
// The levels overlap: while the full cache verifies, the draft and the middle level go on
// proposing past the tokens it verifies (up to gamma2 more), on the assumption that all of
// them stand. When the verdict comes, their work survives as far as it agrees with what was
// accepted (the bonus token included: at temperature 0 it is the argmax either way; at
// temperature 1 the bonus is drawn from the full cache's row as in a sequential round, and the
// run-ahead is kept only if its next token is that draw, so what is emitted stays the
// target's); otherwise the proposal died, and its runs still in flight are cancelled on the
// priority path, as in PipeInfer, their cells dropped. The draft runs on its own device, so
// it really works in parallel; middle-level runs queue behind the verification in the
// target's stages, which overlap them when the stages span processes.
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
#include <span>

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
    chain_ = h_.tokens();
    q_from_ = chain_.size();
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

  // The shift comes from an accept() of the full cache's step or of a top-level verdict, while
  // the lower levels may be running ahead: their proposal dies (its runs cancelled). The full
  // cache and sequence 1 follow the shift as every cache does; the retrieval cache, whose
  // entries the shift moved or dropped, is rebuilt before the middle level reads it again;
  // the draft's StreamingLLM cache, whose in-cache positions are not the tokens' positions,
  // starts over (one run of the draft over at most sink + window tokens).
  bool context_shifted(int n_keep, int n_discard) override {
    shift_cached(full_cached_, n_keep, n_discard);
    shift_cached(mid_cached_, n_keep, n_discard);
    if (use_draft_) {
      if (awaited_draft_) h_.cancel(kDraftRole, {std::exchange(awaited_draft_, 0)});
      h_.kv_ops(kDraftRole, {{KvOpKind::remove, 0, -1, -1, -1}});
      draft_cached_.clear();
      anchor_ = 0;
    }
    kill_lower();
    rolling_.clear();
    if (middle_ == kRetrieval) stale_view_ = true;
    return true;
  }

  void abandon() override {
    for (uint64_t* r : {&awaited_full_step_, &awaited_middle_, &awaited_top_})
      if (*r) h_.cancel(kTargetRole, {std::exchange(*r, 0)});
    if (awaited_draft_) h_.cancel(kDraftRole, {std::exchange(awaited_draft_, 0)});
  }

 private:
  // --- the full cache alone: prefill and rebuilds --------------------------------------------

  // Runs the tokens the full cache lacks (the newest at least) and samples the next token
  // from the last row; the retrieval cache is then (re)built from that row's query. The lower
  // levels are idle: nothing may read sequence 1 while its view changes.
  void full_step() {
    awaited_full_step_ = feed(h_, kTargetRole, full_cached_, sync_cache(h_, kTargetRole, full_cached_, h_.tokens()), 1);
  }

  void on_full_step(uint64_t run, const Logits& l) {
    awaited_full_step_ = 0;
    const auto row = rows_of(l, 1, h_.vocab(), run);
    if (middle_ == kRetrieval) {
      stale_view_ = false;
      fresh_from_ = int32_t(full_cached_.size());
      h_.kv_ops(kTargetRole, {retrieval_view_op(kMiddleSeq, fresh_from_, chunk_, budget_)});
      if (built_) ++h_.metrics().cache_rebuilds;
      built_ = true;
      rolling_.clear();
    }
    if (!h_.accept(h_.sampler().sample(row.data(), h_.vocab()))) return;
    next_round();
  }

  // --- rounds: the top level is idle and tokens() has grown ----------------------------------

  // The lower levels may have run ahead while the top level verified: their work stands
  // while it extends the accepted tokens, and dies (its runs cancelled) where it does not.
  void next_round() {
    if (!lower_agrees()) kill_lower();
    const size_t n = h_.tokens().size();
    const size_t done = std::min(chain_q_.size(), n > q_from_ ? n - q_from_ : 0);
    chain_q_.erase(chain_q_.begin(), chain_q_.begin() + ptrdiff_t(done));
    q_from_ += done;
    if (rebuild_due()) {
      kill_lower();
      return full_step();
    }
    if (middle_ != kNoMiddle) {
      // Sequence 1 starts over as sequence 0 (every accepted token but the newest): the
      // generated tokens' entries are the full cache's, and the middle level's own rows, a
      // run still in flight included, were scratch.
      h_.kv_ops(kTargetRole, {{KvOpKind::remove, kMiddleSeq, -1, -1, -1}, {KvOpKind::copy, 0, kMiddleSeq, -1, -1}});
      mid_cached_ = full_cached_;
      ++mid_epoch_;
    }
    step();
  }

  // Moves whichever level can: the top level verifies once the lower levels hold gamma2
  // tokens it has not seen (or every token up to the end of the context); meanwhile the lower
  // levels keep proposing, up to gamma2 tokens past what the top level is verifying. No level
  // runs a position past the context: near its end the proposals get shorter, and a top-level
  // run verifies at most the chain's tokens before it.
  void step() {
    const size_t n = h_.tokens().size(), end = size_t(h_.n_ctx());
    const bool lower_busy = awaited_draft_ || awaited_middle_;
    if (!lower_busy && chain_.size() < n) forget_lower();  // it fell behind: start it from the accepted tokens
    if (!awaited_top_ && chain_.size() >= std::min(n + size_t(gamma2_), end)) verify_top();
    const size_t seen = n + sent_.size();
    const size_t unsent = verifiable() > seen ? verifiable() - seen : 0;
    if (lower_busy) return;
    // The middle level's fresh entries must leave chunk 0 (the sink) alone.
    const bool sink_safe = fits(chain_.size() + size_t(gamma1_));
    const bool room = sink_safe && chain_.size() < end;
    if (awaited_top_) {
      if (unsent >= size_t(gamma2_) || !room) return;  // enough ahead: wait for the verdict
    } else if (!room) {
      if (unsent > 0 || sink_safe) return verify_top();  // at the context's end: what there is, or a plain step
      kill_lower();
      return full_step();
    }
    if (use_draft_) return draft_next();
    middle_run({});
  }

  // The chain's tokens a top-level run may verify: those before the end of the context.
  size_t verifiable() const { return std::min(chain_.size(), size_t(h_.n_ctx())); }

  // Whether the middle level's entries up to position `last` leave chunk 0 (the sink) alone:
  // the retrieval view's fresh entries, from fresh_from_ on, overwrite the others.
  bool fits(size_t last) const {
    return middle_ != kRetrieval || int64_t(last) + 1 - fresh_from_ <= int64_t(budget_ - chunk_);
  }

  bool rebuild_due() const {
    if (middle_ != kRetrieval) return false;
    if (stale_view_) return true;
    const int32_t n = int32_t(h_.tokens().size());
    // The highest position a round's middle level queries is about n + gamma2 + gamma1.
    if (!fits(size_t(n + gamma1_ + gamma2_))) return true;
    if (rebuild_every_ > 0 && n - fresh_from_ >= rebuild_every_) return true;
    if (rolling_.size() < kRollingWindow) return false;
    int64_t acc = 0, drafted = 0;
    for (auto [a, d] : rolling_) acc += a, drafted += d;
    return drafted > 0 && double(acc) < rebuild_below_ * double(drafted);
  }

  // --- the lower levels' proposal ---------------------------------------------------------

  // Whether the lower levels' tokens (the middle level's chain, then the draft's) agree with
  // every accepted token they overlap.
  bool lower_agrees() const {
    const std::vector<int32_t>& t = h_.tokens();
    for (size_t i = q_from_; i < t.size(); ++i) {
      const int32_t mine = i < chain_.size()                   ? chain_[i]
                           : i - chain_.size() < drafts_.size() ? drafts_[i - chain_.size()]
                                                                : -1;
      if (mine < 0) break;
      if (mine != t[i]) return false;
    }
    return true;
  }

  // The proposal died: its runs still in flight are cancelled (PipeInfer's early cancellation),
  // their cells dropped, and the lower levels start again from the accepted tokens.
  void kill_lower() {
    if (awaited_draft_) {
      h_.cancel(kDraftRole, {std::exchange(awaited_draft_, 0)});
      // Whatever of the run a stage processed before the cancel goes with this operation.
      h_.kv_ops(kDraftRole, {{KvOpKind::remove, 0, -1, int32_t(draft_from_), -1}});
      draft_cached_.resize(draft_from_);
    }
    if (awaited_middle_) h_.cancel(kTargetRole, {std::exchange(awaited_middle_, 0)});
    if (middle_ != kNoMiddle && mid_epoch_ == middle_epoch_) {
      // The middle level's rows beyond the accepted tokens are dropped (a round start resets
      // sequence 1 in any case).
      h_.kv_ops(kTargetRole, {{KvOpKind::remove, kMiddleSeq, -1, int32_t(full_cached_.size()), -1}});
      mid_cached_.resize(std::min(mid_cached_.size(), full_cached_.size()));
    }
    forget_lower();
  }

  void forget_lower() {
    chain_ = h_.tokens();
    chain_q_.clear();
    q_from_ = chain_.size();
    drafts_.clear();
    draft_q_.clear();
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
    std::vector<int32_t> all = chain_;
    all.insert(all.end(), drafts_.begin(), drafts_.end());
    const std::vector<int32_t> todo = sync_cache(h_, kDraftRole, draft_cached_, streamed(all));
    draft_from_ = draft_cached_.size();
    awaited_draft_ = feed(h_, kDraftRole, draft_cached_, todo, 1);
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
      chain_.push_back(token);
      chain_q_.push_back(std::move(draft_q_.back()));
      drafts_.clear();
      draft_q_.clear();
    }
    if (!lower_agrees()) {
      kill_lower();
      return step();
    }
    if (middle_ == kNoMiddle) return step();
    // The middle level's run holds the drafts at positions chain_.size() onwards.
    if (int(drafts_.size()) < gamma1_ && chain_.size() + drafts_.size() < size_t(h_.n_ctx())) return draft_next();
    middle_run(drafts_);
  }

  // --- the middle level --------------------------------------------------------------------

  // One run of sequence 1 through the partial view: the tokens of the chain it lacks (the
  // newest at least) and the drafts, with logits for the last of the former and every draft.
  void middle_run(const std::vector<int32_t>& drafts) {
    // The chain's last token always gets a row of its own (its logits judge the first draft),
    // even when the full cache's copy, after a round start, already holds it.
    const std::vector<int32_t> todo = sync_cache(h_, kTargetRole, mid_cached_, chain_, kMiddleSeq);
    Batch b;
    for (size_t i = 0; i < todo.size(); ++i)
      b.add(todo[i], int32_t(mid_cached_.size() + i), seq_bit(kMiddleSeq), i + 1 == todo.size());
    for (size_t i = 0; i < drafts.size(); ++i)
      b.add(drafts[i], int32_t(chain_.size() + i), seq_bit(kMiddleSeq), true);
    mid_cached_ = chain_;
    middle_pos_ = int32_t(chain_.size());
    middle_epoch_ = mid_epoch_;
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
    if (middle_epoch_ == mid_epoch_) {
      // The accepted drafts' rows stay in sequence 1 for the middle level's next run; the
      // rejected ones' go. (After a round start reset sequence 1, none of the run's are there.)
      mid_cached_.insert(mid_cached_.end(), drafts_.begin(), drafts_.begin() + v.accepted);
      if (size_t(v.accepted) < k)
        h_.kv_ops(kTargetRole, {{KvOpKind::remove, kMiddleSeq, -1, middle_pos_ + v.accepted, -1}});
    }
    // Every token the middle level hands on is a draw from its own distribution at that row.
    for (int i = 0; i <= v.accepted; ++i) {
      chain_.push_back(i < v.accepted ? drafts_[size_t(i)] : v.next);
      chain_q_.push_back(h_.sampler().greedy() ? std::vector<float>{} : std::move(p[size_t(i)]));
    }
    drafts_.clear();
    draft_q_.clear();
    if (!lower_agrees()) kill_lower();
    step();
  }

  // --- the top level ----------------------------------------------------------------------

  // Verifies every chain token past the accepted ones, up to the end of the context, in one
  // run of the full cache.
  void verify_top() {
    const size_t n = h_.tokens().size();
    sent_.assign(chain_.begin() + ptrdiff_t(n), chain_.begin() + ptrdiff_t(std::max(n, verifiable())));
    std::vector<int32_t> pending = sync_cache(h_, kTargetRole, full_cached_, h_.tokens());
    pending.insert(pending.end(), sent_.begin(), sent_.end());
    awaited_top_ = feed(h_, kTargetRole, full_cached_, pending, sent_.size() + 1);
  }

  // All accepted: the bonus token is drawn from the full cache's last row as usual, and the
  // lower levels' run-ahead survives if its next token is that one (exact: what is emitted is
  // the target's draw, and the tokens after it are drafts the next verification judges).
  void on_top(uint64_t run, const Logits& l) {
    awaited_top_ = 0;
    const size_t k = sent_.size(), n = h_.tokens().size();
    const int V = h_.vocab();
    const auto rows = rows_of(l, k + 1, V, run);
    Verdict v;
    if (h_.sampler().greedy()) {
      v = verify_greedy(sent_, rows.data(), V);
    } else {
      std::vector<std::vector<float>> p;
      for (size_t i = 0; i <= k; ++i) p.push_back(h_.sampler().distribution(rows.data() + i * V, V));
      v = verify_stochastic(sent_, p, std::span(chain_q_).subspan(n - q_from_, k), h_.sampler());
    }
    if (k > 0) {  // not a plain step at the context's end
      SpecMetrics& m = h_.metrics();
      m.drafted += int64_t(k);
      m.verified(v.accepted);
      rolling_.emplace_back(v.accepted, int64_t(k));
      if (rolling_.size() > kRollingWindow) rolling_.pop_front();
    }
    const std::vector<int32_t> sent = std::exchange(sent_, {});
    for (int i = 0; i < v.accepted; ++i)
      if (!h_.accept(sent[size_t(i)])) return;
    if (!h_.accept(v.next)) return;
    // The rejected tokens' cells leave sequence 0 now, before the next round copies it.
    sync_cache(h_, kTargetRole, full_cached_, h_.tokens());
    next_round();
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
  size_t draft_from_ = 0;              // where the awaited draft run's cells start in it
  size_t anchor_ = 0;                  // first token of the draft's recent window
  int32_t fresh_from_ = 0;             // the retrieval cache was built over positions before it
  bool built_ = false;
  bool stale_view_ = false;            // a context shift moved the retrieval cache's entries
  int32_t middle_pos_ = 0;             // position of the first draft in the awaited middle run
  uint64_t mid_epoch_ = 0;             // counts resets of sequence 1
  uint64_t middle_epoch_ = 0;          // the reset the awaited middle run saw

  // The lower levels' proposal: the accepted tokens and then the middle level's (or, without
  // one, the draft's), with the distribution each was drawn from (chain_q_[i] for position
  // q_from_ + i); the draft's tokens waiting for the middle level follow in drafts_.
  std::vector<int32_t> chain_;
  std::vector<std::vector<float>> chain_q_;
  size_t q_from_ = 0;
  std::vector<int32_t> drafts_;
  std::vector<std::vector<float>> draft_q_;
  std::vector<int32_t> sent_;  // the chain tokens the awaited top-level run verifies
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
              "levels; the lower levels run ahead while the full cache verifies, and their runs are cancelled when the "
              "proposal they extend dies; `middle` and `use_draft` give the paper's ablations (`use_draft = false` needs "
              "no draft)";
  s.roles = {kTargetRole, kDraftRole};
  s.roles_needed = [](const StrategyParams& p) {
    return p.flag("use_draft") ? std::vector<std::string>{kTargetRole, kDraftRole} : std::vector<std::string>{kTargetRole};
  };
  s.params = {
      {"budget", ParamType::Int, 1, 1 << 20, 64, "retrieval cache: KV entries per layer and KV head (a multiple of chunk)", {}},
      {"chunk", ParamType::Int, 1, 4096, 8, "retrieval cache: positions per scored chunk", {}},
      {"gamma1", ParamType::Int, 1, 64, 2, "draft tokens per middle-level verification", {}},
      {"gamma2", ParamType::Int, 1, 256, 6, "middle-level tokens per full-cache verification (at least)", {}},
      {"sink", ParamType::Int, 0, 1 << 20, 16, "draft's StreamingLLM cache: first tokens always kept", {}},
      {"window", ParamType::Int, 1, 1 << 20, 240, "draft's StreamingLLM cache: recent tokens kept", {}},
      {"rebuild_every", ParamType::Int, 0, 1 << 20, 64, "rebuild the retrieval cache every this many tokens (0: never)", {}},
      {"rebuild_below", ParamType::Float, 0, 1, 0.5,
       "rebuild the retrieval cache when the full cache accepts fewer than this share of the middle level's tokens "
       "(over its last 8 verifications)", {}},
      {"middle", ParamType::Int, 0, 2, 1,
       "middle level's cache: 1 retrieval, 2 StreamingLLM of the same budget, 0 none (the draft proposes gamma2 "
       "tokens to the full cache)", {}},
      {"use_draft", ParamType::Bool, 0, 1, 1, "the draft proposes to the middle level (false: the middle level drafts itself)", {}},
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
  // The middle level's rows in sequence 1 sit at positions the full cache's verification also
  // holds: at most the tokens one top-level run verifies (gamma2 + gamma1) and the chain's
  // newest, plus one. Without a middle level the full cache alone holds a chain.
  s.spare_cells = [](const StrategyParams& p, const std::set<std::string>&) {
    return p.integer("middle") == kNoMiddle ? 0 : p.integer("gamma1") + p.integer("gamma2") + 2;
  };
  s.make = [](StrategyHost& h) -> std::unique_ptr<Strategy> { return std::make_unique<TriForce>(h); };
  return s;
}

}  // namespace specmesh
