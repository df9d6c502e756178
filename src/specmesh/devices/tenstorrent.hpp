// Timing of Llama 3.1 8B decode on accelerator meshes, as the ALSpec paper measured it: per
// tensor-parallel degree, one decoder layer's non-attention time, the attention kernels as
// functions of the context length, and the fixed per-token part (embedding, LM head). Device
// profiles for the emulated mesh are built from it, and Appendix F's token-latency formula runs
// over the same numbers, so an actor-level emulation can be checked against the formula.
//
// Wormhole (Tables 4-7 at context 1K). The paper plots flash decode against context only as a
// figure (Fig. 12), so attention is modelled as a line in K, fixed by the tables' attention rows:
//   FD(K)    = FD_table(1K) + (K - 1024) * kv_bytes(tp) / bandwidth(tp)
//   SFD_S(K) = FD(K)                     (the paper finds no measurable speculation overhead)
//   SFD_R(K) = FD(2 S) + Ethernet hop    (the receiver waits for the first-and-last-chunk partial)
// kv_bytes(tp) = 2 (K and V) x 128 (head dim) x 8/tp KV heads x 1 byte (BFP8); bandwidths and S
// are in tenstorrent.cpp with their reasons. K counts tokens, and "96K" means 96 x 1024.
//
// H100 (Table 3): attention and non-attention per layer at the printed contexts, linear in
// between; no speculative kernel, so SFD_S = attention and SFD_R = 0, and a hit layer costs
// max(attention, non-attention). Table 3 prints no fixed part; per row it is what the 4xH100
// throughput leaves after the layers: 1/tok_s - 32 x (attention + non-attention).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "specmesh/profiles.hpp"

namespace specmesh {

// One model on one kind of accelerator, by tensor-parallel degree.
struct MeshTiming {
  std::string name;
  int n_layers = 32;
  std::map<int, LayerTimes> by_tp;

  // Throws std::invalid_argument naming the degrees there are.
  const LayerTimes& at(int tp) const;
};

const MeshTiming& wormhole_llama31_8b();  // tp 1, 2, 4, 8
const MeshTiming& h100_llama3_8b();       // tp 4 (the only degree with per-layer numbers)

// Seconds of one decoder layer's attention kernel, of the rest, and of both, at context K.
// Negative contexts and unknown degrees throw std::invalid_argument.
double attention_seconds(const MeshTiming& m, int tp, int64_t context, AttnMode mode);
double non_attention_seconds(const MeshTiming& m, int tp, int64_t context);
double layer_seconds(const MeshTiming& m, int tp, int64_t context, AttnMode mode);

// Appendix F, speculative parallel over two groups of `tp` chips each. A hit lets the receiver
// run the rest of the layer on the speculated output while the sender finishes attention:
//   hit  = SFD_R(K) + max(SFD_S(K) - SFD_R(K), L)
// A miss runs the rest after the full attention, which is the speculative kernel's (so any
// speculation overhead is SFD_S - FD): miss = L + SFD_S(K).
double alspec_hit_layer_seconds(const MeshTiming& m, int tp, int64_t context);
double alspec_miss_layer_seconds(const MeshTiming& m, int tp, int64_t context);

// Per-token latency with full tensor parallelism: fixed + n_layers x (L + FD(K)).
double tp_token_seconds(const MeshTiming& m, int tp, int64_t context);

// How hit layers are counted at hit rate r. whole_layers is Appendix F: floor(n r) hits and
// ceil(n (1 - r)) misses, an upper bound on latency; expected uses n r and n (1 - r), which is
// what Table 3's projection at 65 % reproduces.
enum class HitRounding { whole_layers, expected };

// Per-token latency of speculative + tensor parallel (2 x tp chips) at hit rate r in [0, 1]:
// fixed + hits x hit layer + misses x miss layer. A NaN or out-of-range rate throws.
double alspec_token_seconds(const MeshTiming& m, int tp, int64_t context, double hit_rate,
                            HitRounding rounding = HitRounding::whole_layers);

// A device profile for one tensor-parallel group of the mesh (the group is one device actor).
DeviceProfile mesh_profile(const MeshTiming& m, int tp, std::string name);

// "n150", "n300", "n300x2", "t3k" (Wormhole at tp 1, 2, 4, 8) and "h100-tp4". The paper
// measured N150 chips joined by Ethernet; the n300 boards carry the same Wormhole chips, so the
// multi-chip tables stand in for the boards. "p300-dflash": the DFlash reference's drafter
// forward on one Blackhole p300 chip, a whole pass by context (DeviceProfile::forward).
std::optional<DeviceProfile> accelerator_profile(const std::string& name);
std::vector<std::string> accelerator_profile_names();

}  // namespace specmesh
