// PipeInfer: asynchronous, continuous speculation over a pipelined target.
//
// The newest accepted token is always in a target run in flight: a non-speculative run of it
// (which writes straight into the canonical sequence 0 and always completes), unless a
// speculative run already carries it on a path the accepted tokens agree with, whose logits
// then serve just as well. With plain_runs off the token corrected by a rejection waits for
// the draft's next micro-batch and goes as that run's first row: a run of its own holds the
// first stage for a whole run's time, and a draft that fills a micro-batch sooner than that
// would have its run wait behind it. Whenever fewer than max_runs target runs are in flight,
// the head asks the draft for a micro-batch of 1 to max_micro_batch tokens per speculative
// branch (as many as clear the confidence cutoff, at least one: an idle pipeline is the worst
// use of it) and launches them together as one speculative run. Logits come back in launch
// order; each run's rows extend the accepted tokens where their paths agree with them. Runs
// whose every row has become invalid (a token on its path was rejected) are cancelled on the
// priority path.
//
// Branches (multi-sequence speculation). Every speculative branch is a path of tokens that
// extends the accepted ones, with a KV sequence of its own (the same number in the target's and
// the draft's caches) that holds the cells of its launched part: canonical cells and cells of
// earlier runs are borrowed by range copies (metadata, no data moves) that travel in order with
// the runs, so every stage's cache stays consistent. A run's rows are the branches' new tokens;
// a row shared by several branches (a common prefix) is launched once, in all their sequences,
// and a row attends to the cells of its sequences up to its position. That is how a branch
// reaches across runs (an earlier run wrote its first tokens, a later run its continuation), so
// the mask is the sequences' and not one run's DFS intervals. With n_parallel = 1 there is one
// branch: a chain.
//
// Where branches start. While drafting the main branch the draft records its candidates behind
// its top token at every position (as many as there are alternative slots). An unverified
// position's next untaken candidate whose probability exceeds p_split plus the cutoff's current
// adjustment is a candidate branch, worth the draft's probability of the main path up to it
// times the candidate's. The best candidates become branches while fewer than n_parallel are
// alive, and replace a less likely alternative after that (its sequences are freed; its rows in
// flight are never used again). Candidates behind the draft's frontier count: when the target
// passes an alternative's position, the slot goes to the likeliest doubt still ahead. The draft
// extends every branch in one batched draft run per step, each by at least one token and at
// most max_micro_batch per run (twice that while an alternative is behind the main branch's
// frontier, so it catches up). When the target rejects the main branch where an alternative
// agreed, that alternative's continuation is already in flight and the pipeline does not
// drain. This follows the artifact's parallel drafting sequences (its -np), with two
// differences: the artifact caps a whole run at n_draft tokens, this caps each branch's part;
// and it branches only at the draft's frontier.
//
// Adaptive mode (`adaptive`, beyond the paper) replaces max_micro_batch and p_accept by what
// PipeInferTuner chooses from the acceptance and latencies the head measures.
//
// Draft work survives changes of the accepted tokens: a branch that agrees with them keeps its
// drafted tokens and the draft's cells, and a draft run whose round went stale is awaited, not
// repeated: its answers for the branches still alive start the next round.
//
// Verification walks the run's rows in any order: the row at the newest accepted position
// whose path agrees with the accepted tokens yields the next token (greedy, or PipeInfer's
// sample-and-match at temperature > 0: the target samples from that row, and the walk goes on
// only where a row's path carries the sampled token). The accepted rows' cells become
// canonical by a range copy; branches that disagree with the accepted tokens are freed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

#include "specmesh/speculation/pipeinfer_tuner.hpp"
#include "specmesh/speculation/pipeline_ops.hpp"
#include "specmesh/speculation/registry.hpp"

