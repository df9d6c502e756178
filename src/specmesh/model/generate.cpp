#include "specmesh/model/generate.hpp"

#include <chrono>
#include <stdexcept>

namespace specmesh {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
}  // namespace

std::vector<float> prefill(Context& ctx, const std::vector<int32_t>& tokens, int32_t pos0, int n_batch) {
  if (tokens.empty()) throw std::invalid_argument("empty prompt: at least one token (e.g. BOS) is needed");
  std::vector<float> logits;
  for (size_t b = 0; b < tokens.size(); b += n_batch) {
    const size_t e = std::min(tokens.size(), b + size_t(n_batch));
    Batch batch;
    for (size_t i = b; i < e; ++i) batch.add(tokens[i], pos0 + int32_t(i), seq_bit(0), i + 1 == tokens.size());
    ForwardOutput out = ctx.forward(batch);
    if (e == tokens.size()) logits = std::move(out.logits);
  }
  return logits;
}

GenerateStats generate(Context& ctx, const std::vector<int32_t>& prompt, const GenerateParams& params,
                       const TokenCallback& on_token) {
  const Model& model = ctx.model();
  const int n_vocab = model.hparams().n_vocab;
  if (int(prompt.size()) + params.n_predict > ctx.kv().n_cells())
    throw std::invalid_argument("prompt (" + std::to_string(prompt.size()) + ") + n_predict (" +
                                std::to_string(params.n_predict) + ") exceeds the context of " +
                                std::to_string(ctx.kv().n_cells()) + " tokens");
  Sampler sampler(params.sampling);
  GenerateStats st;
  st.prompt_tokens = int(prompt.size());
  const auto t0 = Clock::now();
  Clock::time_point t_first;

  std::vector<float> logits = prefill(ctx, prompt, 0, params.n_batch);
  int32_t pos = int32_t(prompt.size());
  for (int i = 0; i < params.n_predict; ++i) {
    const int32_t tok = sampler.sample(logits.data(), n_vocab);
    if (i == 0) {
      t_first = Clock::now();
      st.ttft_ms = ms_since(t0);
    }
    if (!params.ignore_eos && model.stops_at(tok)) break;
    ++st.generated_tokens;
    if (!on_token(tok)) break;
    if (i + 1 == params.n_predict) break;
    Batch batch;
    batch.add(tok, pos++, seq_bit(0), true);
    logits = std::move(ctx.forward(batch).logits);
  }
  st.total_ms = ms_since(t0);
  if (st.generated_tokens > 1) {
    const double decode_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_first).count();
    st.decode_tokens_per_s = (st.generated_tokens - 1) / (decode_ms / 1000.0);
  }
  return st;
}

std::vector<int32_t> greedy_ids(Context& ctx, const std::vector<int32_t>& prompt, int n, bool ignore_eos) {
  GenerateParams gp;
  gp.n_predict = n;
  gp.sampling.temperature = 0;
  gp.ignore_eos = ignore_eos;
  std::vector<int32_t> out;
  generate(ctx, prompt, gp, [&](int32_t t) {
    out.push_back(t);
    return true;
  });
  return out;
}

}  // namespace specmesh
