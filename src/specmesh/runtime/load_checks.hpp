// Checks of a topology against its loaded models, made before any node starts: a draft
// whose tokens mean other text, or KV caches larger than the machine, are refused with the
// key that causes them (ConfigError "file:line: key: what"), never found later as nonsense
// tokens or an allocation failure inside an actor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "specmesh/runtime/node.hpp"

namespace specmesh {

// Every role's model has the target's vocabulary: as many tokens, each with the same text.
// The error names both models and the first token that differs.
void check_vocabularies(const Topology& topo, ModelCache& models);

// The KV caches of the stages on each of `nodes` (every role's share of its layers, at the
// run's context size) fit together in `memory_bytes`, this machine's physical memory unless
// given. Layer ranges must be resolved.
void check_kv_memory(const Topology& topo, ModelCache& models, const std::vector<std::string>& nodes,
                     uint64_t memory_bytes = 0);

}  // namespace specmesh
