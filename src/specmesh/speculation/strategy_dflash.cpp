// DFlash over pipelines: a block drafter (role `draft`, a DFlash drafter directory, run by
// actors/dflash_stage) proposes a whole block at once from the hidden states the target's
// stages tap and send it, and the target verifies the block in one run. The loop is z-lab's
// dflash_generate (speculation/dflash_decode.hpp is the same loop in one process):
//
//   prefill the prompt into the target (every row tapped); t0 = sample(last row); anchor = t0
//   step:  draft run = context rows (the positions the drafter has not taken yet, each naming
//          the target run that computed it) + block [anchor, mask x (n-1)] at start..start+n-1
//          proposals p_i = argmax of the drafter's row i, i = 1..n-1
//          target run [anchor, p_1..p_{n-1}] at start..; y_i = sample(row i) accepted while
//          p_{i+1} == y_i; the first y that differs (or the last) is the next anchor
//          the target's cache is cropped to start + a + 1; its taps of rows 0..a are the
//          drafter's next context rows
//
// Every accepted token is the target's own sample given the tokens before it, so the output is
// plain decoding's for any drafter: token for token at temperature 0, in distribution otherwise.
#include <algorithm>
#include <stdexcept>

#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {

class BlockDraft final : public Strategy {
 public:
  explicit BlockDraft(StrategyHost& h) : h_(h), block_(h.params().integer("block")), async_(h.params().flag("async")) {
    if (block_ < 1) throw std::logic_error("dflash: the runtime resolves block 0 to the drafter's block size");
  }

  void start() override {
    const std::vector<int32_t>& toks = h_.tokens();
    if (toks.empty()) return h_.finish("empty prompt: at least one token (e.g. BOS) is needed");
    h_.kv_ops(kTargetRole, {{KvOpKind::remove, -1, -1, -1, -1}});
    h_.kv_ops(kDraftRole, {{KvOpKind::remove, -1, -1, -1, -1}});
    source_.clear();
    taken_ = 0;
    guess_ = {};
    const size_t n_batch = size_t(std::max(1, h_.n_batch()));
    for (size_t b = 0; b < toks.size(); b += n_batch) {
      const size_t e = std::min(toks.size(), b + n_batch);
      Batch batch;
      for (size_t i = b; i < e; ++i) batch.add(toks[i], int32_t(i), seq_bit(0), i + 1 == toks.size());
      awaited_ = h_.launch(kTargetRole, batch, false);
      for (size_t i = b; i < e; ++i) source_.push_back({awaited_, int32_t(i - b)});
    }
    phase_ = Phase::prefill;
    start_ = int32_t(toks.size());
  }

  void on_logits(uint64_t run, const Logits& l) override {
    if (h_.done()) return;
    if (run == guess_.run && phase_ == Phase::verify) {
      guess_.logits = l;  // it came before the verification it assumes
      guess_.arrived = true;
      return;
    }
    if (run != awaited_) return;  // an earlier prefill chunk, or a guess dropped
    const int V = h_.vocab();
    switch (phase_) {
      case Phase::prefill: {
        const std::vector<float> row = rows_of(l, 1, V, run);
        anchor_ = h_.sampler().sample(row.data(), V);
        if (!h_.accept(anchor_)) return;
        return next_step();
      }
      case Phase::draft: return proposals(run, l);
      case Phase::verify: return settle(run, l);
    }
  }

  // The context was full: tokens [n_keep, n_keep + n_discard) are gone from every cache, the
  // drafter's too, and the later ones moved down. It comes from the last accept of a
  // verification (a block never reaches past the context) or of the prefill. An async guess in
  // flight stays coherent: the drafter's cache takes the shift after it.
  bool context_shifted(int n_keep, int n_discard) override {
    const auto moved = [&](int32_t p) { return int32_t(shifted_position(p, n_keep, n_discard)); };
    shift_cached(source_, n_keep, n_discard);
    taken_ = moved(taken_);
    start_ = moved(start_);
    guess_.taken_before = moved(guess_.taken_before);
    return true;
  }

 private:
  enum class Phase { prefill, draft, verify };

