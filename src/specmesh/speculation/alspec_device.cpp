#include "specmesh/speculation/alspec_device.hpp"

#include <algorithm>
#include <stdexcept>

namespace specmesh {

AlspecDevice::AlspecDevice(Context& ctx, int self, SpecConfig spec) : ctx_(ctx), spec_(spec), gate_(self) {}

void AlspecDevice::begin(const Batch& batch) {
  if (batch.size() != 1) throw std::invalid_argument("ALSpec: a decode step takes one token");
  pass_ = std::make_unique<ForwardPass>(ctx_, batch);
}

void AlspecDevice::pre(int il) {
  if (gate_.skip_compute()) {
    ++work_.pre_skipped;
    return;
  }
  pass_->pre_attention(il);
  ++work_.pre_run;
}

AlspecHandoff AlspecDevice::attend(int il, const std::function<void(const AlspecHandoff&)>& ship) {
  if (!is_sender()) throw std::logic_error("ALSpec: attend() on the receiver");
  const HParams& hp = ctx_.model().hparams();
  k_.resize(size_t(ctx_.kv_dim()));
  v_.resize(size_t(ctx_.kv_dim()));
  pass_->read_kv(il, 0, k_.data(), v_.data());
  full_.resize(size_t(ctx_.q_dim()));
  spec_out_.resize(size_t(ctx_.q_dim()));
  const AlspecHandoff h{{pass_->x(), size_t(hp.n_embd)}, k_, v_, spec_out_};
  std::function<void()> ready;
  if (ship) ready = [&] { ship(h); };
  check_ = pass_->attention(il, full_.data(), spec_out_.data(), &spec_, ready);
  if (TpLink* link = ctx_.tp_link()) {
    // One decision for the whole layer: every rank of the group sums the same squares.
    float sums[2] = {check_.d2, check_.n2};
    link->all_reduce_sum(sums, 2);
    check_.d2 = sums[0];
    check_.n2 = sums[1];
    check_.accept = check_.exact || spec_accept(check_.d2, check_.n2, spec_.lambda);
  }
  ++work_.sent;
  return h;
}

void AlspecDevice::settle(int il, bool hit) {
  gate_.sent(hit);
  if (gate_.skip_compute()) {
    ++work_.post_skipped;
    return;
  }
  pass_->post_attention(il, full_.data());
  ++work_.post_run;
}

void AlspecDevice::receive(int il, const AlspecHandoff& h) {
  const HParams& hp = ctx_.model().hparams();
  if (h.residual.size() != size_t(hp.n_embd) || h.k.size() != size_t(ctx_.kv_dim()) ||
      h.v.size() != size_t(ctx_.kv_dim()) || h.spec.size() != size_t(ctx_.q_dim()))
    throw std::invalid_argument("ALSpec: the hand-off does not match the model's dimensions");
  // The residual and this layer's K/V rows here are stale (skipped after a hit) or
  // speculative (went on after a miss): the sender's replace them.
  std::copy(h.residual.begin(), h.residual.end(), pass_->x());
  pass_->write_kv(il, 0, h.k.data(), h.v.data());
  work_.sync_bytes += h.bytes();
  ++work_.received;
  gate_.received();
  pass_->post_attention(il, h.spec.data());
  ++work_.post_run;
}

std::vector<float> AlspecDevice::output() {
  if (!is_sender()) throw std::logic_error("ALSpec: output() on a device that does not hold the state");
  std::vector<float> logits = std::move(pass_->output().logits);
  pass_.reset();
  ++work_.heads;
  return logits;
}

}  // namespace specmesh
