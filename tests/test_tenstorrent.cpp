// The emulated accelerator mesh's timing: the ALSpec paper's latency tables, the flash-decode
// model fitted to them, Appendix F's token-latency formula and Table 3's H100 projection, and
// device profiles that time attention at a virtual context length.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "specmesh/devices/device.hpp"
#include "specmesh/devices/latency_tables.hpp"
#include "specmesh/devices/tenstorrent.hpp"

using namespace specmesh;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t K = 1024;

double tok_s(double seconds) { return 1.0 / seconds; }

double attention_row_ns(const WormholeLatencyTable& t) {
  for (const OpLatency& r : t.layer_ops)
    if (r.op == kAttentionOp) return r.ns;
  return 0;
}

}  // namespace

TEST(TenstorrentTables, RowsAddUpToThePrintedTotals) {
  ASSERT_EQ(wormhole_llama31_8b_tables().size(), 4u);
  for (const WormholeLatencyTable& t : wormhole_llama31_8b_tables()) {
    SCOPED_TRACE(std::string(t.source));
    int attention_rows = 0;
    double layer = 0, head = 0;
    for (const OpLatency& r : t.layer_ops) {
      if (r.op == kAttentionOp) ++attention_rows;
      else layer += r.ns;
    }
    for (const OpLatency& r : t.head_ops) head += r.ns;
    // The per-layer total leaves the attention row out, so counting it would be double.
    EXPECT_EQ(attention_rows, 1);
    EXPECT_NEAR(layer, t.layer_total_ns, 1.0);
    // Table 5's head column is 42 ns off its total once its repeated Concat is dropped.
    EXPECT_NEAR(head, t.head_total_ns, 1e-4 * t.head_total_ns);
  }
}

TEST(TenstorrentTiming, ProfilesCarryTheTablesTotals) {
  const MeshTiming& m = wormhole_llama31_8b();
  for (const WormholeLatencyTable& t : wormhole_llama31_8b_tables()) {
    SCOPED_TRACE(std::string(t.source));
    for (int64_t k : {int64_t(0), 1 * K, 128 * K}) {
      EXPECT_DOUBLE_EQ(non_attention_seconds(m, t.tp, k), t.layer_total_ns * 1e-9);
      EXPECT_DOUBLE_EQ(m.at(t.tp).fixed.at(double(k)), t.head_total_ns * 1e-9);
    }
    // Flash decode goes through the table's attention row at the context it was measured at.
    EXPECT_NEAR(attention_seconds(m, t.tp, 1 * K, AttnMode::flash), attention_row_ns(t) * 1e-9, 1e-12);
    EXPECT_NEAR(layer_seconds(m, t.tp, 1 * K, AttnMode::flash), (t.layer_total_ns + attention_row_ns(t)) * 1e-9, 1e-12);
  }
}

TEST(TenstorrentTiming, FlashDecodeIsLinearInContextAtTheAssumedBandwidth) {
  const MeshTiming& m = wormhole_llama31_8b();
  // One chip reads 2 x 128 x 8 bytes of KV per context token at 180 GB/s.
  const double per_token_1 = 2.0 * 128 * 8 / 180e9;
  EXPECT_NEAR(attention_seconds(m, 1, 65 * K, AttnMode::flash) - attention_seconds(m, 1, 1 * K, AttnMode::flash),
              64 * K * per_token_1, 1e-12);
  for (int tp : {1, 2, 4, 8}) {
    SCOPED_TRACE(tp);
    const double a = attention_seconds(m, tp, 1 * K, AttnMode::flash);
    const double b = attention_seconds(m, tp, 64 * K, AttnMode::flash);
    const double c = attention_seconds(m, tp, 127 * K, AttnMode::flash);
    EXPECT_GT(b, a);
    EXPECT_NEAR(b - a, c - b, 1e-12);
    // The sender's kernel costs what flash decode costs; the receiver's does not grow with K.
    EXPECT_DOUBLE_EQ(attention_seconds(m, tp, 96 * K, AttnMode::spec_sender), attention_seconds(m, tp, 96 * K, AttnMode::flash));
    const double r = attention_seconds(m, tp, 1 * K, AttnMode::spec_receiver);
    EXPECT_DOUBLE_EQ(attention_seconds(m, tp, 128 * K, AttnMode::spec_receiver), r);
    EXPECT_GT(r, 0);
    EXPECT_LT(r, a + 5e-6);
  }
  // Fewer KV heads per chip: less to read, but not proportionally faster (NoC bound).
  EXPECT_GT(attention_seconds(m, 8, 128 * K, AttnMode::flash), attention_seconds(m, 4, 128 * K, AttnMode::flash) / 2);
  EXPECT_LT(attention_seconds(m, 8, 128 * K, AttnMode::flash), attention_seconds(m, 4, 128 * K, AttnMode::flash));
}

