// Moving a topology's endpoints (`--port-base N`), so that two runs of one file can share a
// host: the ports and socket paths of an example are fixed, and a second run would otherwise
// take them from the first.
#pragma once

#include <string>
#include <vector>

#include "specmesh/topology.hpp"

namespace specmesh {

// The nodes that are not inproc://, in name order, take the i-th slot: tcp endpoints port
// base + 2i on their own host (control base + 2i + 1), ipc endpoints their path with "-pBASE"
// appended. A run and the nodes it starts apply the same base and agree. Throws ConfigError
// when a port would leave 1..65534.
void move_endpoints(Topology& topo, int base);

// A base, below the ephemeral port range, with which every moved endpoint is free now.
// Throws std::runtime_error when none turns up.
int free_port_base(const Topology& topo);

// Throws std::runtime_error "endpoint tcp://127.0.0.1:27310 is in use (node 'head')" for the
// first of `nodes` whose data or control endpoint a listener holds right now.
void check_endpoints_free(const Topology& topo, const std::vector<std::string>& nodes);

}  // namespace specmesh