namespace specmesh {

namespace {


// A speculative path: accepted tokens then drafted ones. Its sequence holds cells for
// path[0, launched) (written, or in flight in runs launched earlier); the rest is drafted but
// not launched yet.
// The draft's cache has a sequence of the same number for the branch, holding its cells for
// path[0, drafted).
struct Branch {
  uint64_t id = 0;
  int seq = 0;
  std::vector<int32_t> path;
  int32_t launched = 0;
  int32_t drafted = 0;
  bool active = false;  // the draft extends it in the current round
  // The draft's probability of each path token (1 for tokens it did not propose), and where
  // the branch left its parent's path (-1: it is no one's alternative).
  std::vector<float> prob;
  int32_t split_at = -1;
  // Per path position: the draft's runner-up there and its probability (-1: none recorded,
  // or a branch already starts with it).
  std::vector<int32_t> runner;
  std::vector<float> runner_p;
  // Per path position: the draft's further candidates after the runner-up (likeliest first),
  // each the runner-up in turn once the one before it is taken.
  std::vector<std::vector<std::pair<int32_t, float>>> more;
  // The draft's logits after path[0, next_for), kept when a round stopped on them, so the next
  // round uses them instead of feeding the last token again.
  std::vector<float> next;
  size_t next_for = 0;
  void resize(size_t n) {
    prob.resize(n, 1.0f);
    runner.resize(n, -1);
    runner_p.resize(n, 0.0f);
    more.resize(n);
  }
};

// One row of a target run: the token at `pos`, on the path whose tokens from the run's `from`
// up to `pos` are `path` (below `from` every path of the run agrees with the accepted tokens).
struct Row {
  int32_t pos = 0;
  std::vector<int32_t> path;
  // The branches the row was launched for, with their sequences (none: a non-speculative run).
  std::vector<std::pair<uint64_t, int>> owners;
  float conf = 1;  // the draft's probability of the row's token (adaptive mode's calibration)
};

using Clock = std::chrono::steady_clock;

// The largest micro-batch adaptive mode chooses (the largest max_micro_batch takes).
constexpr int kAdaptiveMaxMicroBatch = 16;

struct RunInfo {
  uint64_t id = 0;
  bool speculative = false;
  int32_t from = 0;
  std::vector<Row> rows;
  Clock::time_point launched{};  // for adaptive mode's latency figures
  int in_flight = 1;             // runs in flight once it was launched
};

class PipeInfer final : public Strategy {
 public:
  explicit PipeInfer(StrategyHost& h) : c_(h), cut_(p_accept_) {
    for (int s = 1; s <= std::min(h.sequences() - 1, n_parallel_ + 1); ++s) free_.push_back(s);
  }

  void start() override {
    // The prompt (with the tokens accepted before a failover) goes straight into the canonical
    // sequence; its last token is the first non-speculative run.
    const auto& prompt = c_.tokens();
    std::vector<int32_t> cached;
    const uint64_t id = feed(c_, target(), cached, prompt, 1);
    inflight_.push_back(plain(id));
    canon_len_ = accepted();
    // The draft's canonical sequence 0 holds the prompt but its last token, which the first
    // branch feeds for its logits.
    std::vector<int32_t> draft_cached;
    if (prompt.size() > 1) feed(c_, draft(), draft_cached, {prompt.begin(), prompt.end() - 1}, 0);
    draft_canon_ = int32_t(draft_cached.size());
    settle();
    pump();
  }

  void abandon() override {
    std::vector<uint64_t> runs;
    for (const RunInfo& r : inflight_) runs.push_back(r.id);
    c_.cancel(target(), runs);
    inflight_.clear();
  }

  void on_logits(uint64_t run, const Logits& l) override {
    if (l.pipeline == kDraftRole) return on_draft(run, l);
    auto it = std::find_if(inflight_.begin(), inflight_.end(), [&](const RunInfo& r) { return r.id == run; });
    if (it == inflight_.end()) {
      // Not ours any more: a prefill chunk, or a run cancelled too late to stop.
      if (!l.rows.empty()) ++c_.metrics().runs_wasted;
      return;
    }
    RunInfo r = std::move(*it);
    inflight_.erase(it);
    burst_ = 0;
    if (adaptive_)
      tuner_.target_run(int(r.rows.size()), std::chrono::duration<double>(Clock::now() - r.launched).count(), r.in_flight);
    if (!verify(r, l)) return;  // generation over
    prune();
    settle();
    pump();
  }

  // The accept() that filled the context took a token from a row at position n_ctx - 1, the
  // last position any run may hold (see wants_more), so every row still in flight is at a
  // position already decided and can yield nothing. The shift's cache operations (on every
  // sequence) are on their way: the accepted tokens' cells become canonical at their new
  // positions, every branch and run goes, and speculation starts again from the accepted
  // tokens, as after the prompt.
  bool context_shifted(int n_keep, int n_discard) override {
    auto moved = [&](int32_t len) { return len <= n_keep ? len : std::max<int32_t>(n_keep, len - n_discard); };
    canon_len_ = moved(canon_len_);
    draft_canon_ = moved(draft_canon_);
    const int32_t cached = accepted() - 1;
    if (accepting_src_ > 0 && canon_len_ < cached) {
      c_.kv_ops(target(), {{KvOpKind::copy, accepting_src_, 0, canon_len_, cached}});
      canon_len_ = cached;
    }
    abandon();
    while (!branches_.empty()) drop(branches_.front().id);
    drafting_ = false;
    step_.clear();
    awaited_run_ = 0;
    ++shifts_;
    return true;
  }

 private:
  static const char* target() { return kTargetRole; }
  static const char* draft() { return kDraftRole; }
  int32_t accepted() const { return int32_t(c_.tokens().size()); }

