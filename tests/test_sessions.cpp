// Several sessions at once in one runtime: each gives exactly the tokens it gives alone, whatever
// runs beside it (other strategies, cancels, errors); admission is bounded; requests name
// their strategy; and a full context either shifts (llama.cpp's context shift, keys re-rotated)
// or ends the generation with a clear error.
#include <gtest/gtest.h>

#include <algorithm>

#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "processes.hpp"
#include "refdata.hpp"
#include "shifting_reference.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/sampler.hpp"
#include "specmesh/runtime.hpp"
#include "synthetic_model.hpp"

using namespace specmesh;
using specmesh::test::refdata;
using specmesh::test::shifting_reference;

namespace {

const char* const kTarget = "gguf-models/stories260K.gguf";
const char* const kDraft = "gguf-models/stories260K-draft-tiny.gguf";

// The target alone, or with a draft (strategies ar, spec and pipeinfer), configured for `ar`.
Topology setup(int n_ctx, bool with_draft) {
  std::map<std::string, ModelSpec> roles;
  if (with_draft) roles["draft"] = {"draft", refdata(kDraft), ""};
  Topology t = Topology::single_process({"target", refdata(kTarget), ""}, roles, 1);
  t.run.strategy = "ar";
  t.run.n_ctx = n_ctx;
  t.run.temperature = 0;
  return t;
}

RuntimeOptions sessions(int max_sessions, int max_queued = 16) {
  RuntimeOptions o;
  o.max_sessions = max_sessions;
  o.max_queued = max_queued;
  return o;
}

struct Ask {
  std::string prompt, strategy;
  int n = 48;
  int cancel_after = 0;  // > 0: Generation::cancel once this many tokens arrived
};

GenerationRequest request_of(const Ask& a) {
  GenerationRequest r;
  r.prompt = a.prompt;
  r.n_predict = a.n;
  r.ignore_eos = true;
  r.strategy = a.strategy;
  return r;
}

// Runs every request at once; a request with cancel_after calls Generation::cancel once that
// many of its tokens have arrived (from its token callback, so the cut does not depend on how
// the threads are scheduled).
std::vector<GenerationResult> run_together(Runtime& rt, const std::vector<Ask>& asks) {
  std::vector<std::unique_ptr<Generation>> gens;
  std::vector<std::shared_ptr<std::atomic<Generation*>>> handles;
  for (const Ask& a : asks) {
    auto handle = std::make_shared<std::atomic<Generation*>>(nullptr);
    auto count = std::make_shared<int>(0);
    handles.push_back(handle);
    gens.push_back(rt.submit(request_of(a), [handle, count, after = a.cancel_after](int32_t, const std::string&) {
      if (after > 0 && ++*count >= after)
        if (Generation* g = handle->load()) g->cancel();
      return true;
    }));
    handles.back()->store(gens.back().get());
  }
  std::vector<GenerationResult> out;
  for (auto& g : gens) out.push_back(g->wait());
  return out;
}

bool is_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

TEST(Sessions, ConcurrentMixedStrategiesEachGiveTheirSingleSessionIds) {
  SPECMESH_REQUIRE_REFDATA();
  const std::vector<Ask> asks = {
      {"Once upon a time", "ar"},
      {"The little dog", "spec"},
      {"Lily and Ben went", "pipeinfer"},
      {"One day, a girl", "ar"},
      {"Tom had a red ball", "ar", 200, 10},
      {"The sun was", "pipeinfer", 200, 8},
      {"A cat sat", "spec", 200, 6},
      {"Mom said", ""},  // the configuration's strategy
  };
  // Alone: one session at a time, each with the whole of the same per-session context.
  std::vector<std::vector<int32_t>> alone;
  {
    Runtime rt(setup(256, true), sessions(1));
    for (const Ask& a : asks) {
      GenerationResult r = rt.generate(request_of(a));
      ASSERT_TRUE(r.ok()) << a.strategy << ": " << r.error;
      ASSERT_EQ(int(r.ids.size()), a.n);
      alone.push_back(r.ids);
    }
  }
  Runtime rt(setup(4 * 256, true), sessions(4));
  ASSERT_EQ(rt.session_context(), 256);
  for (int round = 0; round < 2; ++round) {
    const auto together = run_together(rt, asks);
    for (size_t i = 0; i < asks.size(); ++i) {
      const GenerationResult& r = together[i];
      EXPECT_TRUE(r.ok()) << asks[i].strategy << ": " << r.error;
      if (asks[i].cancel_after == 0) {
        EXPECT_EQ(r.ids, alone[i]) << "request " << i << " (" << asks[i].strategy << ") round " << round;
        EXPECT_EQ(r.finish_reason, FinishReason::length);
      } else {
        EXPECT_EQ(r.finish_reason, FinishReason::cancelled) << "request " << i;
        EXPECT_GE(int(r.ids.size()), asks[i].cancel_after) << "request " << i;
        EXPECT_LT(int(r.ids.size()), asks[i].n) << "request " << i << " was not cancelled";
        EXPECT_TRUE(is_prefix(r.ids, alone[i])) << "request " << i << " (" << asks[i].strategy << ")";
      }
    }
  }
  // The head counts a session as running until it has cleared it away, just after its result.
  RuntimeStatus s = rt.status();
  for (int i = 0; i < 500 && s.sessions_running > 0; ++i, s = rt.status())
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(s.health, Health::ready);
  EXPECT_EQ(s.sessions_running, 0);
  EXPECT_EQ(s.sessions_queued, 0);
}

TEST(Sessions, ArDecodeStepsOfConcurrentSessionsShareTargetRuns) {
  SPECMESH_REQUIRE_REFDATA();
  const std::vector<Ask> asks = {{"Once upon a time", "ar", 64},
                                 {"The little dog", "ar", 64},
                                 {"Lily and Ben went", "ar", 64},
                                 {"One day, a girl", "ar", 64}};
  Runtime rt(setup(4 * 128, false), sessions(4));
  const auto results = run_together(rt, asks);
  for (const auto& r : results) ASSERT_TRUE(r.ok()) << r.error;
  uint64_t runs = 0;
  for (const auto& c : rt.stage_counters()) runs += c.runs;
  // Alone each session takes 64 target runs (its prompt and 63 decode steps); merged, the
  // four together take far fewer than 4 x 64.
  EXPECT_LT(runs, uint64_t(4 * 64 * 3 / 4)) << "decode steps were not merged into shared runs";
}

TEST(Sessions, AdmissionBeyondTheBoundFailsAtOnceWithBusy) {
  SPECMESH_REQUIRE_REFDATA();
  Runtime rt(setup(512, false), sessions(1, 1));
  // The first session runs slowly (its client takes 20 ms per token), the second waits for it.
  auto first = rt.submit({.prompt = "Once upon a time", .n_predict = 200, .ignore_eos = true},
                         [&](int32_t, const std::string&) {
                           std::this_thread::sleep_for(std::chrono::milliseconds(20));
                           return true;
                         });
  auto second = rt.submit({.prompt = "The little dog", .n_predict = 16, .ignore_eos = true});
  for (int i = 0; i < 500 && rt.status().sessions_queued < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const auto t0 = std::chrono::steady_clock::now();
  GenerationResult third = rt.generate({.prompt = "Lily", .n_predict = 16});
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(third.ok());
  EXPECT_EQ(third.error_kind, ErrorKind::busy) << third.error;
  EXPECT_NE(third.error.find("busy"), std::string::npos) << third.error;
  EXPECT_LT(ms, 1000) << "a refused request must not wait";
  const RuntimeStatus s = rt.status();
  EXPECT_EQ(s.sessions_running, 1);
  EXPECT_EQ(s.sessions_queued, 1);
  first->cancel();
  GenerationResult a = first->wait();
  EXPECT_TRUE(a.ok()) << a.error;
  EXPECT_EQ(a.finish_reason, FinishReason::cancelled);
  GenerationResult b = second->wait();
  ASSERT_TRUE(b.ok()) << b.error;
  EXPECT_EQ(b.ids.size(), 16u);
  // Once they are done, requests are admitted again.
  GenerationResult again = rt.generate({.prompt = "Lily", .n_predict = 4});
  EXPECT_TRUE(again.ok()) << again.error;
}

TEST(Sessions, DoneCallbackGetsTheResultOnceBeforeWaitReturns) {
  SPECMESH_REQUIRE_REFDATA();
  Runtime rt(setup(256, false), sessions(2, 0));
  struct Seen {
    std::atomic<int> calls{0};
    GenerationResult result;
  };
  auto watch = [](Seen& s) {
    return [&s](const GenerationResult& r) {
      s.result = r;
      ++s.calls;
    };
  };
  // A finished one, a cancelled one, and one refused at once (on this thread, before submit returns).
  Seen done, cancelled, refused;
  auto a = rt.submit({.prompt = "Once upon a time", .n_predict = 8, .ignore_eos = true}, {}, watch(done));
  auto b = rt.submit({.prompt = "The little dog", .n_predict = 400, .ignore_eos = true},
                     [](int32_t, const std::string&) {
                       std::this_thread::sleep_for(std::chrono::milliseconds(5));
                       return true;
                     },
                     watch(cancelled));
  auto c = rt.submit({.prompt = "Lily", .n_predict = 4, .strategy = "nonesuch"}, {}, watch(refused));
  EXPECT_EQ(refused.calls, 1);
  EXPECT_EQ(refused.result.error_kind, ErrorKind::invalid_request);
  b->cancel();
  const GenerationResult ra = a->wait(), rb = b->wait(), rc = c->wait();
  EXPECT_EQ(done.calls, 1);
  EXPECT_EQ(done.result.ids, ra.ids);
  EXPECT_EQ(ra.ids.size(), 8u);
  EXPECT_EQ(cancelled.calls, 1);
  EXPECT_EQ(cancelled.result.finish_reason, FinishReason::cancelled);
  EXPECT_EQ(cancelled.result.ids, rb.ids);
  EXPECT_EQ(refused.calls, 1);
  EXPECT_EQ(rc.error, refused.result.error);
}

TEST(Sessions, OneSessionsErrorOrCancelLeavesAnothersIdsAlone) {
  SPECMESH_REQUIRE_REFDATA();
  const int ctx = 64;
  std::vector<int32_t> alone;
  {
    Runtime rt(setup(ctx, false), sessions(1));
    auto r = rt.generate({.prompt = "Once upon a time", .n_predict = 40, .ignore_eos = true});
    ASSERT_TRUE(r.ok()) << r.error;
    alone = r.ids;
  }
  Runtime rt(setup(3 * ctx, false), sessions(3));
  // Beside it: one session that runs its context full (an error mid-way), one cancelled.
  auto full = rt.submit({.prompt = "The little dog", .n_predict = -1, .ignore_eos = true});
  auto steady = rt.submit({.prompt = "Once upon a time", .n_predict = 40, .ignore_eos = true});
  std::atomic<int> seen{0};
  // Its client is slow (5 ms a token), and cancels from its own thread.
  auto cancelled = rt.submit({.prompt = "Lily and Ben", .n_predict = 60, .ignore_eos = true},
                             [&](int32_t, const std::string&) {
                               ++seen;
                               std::this_thread::sleep_for(std::chrono::milliseconds(5));
                               return true;
                             });
  while (seen.load() < 5) std::this_thread::sleep_for(std::chrono::microseconds(200));
  cancelled->cancel();
  GenerationResult f = full->wait(), s = steady->wait(), c = cancelled->wait();
  EXPECT_EQ(f.error_kind, ErrorKind::context_full) << f.error;
  EXPECT_NE(f.error.find("context of 64 tokens is full"), std::string::npos) << f.error;
  EXPECT_EQ(f.finish_reason, FinishReason::error);
  EXPECT_EQ(int(f.prompt_ids.size() + f.ids.size()), ctx + 1) << "every cell of the context used, and one token more";
  EXPECT_EQ(c.finish_reason, FinishReason::cancelled);
  EXPECT_LT(c.ids.size(), 60u);
  ASSERT_TRUE(s.ok()) << s.error;
  EXPECT_EQ(s.ids, alone);
}

TEST(Sessions, RequestStrategyAndParametersAreChecked) {
  SPECMESH_REQUIRE_REFDATA();
  Runtime alone_rt(setup(256, false), sessions(2));
  auto r = alone_rt.generate({.prompt = "Once", .n_predict = 4, .strategy = "spec"});
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request);
  EXPECT_NE(r.error.find("role \"draft\""), std::string::npos) << r.error;
  r = alone_rt.generate({.prompt = "Once", .n_predict = 4, .strategy = "nope"});
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request);
  EXPECT_NE(r.error.find("unknown strategy \"nope\""), std::string::npos) << r.error;
  r = alone_rt.generate({.prompt = "Once", .n_predict = -2});
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request) << r.error;

  Runtime rt(setup(256, true), sessions(2));
  const std::vector<int32_t> ar = rt.generate({.prompt = "Once upon a time", .n_predict = 24, .ignore_eos = true}).ids;
  ASSERT_EQ(ar.size(), 24u);
  GenerationRequest bad{.prompt = "Once", .n_predict = 4, .strategy = "spec"};
  bad.params = {{"n_draft", "0"}};
  r = rt.generate(bad);
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request);
  EXPECT_NE(r.error.find("n_draft"), std::string::npos) << r.error;
  bad.params = {{"n_draft", "two"}};
  r = rt.generate(bad);
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request);
  EXPECT_NE(r.error.find("'two'"), std::string::npos) << r.error;
  bad.params = {{"max_runs", "2"}};
  r = rt.generate(bad);
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request);
  EXPECT_NE(r.error.find("has no parameter 'max_runs'"), std::string::npos) << r.error;
  GenerationRequest good{.prompt = "Once upon a time", .n_predict = 24, .ignore_eos = true, .strategy = "spec"};
  good.params = {{"n_draft", "2"}, {"p_accept", "0.1"}};
  r = rt.generate(good);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.metrics.strategy, "spec");
  EXPECT_GT(r.metrics.drafted, 0);
  EXPECT_EQ(r.ids, ar);
}

