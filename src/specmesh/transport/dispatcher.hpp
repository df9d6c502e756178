// A node's dispatcher: hands each envelope for the node's stages (from the gateway) and each
// envelope the node sends to itself (through its Router) to the actor it is for. Work (run
// starts, activations, cache operations) goes to the stage whose layers start where it
// points, a pair's attention sync to its pipeline's stage, hidden states to the stage that
// takes that pipeline's taps (else the head); a cancel goes to every stage;
// everything else is a result (logits, errors, and result types added later) and goes to the
// local head when there is one, which checks its sender itself.
//
// Every message is checked against its sender's role first (the gateway has already bound
// the sender's name to its key): work for a stage only from the node upstream of it (the head
// for a first stage), a pair's sync only from the other group, cancels only from the head (or,
// for a pair's partner, from the target's group, which forwards them). A forged run start,
// cache wipe or cancel from any other node is dropped, counted and logged at most once a
// second. A replan (failover) only from the head goes to the node's `manager`; a node's answer
// to one goes to the head.
//
// The routes change on failover: (route_atom, Route) adds or replaces a stage's route, and
// (upstream_atom, pipeline, layer_begin, node) changes who may send a stage work.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>

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
  std::string upstream;   // the only node that may send it work
  std::string sync_peer;  // the other group of a pair (may send attention syncs); else empty
  // A stage conditioned on another pipeline's hidden states (a block drafter): the pipeline
  // whose HiddenStates it takes, and the nodes that may send them. Empty: they go to the head.
  std::string taps_of;
  std::vector<std::string> tap_senders;
};

using route_atom = caf::atom_constant<caf::atom("route")>;
using upstream_atom = caf::atom_constant<caf::atom("upstream")>;

struct DispatchStats {
  std::atomic<uint64_t> refused{0};    // messages from nodes whose role does not allow them
  std::atomic<uint64_t> unrouted{0};   // messages for a stage this node does not have
};

// Receives (from, Envelope) like a gateway subscriber; it only forwards, so it suits
// Delivery::inline_io. `head` may be null on nodes without one; `head_node` names the node
// that hosts the head (which may be another one). `stats` may be null.
caf::actor spawn_dispatcher(caf::actor_system& sys, std::string node, std::string head_node, std::vector<Route> routes,
                            caf::actor head, caf::actor manager = {}, std::shared_ptr<DispatchStats> stats = nullptr);

}  // namespace specmesh

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(specmesh::Route)
