// Latencies printed in the ALSpec paper (Cai et al., "Attention-Level Speculation", ICML 2025),
// kept row by row so that tests can check them against the printed totals and the timing
// models can say where each number comes from.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace specmesh {

// One printed row of a per-op table: the op code and its device firmware duration.
struct OpLatency {
  std::string_view op;
  double ns;
};

// The attention kernel's row; the printed per-layer total leaves it out.
inline constexpr std::string_view kAttentionOp = "ScaledDotProductAttentionDecode";

// Llama 3.1 8B decode, batch 1, context 1K, on `tp` Wormhole n150 chips in tensor parallel.
struct WormholeLatencyTable {
  int tp;
  std::string_view source;               // which table of the paper
  std::span<const OpLatency> layer_ops;  // one decoder layer in printed order, attention included
  double layer_total_ns;                 // printed "Total / Layer without flash decode"
  std::span<const OpLatency> head_ops;   // embedding and LM head
  double head_total_ns;                  // printed "Total LM Head"
};

// Tables 4-7, for tp = 1, 2, 4, 8.
std::span<const WormholeLatencyTable> wormhole_llama31_8b_tables();

// Table 3: Llama 3 8B on H100s (measured 4x and 8x tensor parallel, projected ALSpec).
struct H100Row {
  int64_t context;
  double attn_us;      // per decoder layer, 4xH100
  double non_attn_us;  // per decoder layer, 4xH100
  double tp4_tok_s;
  double tp8_tok_s;
  double alspec65_tok_s;  // the paper's projection at a 65 % hit rate on 4+4 H100s
};
std::span<const H100Row> h100_llama3_8b_table();

}  // namespace specmesh
