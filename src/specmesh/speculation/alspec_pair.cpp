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
    ctx_[d] = std::make_unique<Context>(model, cp);
    dev_[d] = std::make_unique<AlspecDevice>(*ctx_[d], d, params.spec);
  }
}

std::vector<float> AlspecPair::prefill(const std::vector<int32_t>& tokens, int n_batch) {
  std::vector<float> logits = specmesh::prefill(*ctx_[0], tokens, 0, n_batch);
  specmesh::prefill(*ctx_[1], tokens, 0, n_batch);
  return logits;
}

AlspecToken AlspecPair::decode(int32_t token, int32_t pos) {
  AlspecDevice& d0 = *dev_[0];
  AlspecDevice& d1 = *dev_[1];
  auto gather = [&] {
    const int p0 = d0.gate().priority(), p1 = d1.gate().priority();
    d0.gather(p1);
    d1.gather(p0);
    if (d0.is_sender() == d1.is_sender()) throw std::logic_error("ALSpec: the devices disagree on the sender");
  };
  Batch batch;
  batch.add(token, pos, seq_bit(0), true);
  d0.begin(batch);
  d1.begin(batch);
  AlspecToken out;
  for (int il = 0; il < model_.hparams().n_layer; ++il) {
    d0.pre(il);
    d1.pre(il);
    gather();
    AlspecDevice& s = d0.is_sender() ? d0 : d1;
    AlspecDevice& r = d0.is_sender() ? d1 : d0;
    r.receive(il, s.attend(il));
    const SpecCheck check = s.check();
    const bool hit = verdict_ ? verdict_(il, check) : check.accept;
    s.settle(il, hit);
    out.hits.push_back(hit);
    out.checks.push_back(check);
  }
  // The final all-gather names the device whose residual is the right one.
  gather();
  AlspecDevice& holder = d0.is_sender() ? d0 : d1;
  out.holder = holder.gate().self();
  out.logits = holder.output();
  (d0.is_sender() ? d1 : d0).abort();
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