TEST(TenstorrentAlspec, FormulaReproducesThePapersWormholeResults) {
  const MeshTiming& m = wormhole_llama31_8b();
  // Section 5.2: best case 1.65x over 8-chip tensor parallel, at 96K and 87.5 % hits.
  const double speedup = tp_token_seconds(m, 8, 96 * K) / alspec_token_seconds(m, 4, 96 * K, 0.875);
  EXPECT_NEAR(speedup, 1.65, 0.02);
  double best = 0;
  int64_t best_k = 0;
  double best_r = 0;
  for (int64_t k : {1 * K, 32 * K, 64 * K, 96 * K, 128 * K})
    for (double r : {0.5, 0.625, 0.75, 0.875}) {
      const double s = tp_token_seconds(m, 8, k) / alspec_token_seconds(m, 4, k, r);
      if (s > best) best = s, best_k = k, best_r = r;
    }
  EXPECT_EQ(best_k, 96 * K);
  EXPECT_EQ(best_r, 0.875);
  // Section 5.2: going from 4 to 8 chips of tensor parallel gives almost nothing at long context.
  EXPECT_NEAR(tok_s(tp_token_seconds(m, 8, 128 * K)) / tok_s(tp_token_seconds(m, 4, 128 * K)), 1.0, 0.02);
  // ...while it still helps from 1 to 2 chips.
  EXPECT_GT(tok_s(tp_token_seconds(m, 2, 32 * K)), 1.3 * tok_s(tp_token_seconds(m, 1, 32 * K)));
}

TEST(TenstorrentAlspec, HitAndMissLayersFollowAppendixF) {
  const MeshTiming& m = wormhole_llama31_8b();
  const int tp = 4;
  for (int64_t k : {1 * K, 64 * K, 128 * K}) {
    SCOPED_TRACE(k);
    const double L = non_attention_seconds(m, tp, k);
    const double s = attention_seconds(m, tp, k, AttnMode::spec_sender);
    const double r = attention_seconds(m, tp, k, AttnMode::spec_receiver);
    EXPECT_DOUBLE_EQ(alspec_hit_layer_seconds(m, tp, k), r + std::max(s - r, L));
    EXPECT_DOUBLE_EQ(alspec_miss_layer_seconds(m, tp, k), L + s);
    const double fixed = m.at(tp).fixed.at(double(k));
    EXPECT_NEAR(alspec_token_seconds(m, tp, k, 1.0), fixed + 32 * alspec_hit_layer_seconds(m, tp, k), 1e-12);
    // No hits is tensor parallel with the speculative kernel, which costs what flash decode does.
    EXPECT_NEAR(alspec_token_seconds(m, tp, k, 0.0), tp_token_seconds(m, tp, k), 1e-12);
  }
  // Whole layers: 65 % of 32 is 20.8, so 20 hits and 12 misses.
  const double L20 = m.at(tp).fixed.at(64.0 * K) + 20 * alspec_hit_layer_seconds(m, tp, 64 * K) +
                     12 * alspec_miss_layer_seconds(m, tp, 64 * K);
  EXPECT_NEAR(alspec_token_seconds(m, tp, 64 * K, 0.65), L20, 1e-12);
  EXPECT_LT(alspec_token_seconds(m, tp, 64 * K, 0.65, HitRounding::expected), L20);
  // Rates on the 1/32 grid need no rounding.
  EXPECT_NEAR(alspec_token_seconds(m, tp, 64 * K, 0.875), alspec_token_seconds(m, tp, 64 * K, 0.875, HitRounding::expected), 1e-12);
}