  // A non-speculative run of the newest accepted token, in the canonical sequence.
  RunInfo plain(uint64_t id) const {
    RunInfo r;
    r.id = id;
    r.from = accepted();
    r.rows.push_back({accepted() - 1, {}, {}});
    r.launched = Clock::now();
    r.in_flight = int(inflight_.size()) + 1;
    return r;
  }

  // Whether a row can still extend the accepted tokens: its path agrees with them where both
  // are known, and a branch it was launched for is alive (a branch given up for a likelier one
  // leaves rows whose sequence is gone).
  bool agrees(const RunInfo& r, const Row& row) {
    if (r.speculative && std::none_of(row.owners.begin(), row.owners.end(), [&](const auto& o) { return find(o.first); }))
      return false;
    const auto& A = c_.tokens();
    for (size_t k = 0; k < row.path.size() && r.from + int32_t(k) < accepted(); ++k)
      if (A[size_t(r.from) + k] != row.path[k]) return false;
    return true;
  }
  // The sequence of a live branch the row was launched for, which holds the row's cell and
  // those of the tokens before it (0: none, a non-speculative run's row).
  int live_seq(const Row& row) {
    int s = 0;
    for (const auto& [id, seq] : row.owners)
      if (find(id)) s = seq;
    return s;
  }
  bool agrees(const Branch& b) const {
    const auto& A = c_.tokens();
    const size_t n = std::min(A.size(), b.path.size());
    return std::equal(A.begin(), A.begin() + n, b.path.begin());
  }

  // Extends the accepted tokens with a run's rows; false once generation is over.
  bool verify(const RunInfo& r, const Logits& l) {
    const int V = c_.vocab();
    const std::vector<float> logits = rows_of(l, r.rows.size(), V, r.id);
    const int shifts = shifts_;
    int gained = 0;
    for (;;) {
      const int32_t last = accepted() - 1;
      auto row = std::find_if(r.rows.begin(), r.rows.end(), [&](const Row& x) { return x.pos == last && agrees(r, x); });
      if (row == r.rows.end()) break;
      ++gained;
      accepting_src_ = live_seq(*row);
      if (!c_.accept(c_.sampler().sample(logits.data() + size_t(row - r.rows.begin()) * V, V))) break;
      if (shifts_ != shifts) break;  // the context shifted: this run's rows are stale (context_shifted)
    }
    // The accepted rows' cells become canonical (they are in the sequence of every branch
    // through them, and those branches are all alive: they agree with the accepted tokens).
    int32_t upto = 0;
    int src = 0;
    int matched = 0;
    for (const Row& row : r.rows) {
      if (row.pos >= accepted() || !agrees(r, row)) continue;
      ++matched;
      if (row.pos + 1 > upto) {
        upto = row.pos + 1;
        src = live_seq(row);
      }
    }
    SpecMetrics& mt = c_.metrics();
    if (r.speculative && adaptive_) {
      // A row's token was tested when the tokens before it on its path were accepted.
      const auto& A = c_.tokens();
      for (const Row& row : r.rows) {
        if (row.pos >= accepted() || row.path.empty()) continue;
        bool tested = true;
        for (size_t k = 0; k + 1 < row.path.size() && tested; ++k) tested = A[size_t(r.from) + k] == row.path[k];
        if (tested) tuner_.verdict(row.conf, A[size_t(row.pos)] == row.path.back());
      }
      cut_ = tuner_.cutoff();
    }
    if (r.speculative) {
      mt.drafted += int64_t(r.rows.size());
      mt.verified(matched);
      // With decay_reset, the draft being right again forgives its decay (the paper's §IV.B.2;
      // the artifact's n_reject returns to 0 on any accepted token). Off by default: on the
      // emulated cluster it costs pipeinfer@best 7-13 % (README), since a cutoff back at
      // p_accept also raises the branch threshold and shortens micro-batches again.
      if (matched > 0 && decay_reset_) cut_ = base_cutoff();
    }
    if (gained == 0) ++mt.runs_wasted;
    if (c_.done()) return false;
    if (r.speculative && upto > canon_len_ && shifts_ == shifts) {
      c_.kv_ops(target(), {{KvOpKind::copy, src, 0, canon_len_, upto}});
      canon_len_ = upto;
    }
    return true;
  }

  // Cancels speculative runs none of whose rows agrees with the accepted tokens any more.
  // (A row that agrees is never superfluous: each path's token at a position is launched once,
  // so its logits are not known before its run returns.)
  void prune() {
    if (!cancel_) return;
    std::vector<uint64_t> dropped;
    std::erase_if(inflight_, [&](const RunInfo& r) {
      const bool dead = r.speculative && std::none_of(r.rows.begin(), r.rows.end(), [&](const Row& x) { return agrees(r, x); });
      if (dead) dropped.push_back(r.id);
      return dead;
    });
    c_.cancel(target(), dropped);
  }

