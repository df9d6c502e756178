#include "specmesh/speculation/alspec_gating.hpp"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace specmesh {

AlspecGate::AlspecGate(int self) : self_(self) {
  if (self != 0 && self != 1) throw std::invalid_argument("ALSpec pairs two devices: 0 and 1");
}

void AlspecGate::all_gather(int other_priority) {
  if (other_priority < kHit || other_priority > kMiss)
    throw std::logic_error("ALSpec priority " + std::to_string(other_priority) + " is not 0, 1 or 2");
  p_[1 - self_] = other_priority;
  if (p_[0] == p_[1])
    throw std::logic_error("ALSpec priorities tie at " + std::to_string(p_[0]) + ": the devices disagree on roles");
}

void AlspecGate::sent(bool hit) {
  if (role() != AlspecRole::Sender) throw std::logic_error("ALSpec: a receiver cannot settle a speculation");
  p_[self_] = hit ? kHit : kMiss;
}

void AlspecGate::received() {
  if (role() != AlspecRole::Receiver) throw std::logic_error("ALSpec: the sender does not receive");
  p_[self_] = kReceiver;
}

int emulated_hits(int n_layer, double rate) {
  if (!(rate >= 0 && rate <= 1)) throw std::invalid_argument("emulated hit rate must be in [0, 1], got " + std::to_string(rate));
  if (n_layer < 1) throw std::invalid_argument("emulated hits need at least one layer");
  return int(std::lround(rate * n_layer));
}

bool emulated_hit(int layer, int n_layer, double rate) {
  const int64_t h = emulated_hits(n_layer, rate);
  return (int64_t(layer) + 1) * h / n_layer > int64_t(layer) * h / n_layer;
}

}  // namespace specmesh
