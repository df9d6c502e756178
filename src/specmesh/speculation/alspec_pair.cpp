#include "specmesh/speculation/alspec_pair.hpp"

#include <stdexcept>

#include "specmesh/model/generate.hpp"

namespace specmesh {

AlspecPair::AlspecPair(const Model& model, AlspecParams params) : model_(model), params_(params) {
  // Plain attention on both devices uses the speculative kernel's layout, so a rejected
  // speculation leaves exactly what plain decoding computes.
  ContextParams cp;
  cp.n_ctx = params.n_ctx;
  cp.n_threads = params.n_threads;
  cp.attention_layout = params.spec.layout;
  for (int d = 0; d < 2; ++d) {
    group_[d] = std::make_unique<TpGroup>(model, cp, params.tp);
    for (int r = 0; r < params.tp; ++r)
      dev_[d].push_back(std::make_unique<AlspecDevice>(group_[d]->rank(r), d, params.spec));
  }
}

std::vector<float> AlspecPair::prefill(const std::vector<int32_t>& tokens, int n_batch) {
  std::vector<float> logits;
  for (int d = 0; d < 2; ++d) {
    std::vector<std::vector<float>> out(size_t(params_.tp));
    group_[d]->run([&](int r) { out[size_t(r)] = specmesh::prefill(group_[d]->rank(r), tokens, 0, n_batch); });
    if (d == 0) logits = std::move(out[0]);
  }
  return logits;
}

AlspecToken AlspecPair::decode(int32_t token, int32_t pos) {
  const size_t n = size_t(params_.tp);
  // Every rank of a group does the same step; the ranks exchange shares, so they run at once.
  auto each = [&](int g, const std::function<void(AlspecDevice&, int)>& f) {
    group_[g]->run([&](int r) { f(*dev_[g][size_t(r)], r); });
  };
  auto gather = [&] {
    for (size_t r = 0; r < n; ++r) {
      AlspecDevice& d0 = *dev_[0][r];
      AlspecDevice& d1 = *dev_[1][r];
      const int p0 = d0.gate().priority(), p1 = d1.gate().priority();
      d0.gather(p1);
      d1.gather(p0);
      if (d0.is_sender() == d1.is_sender()) throw std::logic_error("ALSpec: the devices disagree on the sender");
    }
  };
  Batch batch;
  batch.add(token, pos, seq_bit(0), true);
  for (int g = 0; g < 2; ++g)
    for (auto& d : dev_[g]) d->begin(batch);
  AlspecToken out;
  std::vector<AlspecHandoff> handoffs(n);
  for (int il = 0; il < model_.hparams().n_layer; ++il) {
    for (int g = 0; g < 2; ++g) each(g, [&](AlspecDevice& d, int) { d.pre(il); });
    gather();
    const int s = dev_[0][0]->is_sender() ? 0 : 1;
    each(s, [&](AlspecDevice& d, int r) { handoffs[size_t(r)] = d.attend(il); });
    each(1 - s, [&](AlspecDevice& d, int r) { d.receive(il, handoffs[size_t(r)]); });
    const SpecCheck check = dev_[s][0]->check();
    const bool hit = verdict_ ? verdict_(il, check) : check.accept;
    each(s, [&](AlspecDevice& d, int) { d.settle(il, hit); });
    out.hits.push_back(hit);
    out.checks.push_back(check);
  }
  // The final all-gather names the device whose residual is the right one.
  gather();
  const int h = dev_[0][0]->is_sender() ? 0 : 1;
  out.holder = h;
  std::vector<std::vector<float>> logits(n);
  each(h, [&](AlspecDevice& d, int r) { logits[size_t(r)] = d.output(); });
  out.logits = std::move(logits[0]);
  for (auto& d : dev_[1 - h]) d->abort();
  return out;
}

std::vector<int32_t> AlspecPair::greedy(const std::vector<int32_t>& prompt, int n, const Step& each) {
  const int V = model_.hparams().n_vocab;
  std::vector<float> logits = prefill(prompt);
  std::vector<int32_t> out;
  int32_t pos = int32_t(prompt.size());
  for (int i = 0; i < n; ++i) {
    out.push_back(Sampler::argmax(logits.data(), V));
    if (i + 1 == n) break;
    AlspecToken t = decode(out.back(), pos);
    if (each) each(t, out.back(), pos);
    ++pos;
    logits = std::move(t.logits);
  }
  return out;
}

}  // namespace specmesh