  // After the accepted tokens changed: frees the branches that disagree with them, makes sure
  // the newest token is in flight, and gives every branch the cells of the accepted tokens.
  void settle() {
    const int32_t n = accepted();
    std::vector<KvOp> ops, draft_ops;
    bool changed = false;
    std::erase_if(branches_, [&](const Branch& b) {
      if (agrees(b)) return false;
      // The draft's cells of the accepted part of its path become the draft's canonical ones.
      const auto& A = c_.tokens();
      const int32_t same = int32_t(std::mismatch(b.path.begin(), b.path.end(), A.begin(), A.end()).first - b.path.begin());
      if (std::min(same, b.drafted) > draft_canon_) {
        draft_ops.push_back({KvOpKind::copy, b.seq, 0, draft_canon_, std::min(same, b.drafted)});
        draft_canon_ = std::min(same, b.drafted);
      }
      draft_ops.push_back({KvOpKind::remove, b.seq, -1, -1, -1});
      ops.push_back({KvOpKind::remove, b.seq, -1, -1, -1});
      free_.push_back(b.seq);
      changed = true;
      return true;
    });
    for (Branch& b : branches_) {
      if (int32_t(b.path.size()) >= n) continue;
      b.path = c_.tokens();
      b.resize(b.path.size());
      changed = true;
    }
    if (changed) drafting_ = false;  // the round's plan is stale; drafted tokens stay in the paths
    if (!ops.empty()) c_.kv_ops(target(), std::move(ops));

    // Who holds the cells of every accepted token: the canonical sequence, or a branch whose
    // run in flight carries the newest one. Nobody: a non-speculative run of it or, without
    // plain_runs, the next speculative run, whose first row it becomes (the canonical sequence
    // holds the tokens before it: verify() made their cells canonical). With max_runs in
    // flight (runs left to finish without cancel) no round could start: it runs alone then.
    int src = canon_len_ >= n ? 0 : -1;
    for (const Branch& b : branches_)
      if (src < 0 && b.launched >= n) src = b.seq;
    if (branches_.empty() && !free_.empty()) {
      branches_.push_back(new_branch(c_.tokens()));
      draft_ops.push_back({KvOpKind::copy, 0, branches_.back().seq, 0, draft_canon_});
      branches_.back().drafted = draft_canon_;
    }
    const bool defer = src < 0 && !plain_runs_ && canon_len_ >= n - 1 && !branches_.empty() && room_for_run();
    if (src < 0 && !defer) {
      Batch batch;
      batch.add(c_.tokens()[size_t(n) - 1], n - 1, seq_bit(0), true);
      inflight_.push_back(plain(c_.launch(target(), batch, false)));
      canon_len_ = n;
      src = 0;
    }
    if (!draft_ops.empty()) c_.kv_ops(draft(), std::move(draft_ops));
    const int32_t upto = defer ? n - 1 : n;
    for (Branch& b : branches_) {
      if (b.launched >= upto) continue;
      ops.push_back({KvOpKind::copy, defer ? 0 : src, b.seq, b.launched, upto});
      b.launched = upto;
    }
    if (!ops.empty()) c_.kv_ops(target(), std::move(ops));
  }

  Branch new_branch(std::vector<int32_t> path) {
    Branch b;
    b.id = ++branch_ids_;
    b.seq = free_.front();
    free_.pop_front();
    b.resize(path.size());
    b.path = std::move(path);
    return b;
  }

  Branch* find(uint64_t id) {
    auto it = std::find_if(branches_.begin(), branches_.end(), [&](const Branch& b) { return b.id == id; });
    return it == branches_.end() ? nullptr : &*it;
  }

  // A new speculative run is launched while fewer than max_runs runs are in flight, the main
  // branch is less than max_runs micro-batches ahead, and fewer than max_runs * max_micro_batch
  // target tokens are in flight: no more than a chain keeps in flight at most. A chain's runs
  // carry at most a micro-batch each, so for it the last bound never binds; a tree's runs carry
  // every branch's rows, so it keeps fewer runs in flight at the same target cost. The queue
  // in front of the target's stages is then shorter: an alternative's rows come back sooner
  // after the main branch's miss, and branches are chosen on fresher results.
  void pump() {
    // A draft run still in flight from a round the accepted tokens made stale holds answers
    // for branches that may live on (on_draft keeps them): wait for it rather than feed the
    // draft the same tokens again behind it.
    if (c_.done() || drafting_ || awaited_run_ != 0 || branches_.empty()) return;
    // Near the end of the context every branch may be launched to its last position.
    const bool more =
        std::any_of(branches_.begin(), branches_.end(), [&](const Branch& b) { return pending(b) > 0 || wants_more(b); });
    if (more && room_for_run()) start_round();
    // Without plain_runs, settle() may have left the newest token to the round that did not
    // start: adaptive mode's micro-batch can shrink between the two (a draft answer's latency
    // moves it), and then room_for_run() turned false. Settled again, it runs on its own.
    else if (!plain_runs_) settle();
  }