  // The next step's draft, launched with the verification it assumes will accept the whole
  // block (async): its context rows are the block's, its anchor the drafter's own proposal
  // for the position after the block (the last one, held back from the verification).
  struct Guess {
    uint64_t run = 0;  // 0: none in flight
    int32_t anchor = -1;
    int32_t taken_before = 0;  // what the drafter held before it
    int rows = 0;              // its block rows
    bool arrived = false;
    Logits logits;
  };

  // The block for the anchor at start_: drafted when it has room for proposals, else a plain
  // decode step.
  void next_step() {
    const int n = std::min(block_, h_.n_ctx() - start_);
    block_tokens_.assign(size_t(std::max(1, n)), anchor_);
    if (n < 2) {
      verify();
      return;
    }
    std::vector<TapRow> inputs(source_.begin() + taken_, source_.begin() + start_);
    const std::vector<int32_t>& toks = h_.tokens();
    awaited_ = draft(std::vector<int32_t>(toks.begin() + taken_, toks.begin() + start_), inputs, anchor_, start_, n);
    phase_ = Phase::draft;
  }

  // Launches a draft run: context rows (tokens and the target runs that computed them) from
  // taken_ on, then the anchor at `at` and n - 1 mask rows.
  uint64_t draft(const std::vector<int32_t>& ctx, std::vector<TapRow> inputs, int32_t anchor, int32_t at, int n) {
    Batch b;
    for (size_t i = 0; i < ctx.size(); ++i) b.add(ctx[i], taken_ + int32_t(i), seq_bit(0), false);
    // Mask rows carry the id just past the vocabulary, no token's: the drafter embeds its mask.
    for (int i = 0; i < n; ++i) {
      b.add(i == 0 ? anchor : h_.vocab(), at + i, seq_bit(0), i > 0);
      inputs.push_back({});
    }
    taken_ = at;
    draft_rows_ = n;
    return h_.launch(kDraftRole, b, true, inputs);
  }

  // A draft's proposals (argmax of its rows) go to the target. With async the last one is held
  // back as the guess for the anchor after the verified block (the drafter's block stays the
  // size it was trained for), and the next block's draft goes out at once on that guess.
  void proposals(uint64_t run, const Logits& l) {
    const int V = h_.vocab();
    const int n = draft_rows_;
    const std::vector<float> rows = rows_of(l, size_t(n - 1), V, run);
    std::vector<int32_t> drafted(size_t(n), anchor_);
    for (int i = 1; i < n; ++i) drafted[size_t(i)] = Sampler::argmax(rows.data() + size_t(i - 1) * size_t(V), V);
    const bool guess = async_ && n >= 3;
    block_tokens_.assign(drafted.begin(), drafted.end() - (guess ? 1 : 0));
    const uint64_t v = verify();
    if (!guess) return;
    const int32_t next = start_ + int32_t(block_tokens_.size());
    const int n_next = std::min(block_, h_.n_ctx() - next);
    if (n_next < 2) return;
    Guess g;
    g.anchor = drafted.back();
    g.taken_before = taken_;
    std::vector<TapRow> rows_of_v;
    for (size_t i = 0; i < block_tokens_.size(); ++i) rows_of_v.push_back({v, int32_t(i)});
    g.run = draft(block_tokens_, rows_of_v, g.anchor, next, n_next);
    g.rows = draft_rows_;
    guess_ = std::move(g);
    ++h_.metrics().speculative_drafts;
  }

  uint64_t verify() {
    Batch b;
    for (size_t i = 0; i < block_tokens_.size(); ++i) b.add(block_tokens_[i], start_ + int32_t(i), seq_bit(0), true);
    awaited_ = h_.launch(kTargetRole, b, block_tokens_.size() > 1);
    phase_ = Phase::verify;
    return awaited_;
  }

