// A node's dispatcher: hands each envelope for the node's stages (from the gateway) and each
// envelope the node sends to itself (through its Router) to the actor it is for. Work (run
// starts, activations, cache operations) goes to the stage whose layers start where it
// points, a pair's attention sync to its pipeline's stage; a cancel goes to every stage;
// everything else is a result (logits, errors, and
// result types added later) and goes to the local head when there is one.
#pragma once

#include <string>
#include <vector>

#include <caf/actor.hpp>

#include "specmesh/messages/protocol.hpp"

namespace caf {
class actor_system;
}

namespace specmesh {

// The stage of `pipeline` whose layer range starts at `layer_begin`.
struct Route {
  std::string pipeline;
  int layer_begin;
  caf::actor stage;
};

// Receives (from, Envelope) like a gateway subscriber; it only forwards, so it suits
// Delivery::inline_io. `head` may be null on nodes without one.
caf::actor spawn_dispatcher(caf::actor_system& sys, std::string node, std::vector<Route> routes, caf::actor head);

}  // namespace specmesh