TEST(Sessions, APromptLongerThanTheContextIsContextFull) {
  SPECMESH_REQUIRE_REFDATA();
  Runtime rt(setup(32, false), sessions(2));
  ASSERT_EQ(rt.session_context(), 16);
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "Once upon a time ";
  auto r = rt.generate({.prompt = prompt, .n_predict = 4});
  EXPECT_EQ(r.error_kind, ErrorKind::context_full) << r.error;
  EXPECT_NE(r.error.find("more than the session's context of 16 tokens"), std::string::npos) << r.error;
  EXPECT_TRUE(r.ids.empty());
}

namespace {

// Greedy logits of `next` after `prompt`, the prompt cached at positions from `pos0` and then
// moved by `delta` (0: not moved), the next token at the position after the prompt's last.
std::vector<float> logits_after(const Model& m, const std::vector<int32_t>& prompt, int32_t pos0, int32_t delta,
                                int32_t next, bool rotate = true, DType kv_type = DType::F32) {
  Context ctx(m, {.n_ctx = 128, .kv_type = kv_type});
  Batch b;
  for (size_t i = 0; i < prompt.size(); ++i) b.add(prompt[i], pos0 + int32_t(i), seq_bit(0), false);
  ctx.forward(b);
  if (rotate) ctx.shift_positions(0, -1, -1, delta);
  else ctx.kv().seq_add(0, -1, -1, delta);
  Batch d;
  d.add(next, pos0 + delta + int32_t(prompt.size()), seq_bit(0), true);
  return ctx.forward(d).logits;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

void expect_shift_equals_recompute(const Model& m, const std::string& what) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back(int32_t(5 + (i * 37) % (m.hparams().n_vocab - 10)));
  // Attention under RoPE depends on relative positions only: a cache moved as a whole and its
  // keys re-rotated gives what a cache computed at the new positions gives.
  for (auto [from, delta] : {std::pair{0, 9}, std::pair{30, -30}, std::pair{3, 40}}) {
    const auto moved = logits_after(m, prompt, from, delta, 7);
    const auto direct = logits_after(m, prompt, from + delta, 0, 7);
    EXPECT_LT(max_diff(moved, direct), 2e-3f) << what << ": from " << from << " by " << delta;
    // Moving the positions without rotating the keys is wrong, and this test sees it.
    const auto unrotated = logits_after(m, prompt, from, delta, 7, false);
    EXPECT_GT(max_diff(unrotated, direct), 1e-2f) << what << ": from " << from << " by " << delta;
    // An F16 cache rounds the re-rotated keys once more (as llama.cpp's K-shift does): that
    // moves these logits by up to 7.5e-3 (measured; F32: 4e-6); unrotated keys move them by
    // more than 1.5.
    const auto moved16 = logits_after(m, prompt, from, delta, 7, true, DType::F16);
    const auto direct16 = logits_after(m, prompt, from + delta, 0, 7, true, DType::F16);
    EXPECT_LT(max_diff(moved16, direct16), 2e-2f) << what << " (F16 cache): from " << from << " by " << delta;
  }
}

}  // namespace

