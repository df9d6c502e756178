#include "specmesh/speculation/verify.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace specmesh {

namespace {

[[noreturn]] void invalid(const std::string& what) { throw std::invalid_argument(what); }

// Total mass of a distribution; the ratios below are only meaningful for finite,
// non-negative weights with some mass.
double mass(const std::vector<float>& d, const char* fn, const char* name, size_t index) {
  double s = 0;
  for (float v : d) {
    if (!std::isfinite(v) || v < 0)
      invalid(std::string(fn) + ": " + name + "[" + std::to_string(index) + "] has a negative or non-finite entry");
    s += v;
  }
  if (!(s > 0)) invalid(std::string(fn) + ": " + name + "[" + std::to_string(index) + "] has no mass");
  return s;
}

std::vector<double> normalised(const std::vector<float>& d, double m) {
  std::vector<double> r(d.size());
  for (size_t i = 0; i < d.size(); ++i) r[i] = double(d[i]) / m;
  return r;
}

// r <- normalise(max(0, r - q/qm)). When nothing is left (r == q) r is kept: a rejection is
// then only reachable through rounding, and r is still the right distribution to draw from.
void subtract(std::vector<double>& r, const std::vector<float>& q, double qm) {
  std::vector<double> out(r.size());
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += out[i] = std::max(0.0, r[i] - double(q[i]) / qm);
  if (!(s > 0)) return;
  for (double& v : out) v /= s;
  r.swap(out);
}

// r is normalised, so its largest entry is at least 1/n and survives the cast to float.
int32_t draw(const std::vector<double>& r, Sampler& rng) { return rng.sample_from(std::vector<float>(r.begin(), r.end())); }

// Same vocabulary everywhere, every drafted token inside it.
size_t check_shapes(const char* fn, std::span<const int32_t> tokens, std::span<const std::vector<float>> p,
                    std::span<const std::vector<float>> q) {
  const size_t k = tokens.size();
  if (p.size() != k + 1)
    invalid(std::string(fn) + ": " + std::to_string(p.size()) + " target distributions for " + std::to_string(k) +
            " draft tokens (need " + std::to_string(k + 1) + ")");
  if (q.size() != k)
    invalid(std::string(fn) + ": " + std::to_string(q.size()) + " draft distributions for " + std::to_string(k) +
            " draft tokens");
  const size_t n_vocab = p[0].size();
  if (n_vocab == 0) invalid(std::string(fn) + ": empty target distribution");
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i].size() != n_vocab)
      invalid(std::string(fn) + ": p[" + std::to_string(i) + "] has " + std::to_string(p[i].size()) +
              " entries, p[0] has " + std::to_string(n_vocab));
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i].size() != n_vocab)
      invalid(std::string(fn) + ": q[" + std::to_string(i) + "] has " + std::to_string(q[i].size()) +
              " entries, p[0] has " + std::to_string(n_vocab));
  for (size_t i = 0; i < k; ++i)
    if (tokens[i] < 0 || size_t(tokens[i]) >= n_vocab)
      invalid(std::string(fn) + ": draft token " + std::to_string(tokens[i]) + " at " + std::to_string(i) +
              " is outside the vocabulary of " + std::to_string(n_vocab));
  return n_vocab;
}

// A token drawn from q must have mass under q; a zero would make the acceptance ratio infinite.
void check_drawn(const char* fn, const std::vector<float>& q, int32_t x, size_t i) {
  if (!(q[x] > 0))
    invalid(std::string(fn) + ": draft token " + std::to_string(x) + " at " + std::to_string(i) +
            " has zero probability under its draft distribution");
}

// Children of each node, in index order; slot 0 is the context, slot i+1 node i.
std::vector<std::vector<int>> children_of(const char* fn, size_t n, std::span<const int> parents) {
  if (parents.size() != n)
    invalid(std::string(fn) + ": " + std::to_string(parents.size()) + " parents for " + std::to_string(n) + " nodes");
  std::vector<std::vector<int>> kids(n + 1);
  for (size_t i = 0; i < n; ++i) {
    if (parents[i] < -1 || parents[i] >= int(i))
      invalid(std::string(fn) + ": node " + std::to_string(i) + " has parent " + std::to_string(parents[i]) +
              " (must be -1 or an earlier node)");
    kids[parents[i] + 1].push_back(int(i));
  }
  return kids;
}

