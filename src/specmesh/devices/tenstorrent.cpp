#include "specmesh/devices/tenstorrent.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "specmesh/devices/latency_tables.hpp"

namespace specmesh {

namespace {

// Effective DRAM bandwidth of flash decode at each degree. With 8 or 4 KV heads per chip the
// kernel is memory bound: 180 GB/s is the best the FlashDecode report measured on a Wormhole
// chip. With 2 and 1 heads per chip many cores share a head and NoC traffic of the reduction
// takes over (the report's steeper slope), so those two are fitted to the paper's printed
// results: 1.65x for ALSpec (4+4 chips) over 8-chip tensor parallel at 96K and an 87.5 % hit
// rate, and no gain from 4 to 8 chips at 128K (equal tokens/s).
struct FlashDecodeFit {
  int tp;
  double bytes_per_s;
};
constexpr FlashDecodeFit kFlashDecode[] = {{1, 180e9}, {2, 180e9}, {4, 121e9}, {8, 65e9}};

constexpr int kHeadDim = 128;
constexpr int kKvHeads = 8;
constexpr double kKvBytesPerElement = 1.0;  // BFP8 cache, counted as the report does
// Fig. 7 runs speculative flash decode with chunks of 256: the speculation covers 2 chunks.
constexpr int64_t kSpecChunk = 256;
// The speculated output sent to the receiver: 32 (padded) query heads x 128, bf16.
constexpr double kSpecBytes = 32.0 * kHeadDim * 2;
constexpr double kTableContext = 1024;  // Tables 4-7 were measured at 1K

void check_context(int64_t context) {
  if (context < 0) throw std::invalid_argument("context length must not be negative, got " + std::to_string(context));
}

LayerTimes wormhole_times(const WormholeLatencyTable& t, double bytes_per_s, const LinkProfile& hop) {
  double attention_ns = 0;
  for (const OpLatency& row : t.layer_ops)
    if (row.op == kAttentionOp) attention_ns = row.ns;
  const double per_token_s = 2.0 * kHeadDim * (kKvHeads / t.tp) * kKvBytesPerElement / bytes_per_s;
  const double fd_at_table = attention_ns * 1e-9;
  auto line = [&](double k) { return fd_at_table + (k - kTableContext) * per_token_s; };
  const double far = 128 * 1024;

  LayerTimes lt;
  lt.non_attention.points = {{0, t.layer_total_ns * 1e-9}};
  lt.flash.points = {{kTableContext, fd_at_table}, {far, line(far)}};
  lt.spec_sender = lt.flash;
  lt.spec_receiver.points = {{0, line(2 * kSpecChunk) + hop.seconds(kSpecBytes)}};
  lt.fixed.points = {{0, t.head_total_ns * 1e-9}};
  return lt;
}

MeshTiming build_wormhole() {
  MeshTiming m;
  m.name = "wormhole-llama3.1-8b";
  // Sender and receiver chips of a speculative pair sit on different boards.
  const LinkProfile hop = *link_profile("eth-card");
  for (const WormholeLatencyTable& t : wormhole_llama31_8b_tables())
    for (const FlashDecodeFit& f : kFlashDecode)
      if (f.tp == t.tp) m.by_tp[t.tp] = wormhole_times(t, f.bytes_per_s, hop);
  return m;
}

MeshTiming build_h100() {
  MeshTiming m;
  m.name = "h100-llama3-8b";
  LayerTimes lt;
  for (const H100Row& r : h100_llama3_8b_table()) {
    const double k = double(r.context);
    const double attn = r.attn_us * 1e-6, rest = r.non_attn_us * 1e-6;
    lt.flash.points.emplace_back(k, attn);
    lt.non_attention.points.emplace_back(k, rest);
    lt.fixed.points.emplace_back(k, 1.0 / r.tp4_tok_s - m.n_layers * (attn + rest));
  }
  lt.spec_sender = lt.flash;
  lt.spec_receiver.points = {{0, 0.0}};
  m.by_tp[4] = lt;
  return m;
}

}  // namespace

const LayerTimes& MeshTiming::at(int tp) const {
  auto it = by_tp.find(tp);
  if (it != by_tp.end()) return it->second;
  std::string known;
  for (const auto& [d, _] : by_tp) known += (known.empty() ? "" : ", ") + std::to_string(d);
  throw std::invalid_argument(name + ": no timing for tensor-parallel degree " + std::to_string(tp) + " (known: " + known + ")");
}

const MeshTiming& wormhole_llama31_8b() {
  static const MeshTiming m = build_wormhole();
  return m;
}

const MeshTiming& h100_llama3_8b() {
  static const MeshTiming m = build_h100();
  return m;
}

double attention_seconds(const MeshTiming& m, int tp, int64_t context, AttnMode mode) {
  check_context(context);
  return m.at(tp).attention(mode, double(context));
}

double non_attention_seconds(const MeshTiming& m, int tp, int64_t context) {
  check_context(context);
  return m.at(tp).non_attention.at(double(context));
}

double layer_seconds(const MeshTiming& m, int tp, int64_t context, AttnMode mode) {
  return non_attention_seconds(m, tp, context) + attention_seconds(m, tp, context, mode);
}

double alspec_hit_layer_seconds(const MeshTiming& m, int tp, int64_t context) {
  check_context(context);
  return m.at(tp).alspec_hit_layer(double(context));
}

double alspec_miss_layer_seconds(const MeshTiming& m, int tp, int64_t context) {
  check_context(context);
  return m.at(tp).alspec_miss_layer(double(context));
}

double tp_token_seconds(const MeshTiming& m, int tp, int64_t context) {
  check_context(context);
  return m.at(tp).fixed.at(double(context)) + m.n_layers * layer_seconds(m, tp, context, AttnMode::flash);
}

double alspec_token_seconds(const MeshTiming& m, int tp, int64_t context, double hit_rate, HitRounding rounding) {
  if (!(hit_rate >= 0 && hit_rate <= 1)) throw std::invalid_argument("hit rate must be in [0, 1], got " + std::to_string(hit_rate));
  check_context(context);
  const double n = m.n_layers;
  double hits = n * hit_rate;
  // A rate that is a whole number of layers must not lose one to floating-point error.
  if (rounding == HitRounding::whole_layers) hits = std::floor(hits + 1e-9);
  const double misses = n - hits;
  return m.at(tp).fixed.at(double(context)) + hits * alspec_hit_layer_seconds(m, tp, context) +
         misses * alspec_miss_layer_seconds(m, tp, context);
}

DeviceProfile mesh_profile(const MeshTiming& m, int tp, std::string name) {
  DeviceProfile p;
  p.name = std::move(name);
  p.times = m.at(tp);
  return p;
}

namespace {
// Profile name -> the mesh timing and the tensor-parallel degree it runs at, in listing order.
const std::vector<std::pair<std::string, std::pair<const MeshTiming*, int>>>& meshes() {
  static const std::vector<std::pair<std::string, std::pair<const MeshTiming*, int>>> table = {
      {"n150", {&wormhole_llama31_8b(), 1}},
      {"n300", {&wormhole_llama31_8b(), 2}},
      {"n300x2", {&wormhole_llama31_8b(), 4}},
      {"t3k", {&wormhole_llama31_8b(), 8}},
      {"h100-tp4", {&h100_llama3_8b(), 4}},
  };
  return table;
}
}  // namespace

// The DFlash reference's standalone drafter forward on one Blackhole p300 chip (8 layers, a
// context-only KV cache, CACHE_NOISE=False; wall time, warm, 5 runs): 48.2 ms at 2K keys of
// context, 48.1 at 4K, 51.0 at 8K, 57.4 at 16K, 70.6 at 32K, 95.9 at 64K, 143.1 at 120K.
// Interpolated between them (and extended along the end segments).
DeviceProfile p300_dflash_profile() {
  DeviceProfile p;
  p.name = "p300-dflash";
  p.forward = ContextCurve{{{2000, 0.0482}, {4000, 0.0481}, {8000, 0.0510}, {16000, 0.0574}, {32000, 0.0706},
                            {64000, 0.0959}, {120000, 0.1431}}};
  return p;
}

std::optional<DeviceProfile> accelerator_profile(const std::string& name) {
  for (const auto& [n, mesh] : meshes())
    if (n == name) return mesh_profile(*mesh.first, mesh.second, name);
  if (name == "p300-dflash") return p300_dflash_profile();
  return std::nullopt;
}

std::vector<std::string> accelerator_profile_names() {
  std::vector<std::string> out;
  for (const auto& [n, mesh] : meshes()) out.push_back(n);
  out.push_back("p300-dflash");
  return out;
}

}  // namespace specmesh
