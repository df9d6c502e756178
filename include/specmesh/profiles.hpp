// Timing profiles: how long an operation would take on a device or link we emulate.
//
// Real compute always happens on this machine's CPU; a profile only stretches the elapsed
// time to what the modelled hardware would need, so a small machine can stand in for a mesh
// of accelerators or a cluster of slow nodes while real tokens flow.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace specmesh {

// The work one forward call does, as a device model sees it.
struct WorkCost {
  double flops = 0;        // multiply-adds count 2
  double bytes = 0;        // weight and KV bytes read
  int ops = 0;             // kernel launches (matmuls, attention, norms)
  int layers = 0;
  int tokens = 0;
};

struct DeviceProfile {
  std::string name;
  double flops_per_s = 0;       // 0: compute time not modelled
  double bytes_per_s = 0;       // 0: memory time not modelled
  double op_overhead_s = 0;     // fixed cost per kernel launch
  // Per-op table: seconds per layer at batch 1 plus seconds per extra token; used instead of
  // the rates when set (e.g. measured per-layer durations of a real chip).
  double layer_s = 0;
  double layer_token_s = 0;

  // Modelled duration of `cost` on this device (roofline: compute and memory overlap).
  double seconds(const WorkCost& cost) const;
};

struct LinkProfile {
  double latency_s = 0;
  double bytes_per_s = 0;  // 0: unlimited
  double seconds(double bytes) const { return latency_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0); }
};

// Built-in profiles by name: "n150" (Tenstorrent Wormhole n150), "rpi5", "slow-node",
// "fast-node"; links "gigabit", "10gbe", "eth-n150".
std::optional<DeviceProfile> device_profile(const std::string& name);
std::optional<LinkProfile> link_profile(const std::string& name);

}  // namespace specmesh
