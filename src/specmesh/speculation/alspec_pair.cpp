#include "specmesh/speculation/alspec_pair.hpp"

#include <algorithm>
#include <stdexcept>

#include "specmesh/model/forward_pass.hpp"
#include "specmesh/model/generate.hpp"

namespace specmesh {

AlspecPair::AlspecPair(const Model& model, AlspecParams params) : model_(model), params_(params) {
  // Plain attention on both devices uses the speculative kernel's layout, so a rejected
  // speculation leaves exactly what plain decoding computes.
  ContextParams cp;
  cp.n_ctx = params.n_ctx;
  cp.n_threads = params.n_threads;
  cp.attention_layout = params.spec.layout;
  for (auto& c : ctx_) c = std::make_unique<Context>(model, cp);
}

std::vector<float> AlspecPair::prefill(const std::vector<int32_t>& tokens, int n_batch) {
  std::vector<float> logits = specmesh::prefill(*ctx_[0], tokens, 0, n_batch);
  specmesh::prefill(*ctx_[1], tokens, 0, n_batch);
  return logits;
}

AlspecToken AlspecPair::decode(int32_t token, int32_t pos) {
  const HParams& hp = model_.hparams();
  const size_t E = hp.n_embd, Q = hp.q_dim(), KV = hp.kv_dim();
  Batch batch;
  batch.add(token, pos, seq_bit(0), true);
  // Both devices embed the token; the embedding is a row lookup, not worth gating.
  ForwardPass pass0(*ctx_[0], batch), pass1(*ctx_[1], batch);
  ForwardPass* pass[2] = {&pass0, &pass1};

  AlspecToken out;
  std::vector<float> full(Q), spec(Q), handoff(Q), k(KV), v(KV);
  for (int il = 0; il < hp.n_layer; ++il) {
    for (int d = 0; d < 2; ++d) {
      if (gate_[d].skip_compute()) {
        ++work_[d].pre_skipped;
        continue;
      }
      pass[d]->pre_attention(il);
      ++work_[d].pre_run;
    }

    const int p0 = gate_[0].priority(), p1 = gate_[1].priority();
    gate_[0].all_gather(p1);
    gate_[1].all_gather(p0);
    const int s = gate_[0].sender(), r = 1 - s;
    if (gate_[1].sender() != s) throw std::logic_error("ALSpec: the devices disagree on the sender");

    // The receiver's residual and this layer's K/V rows are either stale (it skipped after a
    // hit) or speculative (it went on after a miss): the sender's replace them.
    std::copy(pass[s]->x(), pass[s]->x() + E, pass[r]->x());
    pass[s]->read_kv(il, 0, k.data(), v.data());
    pass[r]->write_kv(il, 0, k.data(), v.data());

    const SpecCheck check = pass[s]->attention(il, full.data(), spec.data(), &params_.spec);
    ++work_[s].sent;
    handoff = spec;  // what the hidden-state message carries between devices
    work_[r].sync_bytes += (E + 2 * KV + Q) * sizeof(float);

    ++work_[r].received;
    gate_[r].received();
    pass[r]->post_attention(il, handoff.data());
    ++work_[r].post_run;

    const bool hit = verdict_ ? verdict_(il, check) : check.accept;
    gate_[s].sent(hit);
    if (gate_[s].skip_compute()) {
      ++work_[s].post_skipped;
    } else {
      pass[s]->post_attention(il, full.data());
      ++work_[s].post_run;
    }
    out.hits.push_back(hit);
    out.checks.push_back(check);
  }

  // The final all-gather names the device whose residual is the right one.
  const int p0 = gate_[0].priority(), p1 = gate_[1].priority();
  gate_[0].all_gather(p1);
  gate_[1].all_gather(p0);
  out.holder = gate_[0].sender();
  out.logits = std::move(pass[out.holder]->output().logits);
  ++work_[out.holder].heads;
  return out;
}

}  // namespace specmesh