  // Whether the target's pipeline takes another speculative run (see pump()).
  bool room_for_run() const {
    size_t tokens = 0;
    for (const RunInfo& r : inflight_) tokens += r.rows.size();
    return int(inflight_.size()) < max_runs_ && branches_.front().launched - accepted() < max_runs_ * micro() &&
           tokens < size_t(max_runs_) * size_t(micro());
  }

  // A drafting round: the draft extends every branch alive now, all in one draft run per
  // step, until each has max_micro_batch tokens pending or its draft is no longer confident;
  // then the run is launched.
  void start_round() {
    drafting_ = true;
    branch_off();
    round_main_ = branches_.front().id;
    for (Branch& b : branches_) b.active = wants_more(b);
    draft_step();
  }

  // Tokens of a branch its next run carries: drafted ones, and without plain_runs the newest
  // accepted token when it is not in flight yet (which drafts_pending leaves out).
  int32_t pending(const Branch& b) const { return int32_t(b.path.size()) - b.launched; }
  int32_t drafts_pending(const Branch& b) const { return int32_t(b.path.size()) - std::max(b.launched, accepted()); }
  // The tokens a branch may add to one run: max_micro_batch, or twice that for an
  // alternative still behind the main branch's frontier, so that it catches up.
  int32_t room(const Branch& b) const {
    return b.path.size() < branches_.front().path.size() ? 2 * micro() : micro();
  }
  // Whether the draft should extend a branch: it has room in this run, and its next token's
  // position is inside the context (runs never go past it; the host shifts or ends there).
  bool wants_more(const Branch& b) const { return pending(b) < room(b) && int32_t(b.path.size()) < c_.n_ctx(); }

  // One draft run: every active branch's tokens the draft has not seen, with logits for the
  // last (the draft's next token for it).
  void draft_step() {
    bool reused = false;
    for (Branch& b : branches_) {
      if (!b.active || b.next_for != b.path.size() || b.next.empty()) continue;
      const std::vector<float> row = std::move(b.next);
      b.next.clear();
      take(b, row.data());
      reused = true;
    }
    if (reused) branch_off();
    Batch batch;
    std::vector<KvOp> ops;
    step_.clear();
    size_t room = size_t(std::max(1, c_.n_batch()));
    for (Branch& b : branches_) {
      if (!b.active || room == 0) continue;
      const int32_t end = int32_t(b.path.size());
      if (b.drafted >= end) {  // its last token's logits are wanted again: feed it once more
        ops.push_back({KvOpKind::remove, b.seq, -1, end - 1, -1});
        b.drafted = end - 1;
      }
      const int32_t upto = std::min(end, b.drafted + int32_t(room));
      for (int32_t pos = b.drafted; pos < upto; ++pos) batch.add(b.path[size_t(pos)], pos, seq_bit(b.seq), pos + 1 == end);
      room -= size_t(upto - b.drafted);
      b.drafted = upto;
      if (upto == end) step_.push_back({b.id, b.path.size()});
    }
    if (batch.size() == 0) {
      drafting_ = false;
      launch_speculative();
      return pump();
    }
    if (!ops.empty()) c_.kv_ops(draft(), std::move(ops));
    awaited_run_ = c_.launch(draft(), batch, false);
    draft_launched_ = Clock::now();
  }

  void on_draft(uint64_t run, const Logits& l) {
    if (run != awaited_run_) return;
    awaited_run_ = 0;
    if (adaptive_) tuner_.draft_step(std::chrono::duration<double>(Clock::now() - draft_launched_).count());
    const int V = c_.vocab();
    const std::vector<float> rows = rows_of(l, step_.size(), V, run);
    for (size_t k = 0; k < step_.size(); ++k) {
      Branch* b = find(step_[k].first);
      if (!b || b->path.size() != step_[k].second) continue;
      const float* row = rows.data() + k * size_t(V);
      if (drafting_) {
        take(*b, row);
      } else {
        // The accepted tokens moved on while the draft worked: its answer for a branch that is
        // still alive is kept for the next round.
        b->next.assign(row, row + V);
        b->next_for = b->path.size();
      }
    }
    if (!drafting_) return pump();
    branch_off();
    draft_step();
  }