void check_greedy_args(const char* fn, std::span<const int32_t> tokens, const float* logits, int n_vocab) {
  if (n_vocab <= 0) invalid(std::string(fn) + ": n_vocab must be positive");
  if (!logits) invalid(std::string(fn) + ": no target logits");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= n_vocab)
      invalid(std::string(fn) + ": draft token " + std::to_string(tokens[i]) + " at " + std::to_string(i) +
              " is outside the vocabulary of " + std::to_string(n_vocab));
}

}  // namespace

Verdict verify_greedy(std::span<const int32_t> draft, const float* target_logits, int n_vocab) {
  check_greedy_args("verify_greedy", draft, target_logits, n_vocab);
  for (size_t i = 0; i < draft.size(); ++i) {
    const int32_t best = Sampler::argmax(target_logits + i * size_t(n_vocab), n_vocab);
    if (draft[i] != best) return {int(i), best};
  }
  return {int(draft.size()), Sampler::argmax(target_logits + draft.size() * size_t(n_vocab), n_vocab)};
}

Verdict verify_stochastic(std::span<const int32_t> draft, std::span<const std::vector<float>> p,
                          std::span<const std::vector<float>> q, Sampler& rng) {
  constexpr const char* fn = "verify_stochastic";
  check_shapes(fn, draft, p, q);
  for (size_t i = 0; i < draft.size(); ++i) {
    const int32_t x = draft[i];
    const double pm = mass(p[i], fn, "p", i), qm = mass(q[i], fn, "q", i);
    check_drawn(fn, q[i], x, i);
    // A uniform is drawn even when the ratio is >= 1 so the stream advances the same way.
    if (rng.uniform() < (double(p[i][x]) / pm) / (double(q[i][x]) / qm)) continue;
    std::vector<double> r = normalised(p[i], pm);
    subtract(r, q[i], qm);
    return {int(i), draw(r, rng)};
  }
  mass(p[draft.size()], fn, "p", draft.size());
  return {int(draft.size()), rng.sample_from(p[draft.size()])};
}

TreeVerdict verify_tree_greedy(std::span<const int32_t> tokens, std::span<const int> parents,
                               const float* target_logits, int n_vocab) {
  constexpr const char* fn = "verify_tree_greedy";
  check_greedy_args(fn, tokens, target_logits, n_vocab);
  const auto kids = children_of(fn, tokens.size(), parents);
  TreeVerdict v;
  int node = -1;
  for (;;) {
    const int32_t best = Sampler::argmax(target_logits + size_t(node + 1) * size_t(n_vocab), n_vocab);
    const auto& ch = kids[node + 1];
    auto it = std::find_if(ch.begin(), ch.end(), [&](int c) { return tokens[c] == best; });
    if (it == ch.end()) {
      v.next = best;
      return v;
    }
    node = *it;
    v.path.push_back(node);
  }
}

TreeVerdict verify_tree_stochastic(std::span<const int32_t> tokens, std::span<const int> parents,
                                   std::span<const std::vector<float>> p,
                                   std::span<const std::vector<float>> q, Sampler& rng) {
  constexpr const char* fn = "verify_tree_stochastic";
  check_shapes(fn, tokens, p, q);
  const auto kids = children_of(fn, tokens.size(), parents);
  TreeVerdict v;
  int node = -1;
  for (;;) {
    const size_t row = size_t(node + 1);
    const double pm = mass(p[row], fn, "p", row);
    std::vector<double> r;  // the residual; empty while it is still p[row] itself
    int taken = -1;
    for (int c : kids[row]) {
      const int32_t x = tokens[c];
      const double qm = mass(q[c], fn, "q", size_t(c));
      check_drawn(fn, q[c], x, size_t(c));
      const double rx = r.empty() ? double(p[row][x]) / pm : r[x];
      if (rng.uniform() < rx / (double(q[c][x]) / qm)) {
        taken = c;
        break;
      }
      if (r.empty()) r = normalised(p[row], pm);
      subtract(r, q[c], qm);
    }
    if (taken < 0) {
      v.next = r.empty() ? rng.sample_from(p[row]) : draw(r, rng);
      return v;
    }
    v.path.push_back(taken);
    node = taken;
  }
}

