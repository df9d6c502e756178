#include "specmesh/runtime/port_base.hpp"

#include <algorithm>
#include <stdexcept>

#include "specmesh/transport/endpoint.hpp"

namespace specmesh {

namespace {

bool movable(const NodeSpec& n) { return n.endpoint.rfind("inproc://", 0) != 0; }

int slots(const Topology& topo) {
  int n = 0;
  for (const auto& [name, node] : topo.nodes) n += movable(node);
  return n;
}

}  // namespace

void move_endpoints(Topology& topo, int base) {
  int slot = 0;
  for (auto& [name, node] : topo.nodes) {
    if (!movable(node)) continue;
    const int port = base + 2 * slot++;
    if (node.endpoint.rfind("tcp://", 0) == 0) {
      if (base < 1 || port + 1 > 65534)
        throw ConfigError(topo.path + ": nodes." + name + ".endpoint: port base " + std::to_string(base) + " gives port " +
                          std::to_string(port) + ", outside 1..65533 (" + std::to_string(slot) +
                          " nodes use two ports each)");
      node.endpoint = "tcp://" + parse_tcp(node.endpoint).host + ":" + std::to_string(port);
    } else {
      node.endpoint += "-p" + std::to_string(base);
    }
  }
}

int free_port_base(const Topology& topo) {
  const int n = std::max(1, slots(topo));
  for (int attempt = 0; attempt < 50; ++attempt) {
    const int base = free_port_range(2 * n);
    Topology moved = topo;
    move_endpoints(moved, base);
    bool free = true;
    for (const auto& [name, node] : moved.nodes) free = free && endpoint_in_use(node.endpoint).empty();
    if (free) return base;
  }
  throw std::runtime_error("no free port base for the " + std::to_string(n) + " nodes of " + topo.path);
}

void check_endpoints_free(const Topology& topo, const std::vector<std::string>& nodes) {
  for (const std::string& name : nodes) {
    const std::string taken = endpoint_in_use(topo.nodes.at(name).endpoint);
    if (!taken.empty())
      throw std::runtime_error("endpoint " + taken + " is in use (node '" + name + "'); if another run of " + topo.path +
                               " holds it, `specmesh run --port-base 0` moves this run's endpoints to free ones");
  }
}

}  // namespace specmesh