  // The draft's logits after a branch's whole path: its next token, unless the draft's doubt
  // ends the branch's part of this round.
  void take(Branch& b, const float* row) {
    const int V = c_.vocab();
    const float conf = top_probability(row, V);
    // Every branch launches at least one drafted token per run, so that a branch the target
    // takes has its continuation in flight; only the main branch's doubt loosens the cutoff.
    const bool must = drafts_pending(b) == 0;
    if (conf < cutoff() && must && b.id == round_main_) {
      // Speculation would yield nothing and the head would idle: loosen the cutoff and
      // launch this one token anyway.
      cut_ = std::max(0.0f, cut_ - p_decay_);
    }
    if (conf < cutoff() && !must) {
      b.active = false;
      b.next.assign(row, row + V);
      b.next_for = b.path.size();
      return;
    }
    const int32_t top = Sampler::argmax(row, V);
    // The draft's candidates after its top token, likeliest first: one per alternative slot.
    const int k = std::min(V - 1, std::max(1, n_parallel_ - 1));
    std::vector<std::pair<int32_t, float>> cand;
    for (int t = 0; t < V; ++t) {
      if (t == top) continue;
      const float p = float(conf * std::exp(double(row[t] - row[top])));
      if (int(cand.size()) < k || p > cand.back().second) {
        if (int(cand.size()) == k) cand.pop_back();
        cand.insert(std::upper_bound(cand.begin(), cand.end(), p, [](float x, const auto& c) { return x > c.second; }), {t, p});
      }
    }
    b.path.push_back(top);
    b.prob.push_back(conf);
    b.runner.push_back(cand.front().first);
    b.runner_p.push_back(cand.front().second);
    b.more.emplace_back(cand.begin() + 1, cand.end());
    b.active = wants_more(b);
  }

  // How likely the draft thinks the target takes a branch: the product of its probabilities
  // for the branch's tokens beyond the accepted ones, up to where it left its parent.
  double value(const Branch& b) const {
    double v = 1;
    for (int32_t pos = accepted(); pos <= b.split_at && pos < int32_t(b.prob.size()); ++pos) v *= b.prob[size_t(pos)];
    return v;
  }

  // Frees a branch: its sequences in both pipelines (in order with the runs that wrote them).
  void drop(uint64_t id) {
    auto it = std::find_if(branches_.begin(), branches_.end(), [&](const Branch& b) { return b.id == id; });
    c_.kv_ops(target(), {{KvOpKind::remove, it->seq, -1, -1, -1}});
    c_.kv_ops(draft(), {{KvOpKind::remove, it->seq, -1, -1, -1}});
    free_.push_back(it->seq);
    branches_.erase(it);
  }

  // Spends the branch budget where the draft doubts. Every token the draft put on the main
  // branch and the target has not verified yet is a candidate: a branch that takes the
  // draft's runner-up there, worth the draft's probability of the main path up to it times
  // the runner-up's (which must exceed p_split plus the cutoff's adjustment: stricter deep in
  // a burst, looser after decay). The best candidates become branches while fewer than
  // n_parallel are alive, and replace less likely alternatives after that. Candidates behind
  // the draft's frontier count too: when the target passes an alternative, its slot goes to
  // the likeliest doubt still ahead, which the draft then extends.
  void branch_off() {
    const float threshold = p_split_ + (cutoff() - base_cutoff());
    for (;;) {
      if (branches_.empty()) return;
      const Branch& m = branches_.front();
      int32_t best = -1;
      double best_v = 0, path_p = 1;
      for (int32_t q = accepted(); q < int32_t(m.path.size()); path_p *= m.prob[size_t(q)], ++q) {
        const double v = path_p * m.runner_p[size_t(q)];
        if (m.runner[size_t(q)] >= 0 && m.runner_p[size_t(q)] > threshold && v > best_v) best = q, best_v = v;
      }
      if (best < 0) return;
      if (int(branches_.size()) >= n_parallel_) {
        const Branch* victim = nullptr;
        for (size_t i = 1; i < branches_.size(); ++i)
          if (!victim || value(branches_[i]) < value(*victim)) victim = &branches_[i];
        if (!victim || value(*victim) >= best_v) return;
        drop(victim->id);
      }
      if (free_.empty()) return;
      branch_at(best);
    }
  }

