// Plain autoregressive generation on one context: the reference every speculative method
// must reproduce token for token.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "specmesh/model/context.hpp"
#include "specmesh/model/sampler.hpp"

namespace specmesh {

struct GenerateParams {
  int n_predict = 128;      // tokens to generate
  SamplerParams sampling;
  bool ignore_eos = false;  // keep going past the model's stop token
  int n_batch = 256;        // prompt tokens per forward pass
};

using GenerateStats = GenerationStats;  // the public type (specmesh/generation.hpp)

// Called with each generated token; returning false stops generation.
using TokenCallback = std::function<bool(int32_t)>;

// Feeds the prompt into sequence 0 of an empty or fresh context and generates; the stop
// token (when not ignored) ends generation and is not reported.
GenerateStats generate(Context& ctx, const std::vector<int32_t>& prompt, const GenerateParams& params,
                       const TokenCallback& on_token);

// The ids plain greedy decoding emits after `prompt`: n of them, fewer when the stop token
// comes first (unless ignored). The reference every lossless strategy is compared with.
std::vector<int32_t> greedy_ids(Context& ctx, const std::vector<int32_t>& prompt, int n, bool ignore_eos = false);

// Runs `tokens` at positions [pos0, pos0+n) of sequence 0 in batches of n_batch and returns
// the logits of the last one.
std::vector<float> prefill(Context& ctx, const std::vector<int32_t>& tokens, int32_t pos0, int n_batch);

}  // namespace specmesh
