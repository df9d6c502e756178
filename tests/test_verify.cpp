#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <algorithm>
#include <functional>
#include <memory>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "specmesh/speculation/verify.hpp"

using namespace specmesh;

namespace {

using Dist = std::vector<float>;

// ---------------------------------------------------------------------------------------------
// Greedy

// Rows of logits, one per position, flattened as the target's forward pass returns them.
std::vector<float> rows(const std::vector<std::vector<float>>& r) {
  std::vector<float> out;
  for (const auto& row : r) out.insert(out.end(), row.begin(), row.end());
  return out;
}

TEST(VerifyGreedy, AllAcceptedGivesTheBonusToken) {
  const auto l = rows({{0, 5, 1, 0}, {9, 1, 2, 3}, {0, 0, 0, 4}, {1, 0, 7, 0}});
  const std::vector<int32_t> draft = {1, 0, 3};
  const Verdict v = verify_greedy(draft, l.data(), 4);
  EXPECT_EQ(v.accepted, 3);
  EXPECT_EQ(v.next, 2);  // argmax of the row after all three drafts
}

TEST(VerifyGreedy, StopsAtTheFirstMismatch) {
  const auto l = rows({{0, 5, 1, 0}, {9, 1, 2, 3}, {0, 0, 0, 4}, {1, 0, 7, 0}});
  // draft[1] = 2 but row 1 wants 0; draft[2] matching its row must not matter.
  const std::vector<int32_t> draft = {1, 2, 3};
  const Verdict v = verify_greedy(draft, l.data(), 4);
  EXPECT_EQ(v.accepted, 1);
  EXPECT_EQ(v.next, 0);

  const std::vector<int32_t> wrong_first = {2, 0, 3};
  const Verdict w = verify_greedy(wrong_first, l.data(), 4);
  EXPECT_EQ(w.accepted, 0);
  EXPECT_EQ(w.next, 1);
}

TEST(VerifyGreedy, TiesGoToTheLowestId) {
  // Tokens 1 and 2 tie in row 0: only 1 counts as the argmax, as in Sampler::argmax.
  const auto l = rows({{1, 3, 3, 0}, {2, 2, 2, 2}});
  const std::vector<int32_t> high = {2};
  Verdict v = verify_greedy(high, l.data(), 4);
  EXPECT_EQ(v.accepted, 0);
  EXPECT_EQ(v.next, 1);
  const std::vector<int32_t> low = {1};
  v = verify_greedy(low, l.data(), 4);
  EXPECT_EQ(v.accepted, 1);
  EXPECT_EQ(v.next, 0);  // all-equal row
  EXPECT_EQ(v.next, Sampler::argmax(l.data() + 4, 4));
}

TEST(VerifyGreedy, EmptyDraftIsOnePlainStep) {
  const auto l = rows({{0, 1, 4, 2}});
  const Verdict v = verify_greedy({}, l.data(), 4);
  EXPECT_EQ(v.accepted, 0);
  EXPECT_EQ(v.next, 2);
}

TEST(VerifyGreedy, RejectsBadArguments) {
  const auto l = rows({{0, 1}, {1, 0}});
  const std::vector<int32_t> out_of_range = {2};
  EXPECT_THROW(verify_greedy(out_of_range, l.data(), 2), std::invalid_argument);
  const std::vector<int32_t> ok = {1};
  EXPECT_THROW(verify_greedy(ok, l.data(), 0), std::invalid_argument);
  EXPECT_THROW(verify_greedy(ok, nullptr, 2), std::invalid_argument);
}

TEST(VerifyTreeGreedy, FollowsTheMatchingBranch) {
  // Tree:  context -> n0 (tok 1) -> n2 (tok 3)
  //                -> n1 (tok 2) -> n3 (tok 0) -> n4 (tok 3)
  //                              -> n5 (tok 1)
  const std::vector<int32_t> tok = {1, 2, 3, 0, 3, 1};
  const std::vector<int> par = {-1, -1, 0, 1, 3, 1};
  // Row 0 (context) wants 2 -> n1; row 2 (after n1) wants 1 -> n5 (second child, after n3);
  // row 6 (after n5) wants 2, which has no child: next = 2.
  std::vector<std::vector<float>> r(7, std::vector<float>{0, 0, 0, 0});
  r[0] = {0, 1, 5, 0};
  r[2] = {0, 4, 0, 1};
  r[6] = {0, 0, 3, 1};
  const auto l = rows(r);
  const TreeVerdict v = verify_tree_greedy(tok, par, l.data(), 4);
  EXPECT_EQ(v.path, (std::vector<int>{1, 5}));
  EXPECT_EQ(v.accepted(), 2);
  EXPECT_EQ(v.next, 2);
}

TEST(VerifyTreeGreedy, MatchesTheChainVersionOnChains) {
  const auto l = rows({{0, 5, 1, 0}, {9, 1, 2, 3}, {0, 0, 0, 4}, {1, 0, 7, 0}});
  const std::vector<int> par = {-1, 0, 1};
  const std::vector<std::vector<int32_t>> drafts = {{1, 0, 3}, {1, 2, 3}, {0, 0, 3}, {1, 0, 0}};
  for (const auto& draft : drafts) {
    const Verdict c = verify_greedy(draft, l.data(), 4);
    const TreeVerdict t = verify_tree_greedy(draft, par, l.data(), 4);
    EXPECT_EQ(t.accepted(), c.accepted);
    EXPECT_EQ(t.next, c.next);
  }
}

TEST(VerifyTreeGreedy, RejectsBadParents) {
  const auto l = rows({{0, 1}, {1, 0}, {1, 0}});
  const std::vector<int32_t> tok = {1, 0};
  EXPECT_THROW(verify_tree_greedy(tok, std::vector<int>{-1, 1}, l.data(), 2), std::invalid_argument);
  EXPECT_THROW(verify_tree_greedy(tok, std::vector<int>{-2, 0}, l.data(), 2), std::invalid_argument);
  EXPECT_THROW(verify_tree_greedy(tok, std::vector<int>{-1}, l.data(), 2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Stochastic: exactness by chi-square

// Upper 0.001 quantiles of the chi-square distribution (computed from the regularised
// incomplete gamma function; they match the standard tables: 1 dof 10.828, 4 dof 18.467).
double chi2_critical_001(int dof) {
  static const std::map<int, double> table = {{1, 10.828}, {2, 13.816}, {3, 16.266}, {4, 18.467},
                                              {5, 20.515}, {48, 84.037}};
  auto it = table.find(dof);
  if (it == table.end()) throw std::logic_error("no chi-square critical value for " + std::to_string(dof) + " dof");
  return it->second;
}

struct ChiSquare {
  double value = 0;
  int dof = 0;
  int impossible = 0;  // draws of outcomes the target gives zero probability
};

// Pearson's statistic of observed counts against expected probabilities. Outcomes of zero
// probability are left out of the statistic and counted separately: any such draw is wrong.
ChiSquare chi_square(const std::vector<long>& count, const std::vector<double>& prob) {
  long n = 0;
  for (long c : count) n += c;
  ChiSquare r;
  int cells = 0;
  for (size_t i = 0; i < count.size(); ++i) {
    if (prob[i] <= 0) {
      r.impossible += count[i];
      continue;
    }
    const double e = double(n) * prob[i];
    r.value += (count[i] - e) * (count[i] - e) / e;
    ++cells;
  }
  r.dof = cells - 1;
  return r;
}

std::vector<double> normalise(const Dist& d) {
  double s = 0;
  for (float v : d) s += v;
  std::vector<double> out;
  for (float v : d) out.push_back(v / s);
  return out;
}

using ChainVerifier = std::function<Verdict(std::span<const int32_t>, std::span<const Dist>, std::span<const Dist>, Sampler&)>;

const ChainVerifier exact = [](std::span<const int32_t> d, std::span<const Dist> p, std::span<const Dist> q, Sampler& s) {
  return verify_stochastic(d, p, q, s);
};

// Deliberately wrong verifiers, to show the harness can fail.
const ChainVerifier accept_always = [](std::span<const int32_t> d, std::span<const Dist> p, std::span<const Dist>,
                                       Sampler& s) { return Verdict{int(d.size()), s.sample_from(p[d.size()])}; };
// Right acceptance test, but a rejection resamples from p instead of the residual max(0, p - q).
const ChainVerifier resample_from_p = [](std::span<const int32_t> d, std::span<const Dist> p, std::span<const Dist> q,
                                         Sampler& s) {
  for (size_t i = 0; i < d.size(); ++i) {
    const auto pn = normalise(p[i]), qn = normalise(q[i]);
    if (s.uniform() < pn[d[i]] / qn[d[i]]) continue;
    return Verdict{int(i), s.sample_from(p[i])};
  }
  return Verdict{int(d.size()), s.sample_from(p[d.size()])};
};

// One draft token x ~ q, verified against p; the emitted first token is x when accepted,
// else the correction. Its distribution must be p.
ChiSquare first_token_test(const ChainVerifier& verify, const Dist& p, const Dist& q, int trials, uint64_t seed) {
  Sampler rng({.temperature = 1.0f, .seed = seed});
  std::vector<long> count(p.size());
  const std::vector<Dist> ps = {p, p}, qs = {q};
  for (int t = 0; t < trials; ++t) {
    const int32_t x = rng.sample_from(q);
    const std::vector<int32_t> draft = {x};
    const Verdict v = verify(draft, ps, qs, rng);
    ++count[v.accepted ? x : v.next];
  }
  return chi_square(count, normalise(p));
}

struct Pair {
  const char* name;
  Dist p, q;
};

const Dist kP = {0.30f, 0.25f, 0.20f, 0.10f, 0.10f, 0.05f};
const Dist kQ = {0.05f, 0.10f, 0.15f, 0.20f, 0.25f, 0.25f};

const std::vector<Pair> kPairs = {
    {"overlapping", kP, kQ},
    {"q has no mass where p has", {0.25f, 0.25f, 0.2f, 0.15f, 0.1f, 0.05f}, {0.5f, 0.5f, 0, 0, 0, 0}},
    {"p equals q", {0.1f, 0.2f, 0.3f, 0.15f, 0.15f, 0.1f}, {0.1f, 0.2f, 0.3f, 0.15f, 0.15f, 0.1f}},
    {"disjoint supports", {0, 0, 0, 0.3f, 0.3f, 0.4f}, {0.5f, 0.3f, 0.2f, 0, 0, 0}},
    {"p inside q's support", {0, 0.5f, 0.5f, 0, 0, 0}, {1, 1, 1, 1, 1, 1}},
    {"one-hot draft", kP, {0, 0, 1, 0, 0, 0}},
    {"unnormalised weights", {0.9f, 0.75f, 0.6f, 0.3f, 0.3f, 0.15f}, {0.025f, 0.05f, 0.075f, 0.1f, 0.125f, 0.125f}},
};

constexpr int kTrials = 60000;

TEST(VerifyStochastic, FirstTokenFollowsTheTarget) {
  uint64_t seed = 1000;
  for (const Pair& pr : kPairs) {
    const ChiSquare c = first_token_test(exact, pr.p, pr.q, kTrials, seed++);
    const double crit = chi2_critical_001(c.dof);
    std::printf("[  chi2    ] first token, %-26s chi2 = %7.3f  (%d dof, critical %.3f at p=0.001)\n", pr.name, c.value,
                c.dof, crit);
    EXPECT_EQ(c.impossible, 0) << pr.name;
    EXPECT_LT(c.value, crit) << pr.name;
  }
}

TEST(VerifyStochastic, OneHotTargetIsAlwaysItsToken) {
  // A greedy target: whatever the draft proposes, the emitted token is the target's.
  const Dist p = {0, 0, 0, 1, 0, 0};
  Sampler rng({.temperature = 1.0f, .seed = 5});
  const std::vector<Dist> ps = {p, p}, qs = {kQ};
  for (int t = 0; t < 5000; ++t) {
    const std::vector<int32_t> draft = {rng.sample_from(kQ)};
    const Verdict v = verify_stochastic(draft, ps, qs, rng);
    ASSERT_EQ(v.accepted ? draft[0] : v.next, 3);
  }
}

TEST(VerifyStochastic, NegativeControlsFail) {
  const ChiSquare always = first_token_test(accept_always, kP, kQ, kTrials, 77);
  const ChiSquare from_p = first_token_test(resample_from_p, kP, kQ, kTrials, 78);
  std::printf("[  chi2    ] negative control accept-always:   chi2 = %.1f (%d dof, critical %.3f)\n", always.value,
              always.dof, chi2_critical_001(always.dof));
  std::printf("[  chi2    ] negative control resample-from-p: chi2 = %.1f (%d dof, critical %.3f)\n", from_p.value,
              from_p.dof, chi2_critical_001(from_p.dof));
  EXPECT_GT(always.value, chi2_critical_001(always.dof));
  EXPECT_GT(from_p.value, chi2_critical_001(from_p.dof));
}

// A Markov target over 4 tokens: P[a] is the distribution after token a. The draft Q covers
// the awkward cases: Q[0] misses token 2, Q[1] puts mass where P[1] has none, Q[2] == P[2],
// Q[3] barely overlaps P[3].
const std::vector<Dist> kTarget = {{0.1f, 0.4f, 0.3f, 0.2f}, {0.5f, 0, 0.25f, 0.25f}, {0.2f, 0.2f, 0.2f, 0.4f}, {0, 0.6f, 0.1f, 0.3f}};
const std::vector<Dist> kDraft = {{0.4f, 0.1f, 0, 0.5f}, {0.25f, 0.25f, 0.25f, 0.25f}, {0.2f, 0.2f, 0.2f, 0.4f}, {0.7f, 0, 0, 0.3f}};
constexpr int32_t kContextToken = 0;
constexpr int kEmitted = 3;  // the first three emitted tokens are tested jointly: 64 outcomes

// Exact probability of each 3-token continuation under the target alone.
std::vector<double> target_chain() {
  std::vector<double> prob(64);
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      for (int c = 0; c < 4; ++c)
        prob[a * 16 + b * 4 + c] = double(kTarget[kContextToken][a]) * kTarget[a][b] * kTarget[b][c];
  return prob;
}

// Runs speculative decoding rounds (one round of drafting k tokens, then a verification)
// until three tokens are emitted, and tallies them. `round` returns the tokens one round emits.
template <typename Round>
ChiSquare chain_test(Round round, int trials, uint64_t seed, std::vector<long>* counts_out = nullptr) {
  Sampler rng({.temperature = 1.0f, .seed = seed});
  std::vector<long> count(64);
  for (int t = 0; t < trials; ++t) {
    std::vector<int32_t> out;
    int32_t last = kContextToken;
    while (int(out.size()) < kEmitted) {
      for (int32_t tok : round(last, rng)) out.push_back(tok);
      last = out.back();
    }
    ++count[out[0] * 16 + out[1] * 4 + out[2]];
  }
  if (counts_out) *counts_out = count;
  return chi_square(count, target_chain());
}

// One round of chain drafting: x_i ~ Q[x_{i-1}], then verification against the target rows.
auto chain_round(const ChainVerifier& verify, int k) {
  return [&verify, k](int32_t last, Sampler& rng) {
    std::vector<int32_t> draft;
    std::vector<Dist> p = {kTarget[last]}, q;
    for (int i = 0; i < k; ++i) {
      q.push_back(kDraft[last]);
      last = rng.sample_from(kDraft[last]);
      draft.push_back(last);
      p.push_back(kTarget[last]);
    }
    const Verdict v = verify(draft, p, q, rng);
    std::vector<int32_t> emitted(draft.begin(), draft.begin() + v.accepted);
    emitted.push_back(v.next);
    return emitted;
  };
}

// k = 3 tests acceptance three deep; k = 1 and 2 put the bonus token (drawn after every draft
// was accepted) inside the three tested positions too.
TEST(VerifyStochastic, ChainsFollowTheTargetChain) {
  constexpr int kChainTrials = 100000;
  const auto joint = target_chain();
  for (int k = 1; k <= 3; ++k) {
    std::vector<long> count;
    const ChiSquare c = chain_test(chain_round(exact, k), kChainTrials, 2024 + k, &count);
    std::printf("[  chi2    ] k=%d chain, joint of first 3 tokens: chi2 = %.3f  (%d dof, critical %.3f)\n", k, c.value,
                c.dof, chi2_critical_001(c.dof));
    ASSERT_EQ(c.dof, 48);  // 49 of the 64 continuations are possible
    EXPECT_EQ(c.impossible, 0) << "k=" << k;
    EXPECT_LT(c.value, chi2_critical_001(c.dof)) << "k=" << k;

    // Per-position marginals of the first and second emitted tokens.
    for (int pos = 0; pos < 2; ++pos) {
      std::vector<long> m(4);
      std::vector<double> e(4);
      for (int i = 0; i < 64; ++i) {
        const int tok = pos == 0 ? i / 16 : (i / 4) % 4;
        m[tok] += count[i];
        e[tok] += joint[i];
      }
      const ChiSquare cm = chi_square(m, e);
      std::printf("[  chi2    ] k=%d chain, emitted token %d marginal: chi2 = %.3f  (%d dof, critical %.3f)\n", k, pos,
                  cm.value, cm.dof, chi2_critical_001(cm.dof));
      EXPECT_EQ(cm.impossible, 0) << "k=" << k;
      EXPECT_LT(cm.value, chi2_critical_001(cm.dof)) << "k=" << k;
    }
  }
}

// TriForce's two-level sampler: the draft Q proposes gamma1 tokens to a middle model M (the
// target's weights over a partial cache, here its own Markov chain), verified with `middle`;
// the middle level keeps going while it holds fewer than gamma2 tokens, then its tokens, with
// M's rows as their proposal distributions, are verified against the target with `top`.
const std::vector<Dist> kMiddle = {{0.2f, 0.3f, 0.3f, 0.2f}, {0.4f, 0.1f, 0.3f, 0.2f}, {0.3f, 0.2f, 0.1f, 0.4f}, {0.1f, 0.5f, 0.2f, 0.2f}};

auto two_level_round(const ChainVerifier& middle, const ChainVerifier& top, int gamma1, int gamma2) {
  return [&middle, &top, gamma1, gamma2](int32_t last, Sampler& rng) {
    std::vector<int32_t> mid;
    std::vector<Dist> mid_q;
    while (int(mid.size()) < gamma2) {
      const int32_t from = mid.empty() ? last : mid.back();
      std::vector<int32_t> draft;
      std::vector<Dist> q, m = {kMiddle[from]};
      for (int32_t t = from; int(draft.size()) < gamma1;) {
        q.push_back(kDraft[t]);
        t = rng.sample_from(kDraft[t]);
        draft.push_back(t);
        m.push_back(kMiddle[t]);
      }
      const Verdict v = middle(draft, m, q, rng);
      for (int i = 0; i <= v.accepted; ++i) {
        mid.push_back(i < v.accepted ? draft[size_t(i)] : v.next);
        mid_q.push_back(m[size_t(i)]);
      }
    }
    std::vector<Dist> p = {kTarget[last]};
    for (int32_t t : mid) p.push_back(kTarget[t]);
    const Verdict v = top(mid, p, mid_q, rng);
    std::vector<int32_t> emitted(mid.begin(), mid.begin() + v.accepted);
    emitted.push_back(v.next);
    return emitted;
  };
}

TEST(VerifyTwoLevel, TriForceRoundsFollowTheTargetChain) {
  for (auto [g1, g2] : {std::pair{1, 1}, {2, 3}, {3, 2}, {1, 4}}) {
    const ChiSquare c = chain_test(two_level_round(exact, exact, g1, g2), 100000, 3000 + g1 * 10 + g2);
    std::printf("[  chi2    ] two levels, gamma1=%d gamma2=%d, joint of first 3 tokens: chi2 = %.3f  (%d dof, critical %.3f)\n",
                g1, g2, c.value, c.dof, chi2_critical_001(c.dof));
    EXPECT_EQ(c.impossible, 0);
    EXPECT_LT(c.value, chi2_critical_001(c.dof)) << "gamma1=" << g1 << " gamma2=" << g2;
  }
}

// The public code's middle level: a rejected draft is replaced by a draw from M, not from the
// residual norm(max(0, M - Q)); the top level then divides by M all the same, and the output
// is no longer the target's.
TEST(VerifyTwoLevel, ResamplingFromTheMiddleDistributionFails) {
  const ChiSquare c = chain_test(two_level_round(resample_from_p, exact, 2, 3), 100000, 3100);
  std::printf("[  chi2    ] two levels, middle resamples from M: chi2 = %.1f (critical %.3f)\n", c.value,
              chi2_critical_001(c.dof));
  EXPECT_GT(c.value, chi2_critical_001(c.dof));
}

TEST(VerifyStochastic, ChainNegativeControlFails) {
  const ChiSquare c = chain_test(chain_round(accept_always, 3), 100000, 2025);
  std::printf("[  chi2    ] k=3 chain, accept-always: chi2 = %.1f, %d impossible draws (critical %.3f)\n", c.value,
              c.impossible, chi2_critical_001(c.dof));
  EXPECT_GT(c.value, chi2_critical_001(c.dof));
}

TEST(VerifyStochastic, SameSeedSameVerdicts) {
  auto run = [](uint64_t seed) {
    Sampler rng({.temperature = 1.0f, .seed = seed});
    std::vector<int> out;
    for (int t = 0; t < 200; ++t)
      for (int32_t tok : chain_round(exact, 3)(kContextToken, rng)) out.push_back(tok);
    return out;
  };
  EXPECT_EQ(run(9), run(9));
  EXPECT_NE(run(9), run(10));
}

TEST(VerifyStochastic, RejectsBadArguments) {
  Sampler rng({.temperature = 1.0f, .seed = 1});
  const Dist p = {0.5f, 0.5f}, q = {0.5f, 0.5f};
  const std::vector<int32_t> d1 = {0};
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{p}, std::vector<Dist>{q}, rng), std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{p, p}, std::vector<Dist>{}, rng), std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{p, {1, 0, 0}}, std::vector<Dist>{q}, rng), std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{p, p}, std::vector<Dist>{{1, 0, 0}}, rng), std::invalid_argument);
  const std::vector<int32_t> outside = {2};
  EXPECT_THROW(verify_stochastic(outside, std::vector<Dist>{p, p}, std::vector<Dist>{q}, rng), std::invalid_argument);
  // The draft token cannot have come from a q that gives it no mass.
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{p, p}, std::vector<Dist>{{0, 1}}, rng), std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{{0.5f, -0.1f}, p}, std::vector<Dist>{q}, rng),
               std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{{0, 0}, p}, std::vector<Dist>{q}, rng), std::invalid_argument);
  EXPECT_THROW(verify_stochastic(d1, std::vector<Dist>{{NAN, 1}, p}, std::vector<Dist>{q}, rng), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Stochastic trees

TEST(VerifyTreeStochastic, ChainShapedTreeGivesTheChainVerdict) {
  // Random distributions with zeros; the same seed must give the same verdict either way.
  Sampler gen({.temperature = 1.0f, .seed = 31});
  for (int trial = 0; trial < 3000; ++trial) {
    const int k = trial % 5, V = 5;
    auto random_dist = [&] {
      Dist d(V);
      for (auto& v : d) v = gen.uniform() < 0.3 ? 0.0f : float(gen.uniform());
      d[size_t(gen.uniform() * V)] += 0.1f;  // never all zero
      return d;
    };
    std::vector<Dist> p, q;
    std::vector<int32_t> draft;
    std::vector<int> par;
    for (int i = 0; i < k; ++i) {
      p.push_back(random_dist());
      q.push_back(random_dist());
      draft.push_back(gen.sample_from(q.back()));
      par.push_back(i - 1);
    }
    p.push_back(random_dist());
    Sampler a({.temperature = 1.0f, .seed = uint64_t(trial)}), b({.temperature = 1.0f, .seed = uint64_t(trial)});
    const Verdict c = verify_stochastic(draft, p, q, a);
    const TreeVerdict t = verify_tree_stochastic(draft, par, p, q, b);
    ASSERT_EQ(t.accepted(), c.accepted) << trial;
    ASSERT_EQ(t.next, c.next) << trial;
    for (int i = 0; i < t.accepted(); ++i) ASSERT_EQ(t.path[i], i);
    ASSERT_EQ(a.uniform(), b.uniform()) << "the two consumed different amounts of randomness";
  }
}

using TreeVerifier = std::function<TreeVerdict(std::span<const int32_t>, std::span<const int>, std::span<const Dist>,
                                               std::span<const Dist>, Sampler&)>;

const TreeVerifier exact_tree = [](std::span<const int32_t> t, std::span<const int> par, std::span<const Dist> p,
                                   std::span<const Dist> q, Sampler& s) {
  return verify_tree_stochastic(t, par, p, q, s);
};

// Deliberately wrong: every sibling is tested against the full target distribution instead of
// the residual left by the siblings rejected before it.
const TreeVerifier no_residual_update = [](std::span<const int32_t> t, std::span<const int> par,
                                           std::span<const Dist> p, std::span<const Dist> q, Sampler& s) {
  TreeVerdict v;
  int node = -1;
  for (;;) {
    const auto pn = normalise(p[node + 1]);
    int taken = -1;
    for (size_t c = 0; c < t.size() && taken < 0; ++c) {
      if (par[c] != node) continue;
      if (s.uniform() < pn[t[c]] / normalise(q[c])[t[c]]) taken = int(c);
    }
    if (taken < 0) {
      v.next = s.sample_from(p[node + 1]);
      return v;
    }
    v.path.push_back(taken);
    node = taken;
  }
};

// One round over a tree drafted from the Markov draft model: three independent candidates for
// the first token (two from kDraft, one from a uniform second draft), two children under the
// first candidate, one under the second.
auto tree_round(const TreeVerifier& verify) {
  return [&verify](int32_t last, Sampler& rng) {
    const Dist uniform4 = {1, 1, 1, 1};
    const std::vector<int> par = {-1, -1, -1, 0, 0, 1};
    std::vector<int32_t> tok;
    std::vector<Dist> q;
    for (size_t i = 0; i < par.size(); ++i) {
      const int32_t prev = par[i] < 0 ? last : tok[par[i]];
      q.push_back(i == 1 ? uniform4 : kDraft[prev]);
      tok.push_back(rng.sample_from(q.back()));
    }
    std::vector<Dist> p = {kTarget[last]};
    for (int32_t t : tok) p.push_back(kTarget[t]);
    const TreeVerdict v = verify(tok, par, p, q, rng);
    std::vector<int32_t> emitted;
    for (int n : v.path) emitted.push_back(tok[n]);
    emitted.push_back(v.next);
    return emitted;
  };
}

TEST(VerifyTreeStochastic, TreeRoundsFollowTheTargetChain) {
  const ChiSquare c = chain_test(tree_round(exact_tree), 100000, 4242);
  std::printf("[  chi2    ] tree, joint of first 3 tokens: chi2 = %.3f  (%d dof, critical %.3f)\n", c.value, c.dof,
              chi2_critical_001(c.dof));
  ASSERT_EQ(c.dof, 48);
  EXPECT_EQ(c.impossible, 0);
  EXPECT_LT(c.value, chi2_critical_001(c.dof));
}

TEST(VerifyTreeStochastic, NegativeControlWithoutResidualUpdateFails) {
  const ChiSquare c = chain_test(tree_round(no_residual_update), 100000, 4243);
  std::printf("[  chi2    ] tree without residual update: chi2 = %.1f  (%d dof, critical %.3f)\n", c.value, c.dof,
              chi2_critical_001(c.dof));
  EXPECT_GT(c.value, chi2_critical_001(c.dof));
}

TEST(VerifyTreeStochastic, DeterministicSiblingsFollowTheTarget) {
  // A top-k style tree: three fixed candidates (one-hot q), tried in order.
  Sampler rng({.temperature = 1.0f, .seed = 99});
  const std::vector<int32_t> tok = {3, 1, 0};
  const std::vector<int> par = {-1, -1, -1};
  std::vector<Dist> q;
  for (int32_t t : tok) {
    Dist d(6, 0.0f);
    d[t] = 1;
    q.push_back(d);
  }
  const std::vector<Dist> p = {kP, kP, kP, kP};
  std::vector<long> count(6);
  for (int t = 0; t < kTrials; ++t) {
    const TreeVerdict v = verify_tree_stochastic(tok, par, p, q, rng);
    ++count[v.accepted() ? tok[v.path[0]] : v.next];
  }
  const ChiSquare c = chi_square(count, normalise(kP));
  std::printf("[  chi2    ] tree, one-hot siblings, first token: chi2 = %.3f  (%d dof, critical %.3f)\n", c.value,
              c.dof, chi2_critical_001(c.dof));
  EXPECT_LT(c.value, chi2_critical_001(c.dof));
}

// A TokenTree drafted as expansion drafting does it: at every node up to `widths[d]` children
// drawn WITHOUT replacement from the Markov draft (one group per node), optionally merged with
// a second draft's chain drawn from a uniform draft (shared tokens become one node with two
// proposals). `independent` mislabels the siblings as independent draws: the negative control.
auto token_tree_round(std::vector<int> widths, bool second_draft, bool independent) {
  return [=](int32_t last, Sampler& rng) {
    auto dist = [](const Dist& d) { return std::make_shared<const Dist>(d); };
    TokenTree tree;
    std::function<void(int32_t, int32_t, size_t)> grow = [&](int32_t node, int32_t prev, size_t depth) {
      if (depth >= widths.size()) return;
      auto q = dist(kDraft[prev]);
      Dist left = *q;
      for (int k = 0; k < widths[depth]; ++k) {
        if (std::none_of(left.begin(), left.end(), [](float v) { return v > 0; })) break;
        const int32_t x = rng.sample_from(left);
        left[x] = 0;
        const int32_t child = tree.add(node, x, {0, independent ? -1 : 0, q, k});
        grow(child, x, depth + 1);
      }
    };
    grow(-1, last, 0);
    if (second_draft) {
      TokenTree chain;
      const auto uniform = dist({1, 1, 1, 1});
      int32_t at = -1;
      for (int d = 0; d < 2; ++d) at = chain.add(at, rng.sample_from(*uniform), {1, -1, uniform});
      tree.merge(chain);
    }
    const auto layout = tree.layout();
    std::vector<Dist> p = {kTarget[last]};
    for (int32_t t : layout.tokens) p.push_back(kTarget[t]);
    const TreeVerdict v = verify_tree_proposals(tree, layout, p, rng);
    std::vector<int32_t> emitted;
    for (int n : v.path) emitted.push_back(layout.tokens[n]);
    emitted.push_back(v.next);
    return emitted;
  };
}

TEST(VerifyTreeProposals, SiblingsDrawnWithoutReplacementFollowTheTargetChain) {
  // 2-4 children per node, depth 3.
  for (auto widths : std::vector<std::vector<int>>{{2, 2, 2}, {3, 2, 4}, {4, 3, 2}}) {
    const ChiSquare c = chain_test(token_tree_round(widths, false, false), 60000, 5150 + widths[0]);
    std::printf("[  chi2    ] tree %d,%d,%d without replacement: chi2 = %.3f  (%d dof, critical %.3f)\n", widths[0],
                widths[1], widths[2], c.value, c.dof, chi2_critical_001(c.dof));
    ASSERT_EQ(c.dof, 48);
    EXPECT_EQ(c.impossible, 0);
    EXPECT_LT(c.value, chi2_critical_001(c.dof));
  }
}

TEST(VerifyTreeProposals, MergedDraftsFollowTheTargetChain) {
  const ChiSquare c = chain_test(token_tree_round({2, 2}, true, false), 60000, 5160);
  std::printf("[  chi2    ] merged two-draft tree: chi2 = %.3f  (%d dof, critical %.3f)\n", c.value, c.dof,
              chi2_critical_001(c.dof));
  EXPECT_EQ(c.impossible, 0);
  EXPECT_LT(c.value, chi2_critical_001(c.dof));
}

TEST(VerifyTreeProposals, TreatingDrawsWithoutReplacementAsIndependentFails) {
  const ChiSquare c = chain_test(token_tree_round({3, 3, 3}, false, true), 60000, 5170);
  std::printf("[  chi2    ] without-replacement siblings verified as independent: chi2 = %.1f  (%d dof, critical %.3f)\n",
              c.value, c.dof, chi2_critical_001(c.dof));
  EXPECT_GT(c.value, chi2_critical_001(c.dof));
}

TEST(TokenTree, MergesByCommonPrefixAndLaysOutInDfsOrder) {
  TokenTree a;
  const int32_t r = a.add(-1, 7, {0, 0, nullptr});
  a.add(r, 8, {0, 0, nullptr});
  const int32_t s = a.add(-1, 9, {0, 0, nullptr});
  TokenTree b;
  const int32_t br = b.add(-1, 7, {1, -1, nullptr});
  b.add(b.add(br, 5, {1, -1, nullptr}), 6, {1, -1, nullptr});
  a.merge(b);
  // 7 holds both drafts' proposals; its children are 8 (draft 0) then 5 -> 6 (draft 1).
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a.node(size_t(r)).proposals.size(), 2u);
  const auto l = a.layout();
  EXPECT_EQ(l.tokens, (std::vector<int32_t>{7, 8, 5, 6, 9}));
  EXPECT_EQ(l.parents, (std::vector<int32_t>{-1, 0, 0, 2, -1}));
  EXPECT_EQ(l.depths, (std::vector<int32_t>{0, 1, 1, 2, 0}));
  EXPECT_EQ(l.order.back(), s);
  EXPECT_EQ(a.branches().size(), 3u);
  EXPECT_EQ(expansion_size(std::vector<int>{1, 1, 3, 1}), 1u + 1 + 3 + 3);
}

TEST(VerifyTreeStochastic, RejectsBadTrees) {
  Sampler rng({.temperature = 1.0f, .seed = 1});
  const Dist p = {0.5f, 0.5f};
  const std::vector<int32_t> tok = {0, 1};
  const std::vector<Dist> ps = {p, p, p}, qs = {p, p};
  EXPECT_THROW(verify_tree_stochastic(tok, std::vector<int>{-1, 1}, ps, qs, rng), std::invalid_argument);
  EXPECT_THROW(verify_tree_stochastic(tok, std::vector<int>{-1}, ps, qs, rng), std::invalid_argument);
  EXPECT_THROW(verify_tree_stochastic(tok, std::vector<int>{-1, 0}, std::vector<Dist>{p, p}, qs, rng),
               std::invalid_argument);
  EXPECT_NO_THROW(verify_tree_stochastic(tok, std::vector<int>{-1, -1}, ps, qs, rng));
}

}  // namespace