  // A new branch: the main branch's path up to q, then the runner-up there.
  void branch_at(int32_t q) {
    Branch& m = branches_.front();
    const int32_t alt = m.runner[size_t(q)];
    const float alt_p = m.runner_p[size_t(q)];
    // Taken: the next candidate there (if any) becomes the runner-up.
    auto& rest = m.more[size_t(q)];
    m.runner[size_t(q)] = rest.empty() ? -1 : rest.front().first;
    m.runner_p[size_t(q)] = rest.empty() ? 0.0f : rest.front().second;
    if (!rest.empty()) rest.erase(rest.begin());
    Branch c = new_branch({m.path.begin(), m.path.begin() + q});
    c.prob.assign(m.prob.begin(), m.prob.begin() + q);
    c.runner.assign(m.runner.begin(), m.runner.begin() + q);
    c.runner_p.assign(m.runner_p.begin(), m.runner_p.begin() + q);
    c.more.assign(m.more.begin(), m.more.begin() + q);
    c.path.push_back(alt);
    c.prob.push_back(alt_p);
    c.runner.push_back(-1);
    c.runner_p.push_back(0.0f);
    c.more.emplace_back();
    c.split_at = q;
    // It borrows the main branch's launched cells below q, and the draft's; the main branch's
    // pending tokens below q become rows the next run shares.
    c.launched = std::min(m.launched, q);
    c.drafted = std::min(m.drafted, q);
    c.active = drafting_ && wants_more(c);
    c_.kv_ops(target(), {{KvOpKind::copy, m.seq, c.seq, 0, c.launched}});
    c_.kv_ops(draft(), {{KvOpKind::copy, m.seq, c.seq, 0, c.drafted}});
    branches_.push_back(std::move(c));
  }

  // The draft confidence a token needs: the base cutoff plus the recovery factor for every
  // speculative run already launched since the last target result.
  float cutoff() const { return std::min(0.99f, cut_ + p_recovery_ * burst_); }
  // The cutoff's base (decay moves below it, bursts above): p_accept, or in adaptive mode the
  // tuner's. Likewise the micro-batch: max_micro_batch, or the tuner's choice (1 to
  // kAdaptiveMaxMicroBatch).
  float base_cutoff() const { return adaptive_ ? tuner_.cutoff() : p_accept_; }
  int micro() const { return adaptive_ ? tuner_.micro_batch() : max_micro_batch_; }

  // Launches every branch's pending tokens as one run, a row shared by branches once.
  void launch_speculative() {
    RunInfo r;
    r.speculative = true;
    r.from = accepted();
    Batch batch;
    const size_t cap = size_t(std::max(1, c_.n_batch()));
    for (Branch& b : branches_) {
      for (; b.launched < int32_t(b.path.size()) && r.rows.size() < cap; ++b.launched) {
        const int32_t pos = b.launched;
        std::vector<int32_t> path(b.path.begin() + r.from, b.path.begin() + pos + 1);
        auto same = std::find_if(r.rows.begin(), r.rows.end(), [&](const Row& x) { return x.pos == pos && x.path == path; });
        if (same != r.rows.end()) {
          same->owners.push_back({b.id, b.seq});
          batch.seqs[size_t(same - r.rows.begin())] |= seq_bit(b.seq);
          continue;
        }
        batch.add(b.path[size_t(pos)], pos, seq_bit(b.seq), true);
        r.rows.push_back({pos, std::move(path), {{b.id, b.seq}}, size_t(pos) < b.prob.size() ? b.prob[size_t(pos)] : 1.0f});
      }
    }
    if (r.rows.empty()) return;
    r.id = c_.launch(target(), batch, true);
    r.launched = Clock::now();
    r.in_flight = int(inflight_.size()) + 1;
    inflight_.push_back(std::move(r));
    ++burst_;  // each further run in this burst needs more confidence (cutoff())
  }

