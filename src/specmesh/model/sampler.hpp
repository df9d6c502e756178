// Turns logits into a token: greedy, or sampled after temperature / top-k / top-p / min-p.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "specmesh/generation.hpp"

namespace specmesh {

using SamplerParams = SamplingParams;  // the public type (specmesh/generation.hpp)

class Sampler {
 public:
  explicit Sampler(SamplerParams p) : p_(p), rng_(p.seed) {}

  const SamplerParams& params() const { return p_; }
  bool greedy() const { return p_.temperature <= 0; }

  // The distribution a sample is drawn from: softmax(logits / T) restricted by top-k, top-p
  // and min-p, renormalised; zero outside. Speculative verification compares these.
  std::vector<float> distribution(const float* logits, int n_vocab) const;

  // Next token: argmax (lowest id on ties) when greedy, else a draw from distribution().
  int32_t sample(const float* logits, int n_vocab);
  // A draw from an explicit distribution (need not be normalised).
  int32_t sample_from(const std::vector<float>& dist);
  // A uniform draw in [0, 1), from the same seeded stream.
  double uniform();

  static int32_t argmax(const float* logits, int n_vocab);

 private:
  SamplerParams p_;
  std::mt19937_64 rng_;  // the algorithm is fixed by the standard: same seed, same tokens anywhere
};

}  // namespace specmesh
