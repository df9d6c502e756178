#include "specmesh/speculation/dflash_decode.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "specmesh/kernels/matmul.hpp"
#include "specmesh/model/sampler.hpp"

namespace specmesh {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Appends rows [0, n) of a pass's captured layers as tap rows (the taps of a row side by side,
// in the drafter's order) to `taps`.
void append_taps(const ForwardOutput& out, size_t n, size_t n_embd, std::vector<float>& taps) {
  for (size_t r = 0; r < n; ++r)
    for (const std::vector<float>& layer : out.captured)
      taps.insert(taps.end(), layer.begin() + r * n_embd, layer.begin() + (r + 1) * n_embd);
}

}  // namespace

double DFlashStats::tau() const { return steps ? double(accepted + steps) / double(steps) : 0.0; }

ContextParams dflash_target_params(const DFlashDrafter& drafter, ContextParams base) {
  base.capture_layers = drafter.config().target_layer_ids;
  return base;
}

DFlashStats dflash_generate(Context& target, const DFlashDrafter& drafter, ThreadPool& draft_pool,
                            const std::vector<int32_t>& prompt, const DFlashParams& params, const TokenCallback& on_token) {
  const Model& model = target.model();
  const HParams& hp = model.hparams();
  const size_t E = size_t(hp.n_embd);
  const int V = hp.n_vocab;
  const int B = params.block ? params.block : drafter.block_size();
  const GenerateParams& gp = params.gen;
  if (B < 1) throw std::invalid_argument("dflash: block size must be at least 1");
  if (prompt.empty()) throw std::invalid_argument("empty prompt: at least one token (e.g. BOS) is needed");
  if (int64_t(prompt.size()) + gp.n_predict + B > target.kv().n_cells())
    throw std::invalid_argument("prompt (" + std::to_string(prompt.size()) + ") + n_predict (" + std::to_string(gp.n_predict) +
                                ") + block (" + std::to_string(B) + ") exceeds the context of " +
                                std::to_string(target.kv().n_cells()) + " tokens");
  if (!target.has_head() || target.layer_begin() != 0) throw std::invalid_argument("dflash: the target context must hold every layer");

  Sampler sampler(gp.sampling);
  DFlashStats st;
  st.tau_hist.assign(size_t(B) + 1, 0);
  st.gen.prompt_tokens = int(prompt.size());
  const auto t0 = Clock::now();
  Clock::time_point t_first;

  // Prefill, keeping the taps of every prompt position: the drafter's first context.
  std::vector<float> taps, logits;
  for (size_t b = 0; b < prompt.size(); b += size_t(gp.n_batch)) {
    const size_t e = std::min(prompt.size(), b + size_t(gp.n_batch));
    Batch batch;
    for (size_t i = b; i < e; ++i) batch.add(prompt[i], int32_t(i), seq_bit(0), i + 1 == prompt.size());
    ForwardOutput out = target.forward(batch);
    if (out.captured.size() != size_t(drafter.n_taps()))
      throw std::invalid_argument("dflash: the target context does not capture the drafter's taps (dflash_target_params)");
    append_taps(out, e - b, E, taps);
    if (e == prompt.size()) logits = std::move(out.logits);
  }
  size_t n_new = prompt.size();

  // Emits a token; false when generation ends (stop token, callback, or n_predict reached).
  bool done = false;
  auto emit = [&](int32_t tok) {
    if (st.gen.generated_tokens == 0) {
      t_first = Clock::now();
      st.gen.ttft_ms = ms_since(t0);
    }
    if (!gp.ignore_eos && model.stops_at(tok)) return !(done = true);
    ++st.gen.generated_tokens;
    if (!on_token(tok) || st.gen.generated_tokens >= gp.n_predict) done = true;
    return !done;
  };

  int32_t anchor = sampler.sample(logits.data(), V);
  int32_t start = int32_t(prompt.size());
  DFlashState draft(drafter, draft_pool);
  std::vector<float> embd, draft_logits;
  std::vector<int32_t> block;
  if (gp.n_predict > 0) emit(anchor);
  while (!done) {
    // The block: the anchor and the drafts, at most as many tokens as may still be emitted.
    const int n = std::min(B, gp.n_predict - st.gen.generated_tokens);
    block.assign(1, anchor);
    if (n > 1) {
      embd.resize(size_t(n) * E);
      drafter.embed_block(model, anchor, n, embd.data());
      const std::vector<float>& out = draft.step(taps.data(), n_new, embd.data(), size_t(n));
      draft_logits.resize(size_t(n - 1) * V);
      matmul(model.output, out.data() + E, size_t(n - 1), draft_logits.data(), target.pool());
      for (int i = 0; i < n - 1; ++i) block.push_back(Sampler::argmax(draft_logits.data() + size_t(i) * V, V));
      taps.clear();
      n_new = 0;
    }

    Batch batch;
    for (int i = 0; i < n; ++i) batch.add(block[i], start + i, seq_bit(0), true);
    ForwardOutput out = target.forward(batch);

    // Accept while the proposal is the target's own sample; the first other sample is emitted
    // in its place and ends the step.
    int a = 0;
    int32_t y = -1;
    for (int i = 0; i < n && !done; ++i) {
      y = sampler.sample(out.logits_row(size_t(i), V), V);
      const bool match = i + 1 < n && block[i + 1] == y;
      emit(y);
      if (!match) break;
      ++a;
    }
    ++st.steps;
    st.drafted += n - 1;
    st.accepted += a;
    ++st.tau_hist[size_t(a) + 1];
    if (done) break;

    // Keep the anchor and the accepted drafts; their taps are the drafter's new context.
    target.kv().seq_rm(0, start + a + 1, -1);
    append_taps(out, size_t(a) + 1, E, taps);
    n_new = size_t(a) + 1;
    start += a + 1;
    anchor = y;
  }
  st.gen.total_ms = ms_since(t0);
  if (st.gen.generated_tokens > 1)
    st.gen.decode_tokens_per_s = (st.gen.generated_tokens - 1) / (std::chrono::duration<double>(Clock::now() - t_first).count());
  return st;
}

}  // namespace specmesh