  StrategyHost& c_;
  const int max_micro_batch_ = c_.params().integer("max_micro_batch");
  const int max_runs_ = c_.params().integer("max_runs");
  const float p_accept_ = c_.params().real("p_accept");
  const float p_recovery_ = c_.params().real("p_recovery");
  const float p_decay_ = c_.params().real("p_decay");
  const bool cancel_ = c_.params().flag("cancel");
  const bool decay_reset_ = c_.params().flag("decay_reset");
  const int n_parallel_ = c_.params().integer("n_parallel");
  const float p_split_ = c_.params().real("p_split");
  const bool adaptive_ = c_.params().flag("adaptive");
  const bool plain_runs_ = c_.params().flag("plain_runs");
  // Adaptive mode starts from the static values (max_micro_batch, p_accept) until it has
  // measured enough to choose; it chooses micro-batches up to kAdaptiveMaxMicroBatch.
  PipeInferTuner tuner_{kAdaptiveMaxMicroBatch, max_micro_batch_, p_accept_};
  Clock::time_point draft_launched_{};
  std::deque<RunInfo> inflight_;
  std::deque<int> free_;
  std::vector<Branch> branches_;  // the main branch first
  uint64_t branch_ids_ = 0;
  int32_t canon_len_ = 0;    // the target's sequence 0 holds the accepted tokens' cells up to here
  int32_t draft_canon_ = 0;  // the draft's sequence 0 holds the accepted tokens' cells up to here
  // The drafting round: its main branch, and the draft run awaited with the branches it
  // answers for (branch id, path length asked about), in row order.
  bool drafting_ = false;
  uint64_t round_main_ = 0;
  std::vector<std::pair<uint64_t, size_t>> step_;
  uint64_t awaited_run_ = 0;  // the draft run in flight (0: none)
  int accepting_src_ = 0;  // verify(): live_seq of the row whose token is being accepted
  int shifts_ = 0;         // context shifts so far
  float cut_;
  int burst_ = 0;
};

}  // namespace

StrategyInfo strategy_info_pipeinfer() {
  StrategyInfo s;
  s.name = "pipeinfer";
  s.summary = "PipeInfer: the newest accepted token is always in a run in flight (a non-speculative run of it, unless a valid speculative run already carries it; with `plain_runs` off the next speculative run carries it as its first row); whenever fewer than "
              "`max_runs` target runs are in flight the draft pipeline proposes a micro-batch of 1 to `max_micro_batch` tokens, launched "
              "as a speculative run in its branch's KV sequence (canonical sequence 0 holds accepted tokens); the "
              "draft's confidence cutoff rises by `p_recovery` for every further speculative run in a burst and falls by "
              "`p_decay` when speculation would yield nothing, in which case the head launches the one token anyway "
              "rather than let the pipeline idle; runs whose every row was rejected are cancelled on the priority path and "
              "stages drop them, between layers if they have started; with `n_parallel` > 1 up to that many branches "
              "are alive: unverified draft tokens whose runner-up clears `p_split` start alternatives (the likeliest "
              "first, replacing less likely ones), every run extends every branch, and a rejection that an alternative "
              "foresaw does not drain the pipeline";
  s.roles = {kTargetRole, kDraftRole};
  s.params = {
      {"max_micro_batch", ParamType::Int, 1, 16, 4, "draft tokens per speculative run (per branch)", {"--micro-batch"}},
      {"max_runs", ParamType::Int, 1, 30, 4, "target runs in flight", {"--max-runs"}},
      {"p_accept", ParamType::Float, 0, 1, 0.5, "base draft confidence cutoff", {"--p-accept", "--pa"}},
      {"p_recovery", ParamType::Float, 0, 1, 0.05, "cutoff increase per speculative run in a burst", {"--p-recovery", "--pr"}},
      {"p_decay", ParamType::Float, 0, 1, 0.05, "cutoff decrease when speculation yields nothing", {"--p-decay", "--pd"}},
      {"decay_reset", ParamType::Bool, 0, 1, 0, "the cutoff's decay ends when the target accepts a draft token (the paper's rule)", {"--decay-reset"}},
      {"cancel", ParamType::Bool, 0, 1, 1, "cancel invalid and superfluous runs early", {"--no-cancel"}},
      {"n_parallel", ParamType::Int, 1, 8, 1, "most speculative branches alive at once (1: a chain; the artifact's -np, its parallel drafting sequences)", {"--n-parallel", "--np"}},
      {"p_split", ParamType::Float, 0, 1, 0.8, "draft probability (plus the cutoff's adjustment) a non-top candidate needs to become a branch", {"--p-split", "--ps"}},
      {"plain_runs", ParamType::Bool, 0, 1, 1, "launch the newest accepted token as a run of its own when no run in flight carries it (the paper's rule); off: it is the first row of the next speculative run, which a fast draft has ready before a run of its own would leave the first stage", {"--no-plain-runs"}},
      {"adaptive", ParamType::Bool, 0, 1, 0, "choose the micro-batch (1 to 16; max_micro_batch is where it starts) and the base cutoff online from measured acceptance and run latencies (beyond the paper; speculation/pipeinfer_tuner.hpp)", {"--adaptive"}},
  };
  s.make = [](StrategyHost& h) { return std::make_unique<PipeInfer>(h); };
  // The canonical sequence 0 and branches 1 .. n_parallel + 1.
  s.sequences = [](const StrategyParams& p, const std::set<std::string>&) { return p.integer("n_parallel") + 2; };
  // A chain's rows are one cell per position (a dead run's cells go before a run at the same
  // positions is placed). Each branch beside the first may hold, at positions the others hold
  // too, the rows of every run in flight, max_micro_batch each.
  s.spare_cells = [](const StrategyParams& p, const std::set<std::string>&) {
    const int micro = p.flag("adaptive") ? kAdaptiveMaxMicroBatch : p.integer("max_micro_batch");
    return (p.integer("n_parallel") - 1) * p.integer("max_runs") * micro;
  };
  return s;
}

}  // namespace specmesh
