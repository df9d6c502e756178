// Timing profiles: how long an operation would take on a device or link we emulate.
//
// Real compute always happens on this machine's CPU; a profile only stretches the elapsed
// time to what the modelled hardware would need, so a small machine can stand in for a mesh
// of accelerators or a cluster of slow nodes while real tokens flow.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace specmesh {

// Which attention kernel a layer runs. ALSpec's speculative flash decode has two sides: the
// sender computes the speculation, the full attention and the verdict; the receiver only waits
// for the speculated output and then runs the rest of the layer early.
enum class AttnMode : uint8_t { flash, spec_sender, spec_receiver };

// Which part of each decoder layer a job runs, for schedules that split a layer across devices:
// the attention alone, or the rest (post-attention ops of one layer and pre-attention ops of the
// next, which add up to one layer's non-attention time).
enum class LayerPart : uint8_t { whole, attention, rest };

// The work one forward call does, as a device model sees it.
struct WorkCost {
  double flops = 0;        // multiply-adds count 2
  double bytes = 0;        // weight and KV bytes read
  int ops = 0;             // kernel launches (matmuls, attention, norms)
  int layers = 0;
  int tokens = 0;
  // Read only by profiles with measured context-dependent timing (DeviceProfile::times).
  int64_t context = 0;     // KV positions the newest token attends to
  AttnMode attn = AttnMode::flash;
  LayerPart part = LayerPart::whole;
  bool head = false;       // also runs the per-token work outside the layers (embedding, LM head)
};

// Seconds as a function of the context length K: linear between (K, seconds) points sorted by
// K and extended along the end segments; a single point is a constant.
struct ContextCurve {
  std::vector<std::pair<double, double>> points;
  // Throws std::invalid_argument for a negative or NaN context, or a curve without points.
  double at(double context) const;
};

// Measured per-layer timing of one model on one accelerator group, at batch 1.
struct LayerTimes {
  ContextCurve non_attention;  // one decoder layer without its attention kernel
  ContextCurve flash;          // FD(K)
  ContextCurve spec_sender;    // SFD_S(K)
  ContextCurve spec_receiver;  // SFD_R(K)
  ContextCurve fixed;          // per token outside the layers: embedding, LM head
  double attention(AttnMode mode, double context) const;
  // One ALSpec layer on a pair (the paper's Appendix F): on a hit the receiver goes on after
  // SFD_R while the sender finishes SFD_S, so the layer takes SFD_R + max(SFD_S - SFD_R, the
  // non-attention ops); a miss takes the sender's whole layer.
  double alspec_hit_layer(double context) const;
  double alspec_miss_layer(double context) const;
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
  // Measured context-dependent timing; when set it replaces layer_s and the rates:
  // layers x (non-attention + attention by mode) + the fixed part when the cost has the head.
  std::optional<LayerTimes> times = std::nullopt;
  // Measured duration of one whole forward pass of the device's model by context, whatever the
  // work (a program timed as one, like a block drafter's forward); when set it replaces the rest.
  std::optional<ContextCurve> forward = std::nullopt;
  // Not 0: time the layers as if the context were this long, whatever the real context (a small
  // model stands in for a long-context run); real compute is unchanged. Negative is an error.
  int64_t virtual_context = 0;
  // Not 0: time a whole forward pass as if it ran this many layers, whatever the stage holds (a
  // small model stands in for a deep one). Ops timed one layer at a time are not scaled.
  int virtual_layers = 0;

  // Modelled duration of `cost` on this device (roofline: compute and memory overlap).
  double seconds(const WorkCost& cost) const;
  // The context the timing curves are read at: virtual_context when set, else the real one.
  double effective_context(int64_t context) const { return double(virtual_context != 0 ? virtual_context : context); }
};

struct LinkProfile {
  double latency_s = 0;
  double bytes_per_s = 0;  // 0: unlimited
  double seconds(double bytes) const { return latency_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0); }
};

// Built-in profiles by name. Llama 3.1 8B decode timing measured on Tenstorrent Wormhole
// (ALSpec paper, Tables 4-7): "n150" (1 chip), "n300" (2 chips, one board), "n300x2" (4 chips,
// two boards), "t3k" (8 chips, four n300 boards); on H100s (Table 3): "h100-tp4". Rate-based:
// "rpi5", "slow-node", "fast-node". Links: "gigabit", "10gbe", "eth-n150", "eth-n300"
// (the Ethernet joining the two chips of an n300), "eth-card" (board to board).
std::optional<DeviceProfile> device_profile(const std::string& name);
std::optional<LinkProfile> link_profile(const std::string& name);
// "n150, n300, ...": the built-in names, for listings and error messages.
std::string device_profile_names();
std::string link_profile_names();

}  // namespace specmesh