TreeVerdict verify_tree_proposals(const TokenTree& tree, const TokenTree::Layout& layout, const TargetRow& target,
                                  Sampler& rng) {
  constexpr const char* fn = "verify_tree_proposals";
  const size_t n = layout.order.size();
  const auto kids = children_of(fn, n, layout.parents);
  TreeVerdict v;
  std::vector<float> p;
  int32_t at = -1;
  for (;;) {
    const size_t row = size_t(at + 1);
    target(row, p);
    const double pm = mass(p, fn, "p", row);
    std::vector<double> r;  // the residual; empty while it is still p itself
    // Groups drawn without replacement: their distribution with the rejected tokens removed.
    std::vector<std::pair<int, std::vector<float>>> thinned;
    // Every proposal at this node, draft by draft, each draft's in its draw order.
    struct Try {
      int32_t child;
      const Proposal* prop;
    };
    std::vector<Try> tries;
    for (int c : kids[row])
      for (const Proposal& prop : tree.node(size_t(layout.order[size_t(c)])).proposals) tries.push_back({c, &prop});
    std::stable_sort(tries.begin(), tries.end(), [](const Try& a, const Try& b) {
      return a.prop->draft != b.prop->draft ? a.prop->draft < b.prop->draft : a.prop->rank < b.prop->rank;
    });
    int32_t taken = -1;
    for (const Try& t : tries) {
      const int32_t c = t.child;
      const Proposal& prop = *t.prop;
      const int32_t x = layout.tokens[size_t(c)];
      if (!prop.q) invalid(std::string(fn) + ": node " + std::to_string(c) + " has a proposal without its distribution");
      const std::vector<float>* q = prop.q.get();
      auto g = std::find_if(thinned.begin(), thinned.end(), [&](const auto& th) { return th.first == prop.group; });
      if (prop.group >= 0 && g != thinned.end()) q = &g->second;
      if (q->size() != p.size() || x < 0 || size_t(x) >= p.size())
        invalid(std::string(fn) + ": node " + std::to_string(c) + " does not fit the target's vocabulary");
      const double qm = mass(*q, fn, "q", size_t(c));
      check_drawn(fn, *q, x, size_t(c));
      const double rx = r.empty() ? double(p[size_t(x)]) / pm : r[size_t(x)];
      if (rng.uniform() < rx / (double((*q)[size_t(x)]) / qm)) {
        taken = c;
        break;
      }
      if (r.empty()) r = normalised(p, pm);
      subtract(r, *q, qm);
      if (prop.group >= 0) {
        if (g == thinned.end()) g = thinned.insert(thinned.end(), {prop.group, *prop.q});
        g->second[size_t(x)] = 0.0f;
      }
    }
    if (taken < 0) {
      v.next = r.empty() ? rng.sample_from(p) : draw(r, rng);
      return v;
    }
    v.path.push_back(taken);
    at = taken;
  }
}

TreeVerdict verify_tree_proposals(const TokenTree& tree, const TokenTree::Layout& layout,
                                  std::span<const std::vector<float>> p, Sampler& rng) {
  const size_t n = layout.order.size();
  if (p.size() != n + 1)
    invalid("verify_tree_proposals: " + std::to_string(p.size()) + " target distributions for " + std::to_string(n) +
            " nodes");
  return verify_tree_proposals(tree, layout, [&](size_t row, std::vector<float>& out) { out = p[row]; }, rng);
}

}  // namespace specmesh
