// Loopback ports for tests: a tcp:// endpoint uses its port and the next one (control).
#pragma once

#include "specmesh/transport/endpoint.hpp"

namespace specmesh::test {

// Two consecutive ports that are free right now (see free_port_range).
inline int free_port_pair() { return free_port_range(2); }

}  // namespace specmesh::test
