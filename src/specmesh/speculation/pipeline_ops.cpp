#include "specmesh/speculation/pipeline_ops.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace specmesh {

namespace {
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}
}  // namespace

std::vector<int32_t> sync_cache(StrategyHost& host, const std::string& role, std::vector<int32_t>& cached,
                                const std::vector<int32_t>& want, int32_t seq) {
  // The last wanted token is always fed again: its logits are what the caller is after.
  const size_t keep = std::min(common_prefix(cached, want), want.empty() ? 0 : want.size() - 1);
  if (keep < cached.size()) host.kv_ops(role, {{KvOpKind::remove, seq, -1, int32_t(keep), -1}});
  cached.resize(keep);
  return {want.begin() + keep, want.end()};
}

uint64_t feed(StrategyHost& host, const std::string& role, std::vector<int32_t>& cached,
              const std::vector<int32_t>& toks, size_t tail) {
  uint64_t last = 0;
  const size_t n_batch = size_t(std::max(1, host.n_batch()));
  size_t i = 0;
  while (i < toks.size()) {
    // The rows that need logits stay in the final chunk.
    size_t e = std::min(toks.size(), i + n_batch);
    if (e < toks.size() && toks.size() - e < tail) e = toks.size() - tail;
    if (e <= i) e = toks.size();
    Batch b;
    for (size_t k = i; k < e; ++k)
      b.add(toks[k], int32_t(cached.size() + (k - i)), seq_bit(0), k + tail >= toks.size());
    cached.insert(cached.end(), toks.begin() + i, toks.begin() + e);
    last = host.launch(role, b, false);
    i = e;
  }
  return last;
}

std::vector<float> rows_of(const Logits& l, size_t want_rows, int n_vocab, uint64_t run) {
  if (l.rows.size() != want_rows || l.logits.numel() != want_rows * size_t(n_vocab))
    throw std::runtime_error("run " + std::to_string(run) + ": expected " + std::to_string(want_rows) + " rows of " +
                             std::to_string(n_vocab) + " logits, got " + std::to_string(l.rows.size()));
  return l.logits.data.to_vector<float>();
}

void OneRunPerToken::start() { awaited_ = feed(h_, kTargetRole, cached_, h_.tokens(), 1); }

void OneRunPerToken::on_logits(uint64_t run, const Logits& l) {
  if (run != awaited_) return;  // an earlier prefill chunk
  auto row = rows_of(l, 1, h_.vocab(), run);
  if (!h_.accept(h_.sampler().sample(row.data(), h_.vocab()))) return;
  awaited_ = feed(h_, kTargetRole, cached_, {h_.tokens().back()}, 1);
}

bool OneRunPerToken::context_shifted(int n_keep, int n_discard) {
  if (n_keep < 0 || n_discard < 0 || size_t(n_keep + n_discard) > cached_.size()) return false;
  shift_cached(cached_, n_keep, n_discard);
  return true;
}

float top_probability(const float* logits, int n_vocab) {
  float m = logits[0];
  for (int i = 1; i < n_vocab; ++i) m = std::max(m, logits[i]);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(double(logits[i]) - m);
  return float(1.0 / sum);
}

}  // namespace specmesh