TEST(TenstorrentAlspec, Table3ProjectionIsReproduced) {
  const MeshTiming& m = h100_llama3_8b();
  for (const H100Row& row : h100_llama3_8b_table()) {
    SCOPED_TRACE(row.context);
    // The fixed part is derived so that tensor parallel matches its column exactly.
    EXPECT_NEAR(tok_s(tp_token_seconds(m, 4, row.context)), row.tp4_tok_s, 1e-9);
    EXPECT_DOUBLE_EQ(alspec_hit_layer_seconds(m, 4, row.context), std::max(row.attn_us, row.non_attn_us) * 1e-6);
    const double expected = tok_s(alspec_token_seconds(m, 4, row.context, 0.65, HitRounding::expected));
    EXPECT_NEAR(expected, row.alspec65_tok_s, 0.001 * row.alspec65_tok_s);
    const double whole = tok_s(alspec_token_seconds(m, 4, row.context, 0.65));
    EXPECT_NEAR(whole, row.alspec65_tok_s, 0.05 * row.alspec65_tok_s);
    EXPECT_LE(whole, expected);
  }
}

TEST(TenstorrentProfiles, FoundByName) {
  struct Named {
    const char* name;
    const MeshTiming& mesh;
    int tp;
  };
  for (const Named& n : {Named{"n150", wormhole_llama31_8b(), 1}, Named{"n300", wormhole_llama31_8b(), 2},
                         Named{"n300x2", wormhole_llama31_8b(), 4}, Named{"t3k", wormhole_llama31_8b(), 8},
                         Named{"h100-tp4", h100_llama3_8b(), 4}}) {
    SCOPED_TRACE(n.name);
    const auto p = device_profile(n.name);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->name, n.name);
    ASSERT_TRUE(p->times);
    WorkCost layer;
    layer.layers = 1;
    layer.context = 32 * K;
    EXPECT_DOUBLE_EQ(p->seconds(layer), layer_seconds(n.mesh, n.tp, 32 * K, AttnMode::flash));
  }
  EXPECT_FALSE(device_profile("n450"));
  EXPECT_TRUE(device_profile("slow-node"));
  const auto board = link_profile("eth-n300"), card = link_profile("eth-card");
  ASSERT_TRUE(board && card);
  EXPECT_LT(board->seconds(8192), card->seconds(8192));
  EXPECT_FALSE(link_profile("eth-n450"));
}

