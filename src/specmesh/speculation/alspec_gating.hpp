// Priority gating for attention-level speculation on two devices (ALSpec's "static graph,
// dynamic concurrency"): both devices walk the same op list, and a priority per device says
// which ops each one runs and who sends at each attention.
//
// Priorities: 2 = sender whose speculation missed (it holds the right state), 1 = receiver
// (it went on with the speculated attention output), 0 = sender whose speculation hit (the
// receiver holds the right state, so this device has nothing useful to compute). Start: [2, 0].
// Per layer, on every device:
//   skip_compute(p[self] == 0): the ops before attention
//   all_gather(p)             : the higher priority sends, the other receives
//   attention                 : sender -> 0 on a hit, 2 on a miss; receiver -> 1
//   skip_compute(p[self] == 0): the ops after attention
// So a hit swaps the roles at the next attention (0 < 1) and a miss keeps them (2 > 1), and a
// tie can never come up; one would mean the devices disagree about who holds the state.
#pragma once

#include <array>

namespace specmesh {

enum class AlspecRole { Sender, Receiver };

// One device's view: its own priority, and the other's as of the last all-gather.
class AlspecGate {
 public:
  static constexpr int kHit = 0, kReceiver = 1, kMiss = 2;

  // Device `self` (0 or 1) of the pair, at the initial priorities [2, 0].
  explicit AlspecGate(int self);

  int self() const { return self_; }
  int priority() const { return p_[self_]; }
  const std::array<int, 2>& priorities() const { return p_; }

  // Whether this device skips the gated ops (those after an attention, and the next layer's
  // before it) at its current priority.
  bool skip_compute() const { return p_[self_] == kHit; }

  // Takes the other device's priority; throws std::logic_error on a tie or a value outside
  // {0, 1, 2}.
  void all_gather(int other_priority);

  // Who this device is at the attention after the last all-gather; sender() is the device
  // index. After the last layer's all-gather, the sender is the device holding the result.
  AlspecRole role() const { return sender() == self_ ? AlspecRole::Sender : AlspecRole::Receiver; }
  int sender() const { return p_[0] > p_[1] ? 0 : 1; }

  // The attention's outcome on this device: a sender records its verdict, a receiver (which
  // does not know it yet) records that it went on speculatively. Throw std::logic_error when
  // called in the other role.
  void sent(bool hit);
  void received();

 private:
  int self_;
  std::array<int, 2> p_{kMiss, kHit};
};

// Timing emulation: a fixed verdict pattern instead of the check, so a small model can stand in
// for a measured hit rate. A token gets exactly round(rate x n_layer) hits (halves round up),
// spread evenly: layer l hits when floor((l + 1) H / n) > floor(l H / n) for H hits of n, so
// the hits fall on the last layer of each run of about n / H layers. Throws
// std::invalid_argument for a rate outside [0, 1] or n_layer < 1.
int emulated_hits(int n_layer, double rate);
bool emulated_hit(int layer, int n_layer, double rate);

}  // namespace specmesh
