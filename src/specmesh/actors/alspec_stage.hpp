// One device group of an attention-level speculation pair (ALSpec): a stage holding every
// layer of the model, with its own KV cache on its own device, that decodes each token op by
// op together with its partner in another stage (another device, node or process).
//
// Runs come from the head to group 0 (the target's pipeline), which passes each one on to its
// partner, so both see the same runs in the same order. A batch of several tokens (a prompt
// chunk) runs plainly on both. A single token steps through the layers with alspec_device:
// per layer the groups exchange priorities (attention_sync/priority), the sender sends its
// state and the speculative attention output (attention_sync/handoff); after the last layer
// the group holding the right state sends a report and then the logits to the head.
// With a measured timing profile (DeviceProfile::times) each op waits out its modelled time
// after its real compute: the rest of a layer (post-attention and the next pre-attention), the
// attention as sender (the hand-off leaves at the receiver's modelled SFD_R, the verdict at
// SFD_S) and the LM head; a hit layer's overlap then comes from the two groups running at
// once. Other profiles price a decode step as a whole forward pass on each group.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <caf/actor.hpp>

#include "specmesh/actors/stage.hpp"
#include "specmesh/speculation/alspec_device.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

struct AlspecStageConfig {
  // This group's stage: its pipeline is its role, the context holds every layer, next_node
  // is the head; taps are not supported. A tensor-parallel stage (tp_devices) splits the
  // group over several devices: rank 0 talks to the partner and the head, the ranks share what
  // it receives, and the hand-off carries whole rows, so the groups may differ in size.
  StageConfig stage;
  int self = 0;                 // 0: the group the head launches runs into, 1: its partner
  std::string run_pipeline;     // that role, which the logits and reports name
  std::string peer_node;        // where the other group's stage runs
  std::string peer_pipeline;    // its role
  AlspecSettings settings;
  // How long a step waits for the partner before it reports an error (a partner that dies
  // is also reported to the head by the gateway, usually sooner).
  std::chrono::milliseconds peer_timeout{10000};
};

// Takes (from, Envelope) messages carrying RunStart, KvCacheOp, Cancel or AttentionSync; runs
// and cache operations it cannot take are refused on arrival as a plain stage does
// (admission.hpp, StageConfig::max_runs_per_sender).
// Throws std::invalid_argument when the stage does not hold every layer or asks for taps, or its
// group cannot be split over its devices.
caf::actor spawn_alspec_stage(caf::actor_system& sys, AlspecStageConfig cfg, std::shared_ptr<StageStats> stats);

}  // namespace specmesh