TEST(TenstorrentProfiles, BadInputsAreRejectedClearly) {
  const MeshTiming& m = wormhole_llama31_8b();
  EXPECT_THROW(layer_seconds(m, 4, -1, AttnMode::flash), std::invalid_argument);
  EXPECT_THROW(tp_token_seconds(m, 4, -5), std::invalid_argument);
  EXPECT_THROW(m.at(4).flash.at(std::numeric_limits<double>::quiet_NaN()), std::invalid_argument);
  EXPECT_THROW(ContextCurve{}.at(1), std::invalid_argument);
  EXPECT_THROW(alspec_token_seconds(m, 4, K, std::numeric_limits<double>::quiet_NaN()), std::invalid_argument);
  EXPECT_THROW(alspec_token_seconds(m, 4, K, 1.5), std::invalid_argument);
  try {
    layer_seconds(m, 3, K, AttnMode::flash);
    FAIL() << "tp 3 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("degree 3 (known: 1, 2, 4, 8)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(h100_llama3_8b().at(8), std::invalid_argument);
  DeviceProfile p = *device_profile("n150");
  p.virtual_context = -1;
  WorkCost one;
  one.layers = 1;
  EXPECT_THROW(p.seconds(one), std::invalid_argument);
}

TEST(TenstorrentProfiles, VirtualContextTimesAttentionAtTheChosenLength) {
  const MeshTiming& m = wormhole_llama31_8b();
  DeviceProfile p = *device_profile("n300x2");
  WorkCost whole;
  whole.layers = 3;
  whole.tokens = 1;
  whole.context = 40;  // the real, small model's context
  EXPECT_DOUBLE_EQ(p.seconds(whole), 3 * layer_seconds(m, 4, 40, AttnMode::flash));
  p.virtual_context = 128 * K;
  EXPECT_DOUBLE_EQ(p.seconds(whole), 3 * layer_seconds(m, 4, 128 * K, AttnMode::flash));

  // A layer split across the two sides of a speculative pair adds up, and the head is extra.
  WorkCost attention = whole, rest = whole;
  attention.part = LayerPart::attention;
  rest.part = LayerPart::rest;
  EXPECT_DOUBLE_EQ(p.seconds(attention) + p.seconds(rest), p.seconds(whole));
  attention.attn = AttnMode::spec_receiver;
  EXPECT_DOUBLE_EQ(p.seconds(attention), 3 * attention_seconds(m, 4, 128 * K, AttnMode::spec_receiver));
  WorkCost head = whole;
  head.head = true;
  EXPECT_DOUBLE_EQ(p.seconds(head) - p.seconds(whole), 638529e-9);
  head.layers = 32;
  EXPECT_NEAR(p.seconds(head), tp_token_seconds(m, 4, 128 * K), 1e-12);
}

TEST(TenstorrentProfiles, VirtualLayersTimeAWholePassAsADeeperModel) {
  const MeshTiming& m = wormhole_llama31_8b();
  DeviceProfile p = *device_profile("n300x2");
  p.virtual_context = 16 * K;
  p.virtual_layers = 32;
  WorkCost pass;
  pass.layers = 6;  // the small model's stage
  pass.tokens = 1;
  pass.head = true;
  EXPECT_NEAR(p.seconds(pass), tp_token_seconds(m, 4, 16 * K), 1e-12) << "a pass is timed as the 32-layer model's token";
  // Ops timed a layer at a time (an ALSpec group's) are not scaled.
  WorkCost op = pass;
  op.layers = 1;
  op.head = false;
  op.part = LayerPart::rest;
  EXPECT_DOUBLE_EQ(p.seconds(op), m.at(4).non_attention.at(16 * K));
}

TEST(TenstorrentProfiles, TheP300DrafterForwardIsTheReferencesMeasurement) {
  const auto p = device_profile("p300-dflash");
  ASSERT_TRUE(p && p->forward);
  WorkCost c;
  c.layers = 1;  // whatever the drafter's depth and work: the whole forward is one program
  c.flops = 1e12;
  for (const auto& [ctx, ms] : std::vector<std::pair<int64_t, double>>{{2000, 48.2}, {16000, 57.4}, {64000, 95.9}, {120000, 143.1}}) {
    c.context = ctx;
    EXPECT_NEAR(p->seconds(c), ms * 1e-3, 1e-12) << ctx;
  }
  c.context = 24000;  // between 16K (57.4 ms) and 32K (70.6 ms)
  EXPECT_NEAR(p->seconds(c), 0.064, 1e-9);
  DeviceProfile v = *p;
  v.virtual_context = 120000;
  c.context = 30;
  EXPECT_NEAR(v.seconds(c), 0.1431, 1e-12);
  EXPECT_EQ(v.seconds(WorkCost{}), 0.0) << "a job without model work (a cache operation) takes no modelled time";
}

TEST(TenstorrentProfiles, DeviceWaitsOutAVirtualLongContextToken) {
  // A whole token of Llama 3.1 8B on one n150 at 128K: about 79 ms of modelled time, while the
  // real job does nothing.
  DeviceProfile p = *device_profile("n150");
  p.virtual_context = 128 * K;
  Device d("n150", 1, p);
  WorkCost token;
  token.layers = 32;
  token.tokens = 1;
  token.head = true;
  const double modelled = tp_token_seconds(wormhole_llama31_8b(), 1, 128 * K);
  ASSERT_DOUBLE_EQ(d.modelled_seconds(token), modelled);
  const auto t0 = Clock::now();
  d.execute([&](ThreadPool&) { return token; });
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(took, modelled);
  EXPECT_LT(took, modelled + 0.5);
}
