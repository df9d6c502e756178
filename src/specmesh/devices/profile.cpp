#include "specmesh/profiles.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "specmesh/devices/tenstorrent.hpp"

namespace specmesh {

double ContextCurve::at(double k) const {
  if (std::isnan(k) || k < 0) throw std::invalid_argument("context length must be a non-negative number, got " + std::to_string(k));
  if (points.empty()) throw std::invalid_argument("context curve has no points");
  if (points.size() == 1) return points.front().second;
  // The segment holding k, or the nearest end segment to extend.
  size_t i = 1;
  while (i + 1 < points.size() && points[i].first < k) ++i;
  const auto& [k0, s0] = points[i - 1];
  const auto& [k1, s1] = points[i];
  return s0 + (s1 - s0) * (k - k0) / (k1 - k0);
}

double LayerTimes::attention(AttnMode mode, double k) const {
  switch (mode) {
    case AttnMode::flash: return flash.at(k);
    case AttnMode::spec_sender: return spec_sender.at(k);
    case AttnMode::spec_receiver: return spec_receiver.at(k);
  }
  throw std::invalid_argument("unknown attention mode");
}

double LayerTimes::alspec_hit_layer(double k) const {
  const double sender = attention(AttnMode::spec_sender, k), receiver = attention(AttnMode::spec_receiver, k);
  return receiver + std::max(sender - receiver, non_attention.at(k));
}

double LayerTimes::alspec_miss_layer(double k) const { return non_attention.at(k) + attention(AttnMode::spec_sender, k); }

double DeviceProfile::seconds(const WorkCost& c) const {
  // A negative virtual context is refused by the curves.
  // A job that did no model work (a cache operation, a job paced on its own) costs nothing.
  if (forward) return c.layers > 0 || c.tokens > 0 ? forward->at(effective_context(c.context)) : 0.0;
  const int layers = virtual_layers > 0 && c.part == LayerPart::whole && c.layers > 0 ? virtual_layers : c.layers;
  if (times) {
    const double k = effective_context(c.context);
    double layer = 0;
    if (c.part != LayerPart::attention) layer += times->non_attention.at(k) + layer_token_s * std::max(0, c.tokens - 1);
    if (c.part != LayerPart::rest) layer += times->attention(c.attn, k);
    return layers * layer + (c.head ? times->fixed.at(k) : 0);
  }
  if (layer_s > 0 || layer_token_s > 0) return layers * (layer_s + layer_token_s * std::max(0, c.tokens - 1));
  const double compute = flops_per_s > 0 ? c.flops / flops_per_s : 0;
  const double memory = bytes_per_s > 0 ? c.bytes / bytes_per_s : 0;
  return std::max(compute, memory) + c.ops * op_overhead_s;
}

namespace {

// Rate-based profiles; rpi5: LPDDR4X ~17 GB/s peak, ~10 usable.
const std::map<std::string, DeviceProfile>& rate_profiles() {
  static const std::map<std::string, DeviceProfile> table = {
      {"rpi5", {"rpi5", 30e9, 10e9, 2e-6}},
      {"slow-node", {"slow-node", 5e9, 2e9, 5e-6}},
      {"fast-node", {"fast-node", 200e9, 40e9, 1e-6}},
  };
  return table;
}

// Wormhole chips talk over 100 Gb/s Ethernet ports. Assumed: the two chips of an n300 are
// joined on the board by two ports (25 GB/s, ~1 us); boards are joined by one port per hop
// through a cable, with another ~1 us of SerDes and cable on the way.
const std::map<std::string, LinkProfile>& links() {
  static const std::map<std::string, LinkProfile> table = {
      {"gigabit", {100e-6, 125e6}},
      {"10gbe", {30e-6, 1.25e9}},
      {"eth-n150", {5e-6, 12.5e9}},  // one n150 port, 100 Gb/s
      {"eth-n300", {1e-6, 25e9}},
      {"eth-card", {2e-6, 12.5e9}},
  };
  return table;
}

}  // namespace

std::optional<DeviceProfile> device_profile(const std::string& name) {
  if (auto measured = accelerator_profile(name)) return measured;
  auto it = rate_profiles().find(name);
  if (it == rate_profiles().end()) return std::nullopt;
  return it->second;
}

std::optional<LinkProfile> link_profile(const std::string& name) {
  auto it = links().find(name);
  if (it == links().end()) return std::nullopt;
  return it->second;
}

std::string device_profile_names() {
  std::string out;
  for (const std::string& n : accelerator_profile_names()) out += (out.empty() ? "" : ", ") + n;
  for (const auto& [n, p] : rate_profiles()) out += ", " + n;
  return out;
}

std::string link_profile_names() {
  std::string out;
  for (const auto& [n, l] : links()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace specmesh