  void settle(uint64_t run, const Logits& l) {
    const int V = h_.vocab();
    const size_t n = block_tokens_.size();
    const std::vector<float> rows = rows_of(l, n, V, run);
    SpecMetrics& m = h_.metrics();
    m.drafted += int64_t(n) - 1;
    int a = 0;
    int32_t y = -1;
    bool going = true;
    for (size_t i = 0; i < n && going; ++i) {
      y = h_.sampler().sample(rows.data() + i * size_t(V), V);
      const bool match = i + 1 < n && block_tokens_[i + 1] == y;
      going = h_.accept(y);
      if (!match) break;
      ++a;
    }
    m.verified(a);
    Guess g = std::move(guess_);
    guess_ = {};
    const bool held = g.run && going && size_t(a) + 1 == n && y == g.anchor;
    if (g.run && !held) {
      // The guess's context rows may be in the drafter's cache already: crop them (block rows
      // never are, so a draft that stood needs no crop).
      h_.cancel(kDraftRole, {g.run});
      taken_ = g.taken_before;
      h_.kv_ops(kDraftRole, {{KvOpKind::remove, 0, -1, taken_, -1}});
    }
    if (!going) return;
    h_.kv_ops(kTargetRole, {{KvOpKind::remove, 0, -1, start_ + a + 1, -1}});
    for (int i = 0; i <= a; ++i) source_.push_back({run, i});
    start_ += a + 1;
    anchor_ = y;
    if (!held) return next_step();
    // The guess was right: its draft is this step's.
    ++m.speculative_drafts_used;
    awaited_ = g.run;
    draft_rows_ = g.rows;
    phase_ = Phase::draft;
    if (g.arrived) proposals(g.run, g.logits);
  }

  StrategyHost& h_;
  const int block_;
  const bool async_;
  Phase phase_ = Phase::prefill;
  uint64_t awaited_ = 0;
  std::vector<TapRow> source_;         // per position, the target run's row whose taps hold it
  int32_t taken_ = 0;                  // the drafter's cache holds [0, taken_) once its runs are done
  int32_t start_ = 0;                  // the anchor's position
  int32_t anchor_ = -1;
  int draft_rows_ = 0;                 // the awaited draft's block rows
  std::vector<int32_t> block_tokens_;  // the anchor and the proposals
  Guess guess_;
};

}  // namespace

StrategyInfo strategy_info_dflash() {
  StrategyInfo s;
  s.name = "dflash";
  s.summary = "DFlash: a block drafter (role `draft`: a drafter directory, config.json + model.safetensors) proposes "
              "`block` - 1 tokens at once from hidden states the target's stages tap and send it; the target "
              "verifies the block in one run and keeps the proposals equal to its own samples";
  s.roles = {kTargetRole, kDraftRole};
  s.params = {
      {"block", ParamType::Int, 0, 64, 0, "block size: the anchor and block - 1 proposals (0: the drafter's block_size)",
       {"--block"}},
      {"taps", ParamType::Int, 16, 32, 32,
       "bits per value of the tapped hidden states on the wire: 32 (exact) or 16 (F16, half the bytes)", {"--taps"}},
      {"async", ParamType::Bool, 0, 1, 0,
       "draft the next block while the target verifies this one (block - 2 proposals), guessing it is all accepted "
       "and that the anchor after it is the drafter's last proposal (a wrong guess is cancelled)",
       {"--async-draft"}},
      {"window", ParamType::Int, 0, 1 << 20, 0,
       "draft cache: a block attends to the latest this many context rows, so drafting cost stops growing with the "
       "context (0: all of them)",
       {}},
  };
  s.drafter_role = kDraftRole;
  s.default_for_roles = true;  // when the draft is a drafter directory (default_strategy)
  s.check = [](const StrategyParams& p, const SetupFacts& f) {
    if (p.integer("taps") != 16 && p.integer("taps") != 32)
      throw ParamConflict("taps", "taps " + std::to_string(p.integer("taps")) + ": the tapped states travel as 32 or 16 bits");
    if (f.n_ctx > 0 && p.integer("block") > f.n_ctx)
      throw ParamConflict("block", "block " + std::to_string(p.integer("block")) + " is longer than the context (" +
                                       std::to_string(f.n_ctx) + " tokens)");
  };
  s.make = [](StrategyHost& h) { return std::make_unique<BlockDraft>(h); };
  return s;
}

}  // namespace specmesh
