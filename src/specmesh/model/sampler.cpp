#include "specmesh/model/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace specmesh {

int32_t Sampler::argmax(const float* logits, int n_vocab) {
  int32_t best = 0;
  for (int32_t i = 1; i < n_vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

std::vector<float> Sampler::distribution(const float* logits, int n_vocab) const {
  std::vector<float> dist(n_vocab, 0.0f);
  if (p_.temperature <= 0) {
    dist[argmax(logits, n_vocab)] = 1.0f;
    return dist;
  }
  // Candidates by descending logit (ties: lower id first, so the order is reproducible).
  std::vector<int32_t> idx(n_vocab);
  std::iota(idx.begin(), idx.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  size_t keep = n_vocab;
  if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
    keep = p_.top_k;
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), by_logit);
  } else {
    std::sort(idx.begin(), idx.end(), by_logit);
  }
  std::vector<double> prob(keep);
  const double m = logits[idx[0]];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += prob[i] = std::exp((logits[idx[i]] - m) / p_.temperature);
  for (auto& p : prob) p /= sum;
  if (p_.top_p < 1.0f) {
    double cum = 0;
    size_t k = 0;
    while (k < keep) {
      cum += prob[k++];
      if (cum >= p_.top_p) break;
    }
    keep = std::max<size_t>(k, 1);
  }
  if (p_.min_p > 0) {
    size_t k = 1;
    while (k < keep && prob[k] >= p_.min_p * prob[0]) ++k;
    keep = k;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += prob[i];
  for (size_t i = 0; i < keep; ++i) dist[idx[i]] = float(prob[i] / total);
  return dist;
}

double Sampler::uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::sample_from(const std::vector<float>& dist) {
  double total = 0;
  for (float p : dist) total += p;
  const double r = uniform() * total;
  double cum = 0;
  int32_t last = 0;
  for (size_t i = 0; i < dist.size(); ++i) {
    if (dist[i] <= 0) continue;
    cum += dist[i];
    last = int32_t(i);
    if (r < cum) return last;
  }
  return last;  // rounding left r at the very top
}

int32_t Sampler::sample(const float* logits, int n_vocab) {
  if (greedy()) return argmax(logits, n_vocab);
  return sample_from(distribution(logits, n_vocab));
}

}  // namespace specmesh