TEST(ContextShift, ReRotatedKeysEqualKeysComputedAtTheNewPositions) {
  SPECMESH_REQUIRE_REFDATA();
  auto llama = Model::load(refdata(kTarget));
  ASSERT_EQ(llama->hparams().rope, RopeStyle::Interleaved);
  expect_shift_equals_recompute(*llama, "stories260K (interleaved rope)");
  auto qwen3 = test::synthetic_model("tiny-qwen3", 3);
  ASSERT_EQ(qwen3->hparams().rope, RopeStyle::Neox);
  expect_shift_equals_recompute(*qwen3, "tiny-qwen3 (neox rope)");
}

TEST(ContextShift, KvCacheMovesPositionsAndFreesCellsMovedBelowZero) {
  KvCache kv(8, 0, 1, 4);
  Batch b;
  for (int p = 0; p < 6; ++p) b.add(1, p, p < 3 ? seq_bit(0) | seq_bit(1) : seq_bit(0), false);
  kv.place(b);
  const auto moved = kv.seq_add(0, 2, -1, -3);  // positions 2..5 -> -1..2
  EXPECT_EQ(moved, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_TRUE(kv.cell(2).empty()) << "moved below position 0: freed";
  EXPECT_EQ(kv.cell(5).pos, 2);
  EXPECT_EQ(kv.seq_pos_max(0), 2);
  EXPECT_EQ(kv.seq_pos_max(1), 1);

  // A range of sequences moves each cell once, however many of them it is in (a session's
  // shift: its canonical cells are in its branch sequences too).
  KvCache shared(8, 0, 1, 4);
  Batch s;
  for (int32_t p = 0; p < 4; ++p) s.add(p, p, seq_bit(1) | seq_bit(2), false);
  s.add(9, 4, seq_bit(3), false);
  s.add(7, 4, seq_bit(5), false);  // another session's
  shared.place(s);
  EXPECT_EQ(shared.seq_add(1, 1, -1, -1, 3), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(shared.seq_pos_max(1), 2);
  EXPECT_EQ(shared.seq_pos_max(2), 2);
  EXPECT_EQ(shared.seq_pos_max(3), 3);
  EXPECT_EQ(shared.seq_pos_max(5), 4);
}


TEST(ContextShift, EveryStrategyGoesOnPastAFullContextAsLlamaCppDoes) {
  SPECMESH_REQUIRE_REFDATA();
  const int ctx = 64, n = 150;
  Runtime rt(setup(2 * ctx, true), sessions(2));
  ASSERT_EQ(rt.session_context(), ctx);
  const std::string prompt = "Once upon a time, there was a little girl";
  auto m = Model::load(refdata(kTarget));
  const auto prompt_ids = m->tokenizer().encode_prompt(prompt, false);
  for (const char* strategy : {"ar", "spec", "pipeinfer", "spec-tree", "triforce"})
  for (int n_keep : {0, 4}) {
    // Beside it, a plain session that must not notice.
    auto other = rt.submit({.prompt = "The little dog", .n_predict = 30, .ignore_eos = true, .strategy = "ar"});
    const bool tree = std::string(strategy) == "spec-tree";
    GenerationRequest req{.prompt = prompt, .n_predict = n, .ignore_eos = true, .strategy = tree ? "spec" : strategy,
                          .context_shift = true, .n_keep = n_keep};
    if (tree) req.params = {{"tree", "3,2,1"}, {"p_accept", "0.05"}};
    if (std::string(strategy) == "triforce")
      req.params = {{"budget", "32"}, {"chunk", "4"}, {"sink", "4"}, {"window", "24"}, {"rebuild_every", "16"}};
    // A tree's nodes (15 - its depth 3) and TriForce's middle level (gamma1 + gamma2 + 2) may
    // hold cells beside the tokens': their sessions' contexts are smaller by as many.
    const int n_ctx = rt.session_context(req);
    EXPECT_EQ(n_ctx, tree ? ctx - 12 : std::string(strategy) == "triforce" ? ctx - 10 : ctx) << strategy;
    const auto want = shifting_reference(*m, n_ctx, prompt_ids, n, n_keep);
    GenerationResult r = rt.generate(req);
    ASSERT_TRUE(r.ok()) << strategy << ": " << r.error;
    EXPECT_EQ(r.context, n_ctx);
    EXPECT_EQ(r.ids, want) << strategy << ", n_keep " << n_keep << ", first difference at token "
                           << std::mismatch(r.ids.begin(), r.ids.end(), want.begin(), want.end()).first - r.ids.begin()
                           << " of " << r.ids.size() << " (prompt " << prompt_ids.size() << ")";
    EXPECT_GE(r.context_shifts, 2);
    GenerationResult o = other->wait();
    EXPECT_TRUE(o.ok()) << o.error;
    EXPECT_EQ(o.ids.size(), 30u);
  }
  // Without the shift the same request ends where the context is full, with the tokens so far.
  GenerationResult r = rt.generate({.prompt = prompt, .n_predict = -1, .ignore_eos = true});
  EXPECT_EQ(r.error_kind, ErrorKind::context_full) << r.error;
  const auto want = shifting_reference(*m, ctx, prompt_ids, ctx + 1 - int(prompt_ids.size()), 0);
  EXPECT_EQ(r.ids, want);
}

// With the cache exactly one session's share, a speculation that held one cell more than its
// strategy's spare cells would fail with a full cache; each goes on through its shifts.
TEST(ContextShift, SpeculationStaysInsideTheSessionsShareOfTheCache) {
  SPECMESH_REQUIRE_REFDATA();
  const int ctx = 64, n = 150;
  Runtime rt(setup(ctx, true), sessions(1));
  const std::string prompt = "Once upon a time, there was a little girl";
  auto m = Model::load(refdata(kTarget));
  const auto prompt_ids = m->tokenizer().encode_prompt(prompt, false);
  const std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>> cases = {
      {"spec", {{"tree", "3,2,1"}, {"p_accept", "0"}}},
      {"spec", {{"tree", "6"}, {"p_accept", "0"}}},
      {"pipeinfer", {{"n_parallel", "3"}, {"p_split", "0.01"}, {"max_runs", "4"}, {"max_micro_batch", "2"}}},
      {"triforce", {{"budget", "32"}, {"chunk", "4"}, {"sink", "4"}, {"window", "24"}, {"gamma1", "3"}, {"gamma2", "4"}}}};
  for (const auto& [strategy, params] : cases) {
    GenerationRequest req{.prompt = prompt, .n_predict = n, .ignore_eos = true, .strategy = strategy,
                          .context_shift = true, .n_keep = 0};
    req.params = params;
    const int n_ctx = rt.session_context(req);
    EXPECT_LT(n_ctx, ctx) << strategy;
    GenerationResult r = rt.generate(req);
    ASSERT_TRUE(r.ok()) << strategy << ": " << r.error;
    EXPECT_EQ(r.ids, shifting_reference(*m, n_ctx, prompt_ids, n, 0)) << strategy;
    EXPECT_GE(r.context_shifts, 2) << strategy;
  }
  // A speculation that leaves a session no context is refused, with what to change: a tree of
  // 20 nodes, 2 deep, in a share of 16 cells.
  Runtime four(setup(ctx, true), sessions(4));
  GenerationResult r = four.generate({.prompt = "Once", .n_predict = 4, .strategy = "spec", .params = {{"tree", "5,3"}}});
  EXPECT_EQ(r.error_kind, ErrorKind::invalid_request) << r.error;
  EXPECT_NE(r.error.find("may hold 18 KV cells beyond one per token"), std::string::npos) << r.error;
  EXPECT_THROW(four.session_context({.prompt = "Once", .strategy = "nonesuch"}), std::invalid_argument);
}

TEST(ContextShift, GenerateTakesMinusOneAndContextShift) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string base = std::string(SPECMESH_CLI_PATH) + " generate -m " + refdata(kTarget) +
                           " -p 'Once upon a time' --temp 0 --ignore-eos -t 1 -c 48 --json";
  auto full = test::shell(base + " -n -1 2>/dev/null");
  EXPECT_NE(full.status, 0) << full.out;
  auto j = test::last_json(full.out);
  ASSERT_TRUE(j.is_object()) << full.out;
  EXPECT_EQ(j["error_kind"], "context_full") << full.out;
  auto shifted = test::shell(base + " -n 120 --context-shift 2>/dev/null");
  ASSERT_EQ(shifted.status, 0) << shifted.out;
  j = test::last_json(shifted.out);
  EXPECT_EQ(j["ids"].size(), 120u) << shifted.out;
  EXPECT_GE(j["stats"]["context_shifts"].get<int>(), 2) << shifted.out;
  auto zero = test::shell(base + " -n 0 2>&1");
  EXPECT_NE(zero.status, 0) << zero.out;
}
