#include "specmesh/profiles.hpp"

#include <algorithm>

namespace specmesh {

double DeviceProfile::seconds(const WorkCost& c) const {
  if (layer_s > 0 || layer_token_s > 0) return c.layers * (layer_s + layer_token_s * std::max(0, c.tokens - 1));
  const double compute = flops_per_s > 0 ? c.flops / flops_per_s : 0;
  const double memory = bytes_per_s > 0 ? c.bytes / bytes_per_s : 0;
  return std::max(compute, memory) + c.ops * op_overhead_s;
}

std::optional<DeviceProfile> device_profile(const std::string& name) {
  // Public figures: n150 has 288 GB/s GDDR6 and ~74 TFLOP/s at BF16; dispatch costs are
  // tens of microseconds per op from the host. rpi5: LPDDR4X ~17 GB/s peak, ~10 usable.
  static const std::map<std::string, DeviceProfile> table = {
      {"n150", {"n150", 74e12, 288e9, 20e-6}},
      {"rpi5", {"rpi5", 30e9, 10e9, 2e-6}},
      {"slow-node", {"slow-node", 5e9, 2e9, 5e-6}},
      {"fast-node", {"fast-node", 200e9, 40e9, 1e-6}},
  };
  auto it = table.find(name);
  if (it == table.end()) return std::nullopt;
  return it->second;
}

std::optional<LinkProfile> link_profile(const std::string& name) {
  static const std::map<std::string, LinkProfile> table = {
      {"gigabit", {100e-6, 125e6}},
      {"10gbe", {30e-6, 1.25e9}},
      {"eth-n150", {5e-6, 12.5e9}},  // n150 Ethernet ports, 100 Gb/s
  };
  auto it = table.find(name);
  if (it == table.end()) return std::nullopt;
  return it->second;
}

}  // namespace specmesh
