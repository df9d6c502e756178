#include "specmesh/speculation/alspec_gating.hpp"

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

}  // namespace specmesh
