// What a request asks of the head beyond its prompt: its strategy and parameters, checked
// against the strategy registry and the topology before the request is queued.
#pragma once

#include <string>

#include "specmesh/generation.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/topology.hpp"

namespace specmesh {

struct RequestStrategy {
  const StrategyInfo* info = nullptr;  // null: the configuration's strategy and parameters
  StrategyParams params;
};

// The request's strategy (GenerationRequest::strategy and ::params) for a checked topology
// whose target context is n_ctx cells. Throws std::invalid_argument naming the unknown
// strategy, the role the topology lacks, or the parameter and why its value is wrong.
RequestStrategy request_strategy(const Topology& topo, int n_ctx, const GenerationRequest& request);

}  // namespace specmesh
