#include "specmesh/kernels/packed_weights.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/quant.hpp"

namespace specmesh {

bool PackedWeights::packable(DType type) {
  return type == DType::Q8_0 || type == DType::Q4_0 || type == DType::Q4_K || type == DType::Q6_K;
}

bool PackedWeights::wanted(DType type) { return matmul_reads_packed(type); }

size_t PackedWeights::quant_bytes(DType type) {
  switch (type) {
    case DType::Q8_0:
    case DType::Q6_K: return kPanelRows * QK8_0;
    case DType::Q4_0: return kPanelRows * QK4_0 / 2;
    case DType::Q4_K: return kPanelRows * QK8_0 / 2;
    default: throw std::invalid_argument("PackedWeights: " + std::string(dtype_name(type)) + " has no packed form");
  }
}

size_t PackedWeights::panel_bytes(DType type, size_t cols) {
  if (type == DType::Q4_K) return cols / QK_K * kQ4KBytes;
  if (type == DType::Q6_K) return cols / QK_K * kQ6KBytes;
  const size_t bytes = cols / QK8_0 * (quant_bytes(type) + kPanelRows * sizeof(uint16_t));
  return (bytes + 63) / 64 * 64;  // every panel starts 64-byte aligned
}

PackedWeights::PackedWeights(const WeightView& w) {
  if (!packable(w.type))
    throw std::invalid_argument("PackedWeights: " + std::string(dtype_name(w.type)) + " has no packed form");
  if (w.cols % traits(w.type).block_elems != 0)
    throw std::invalid_argument("PackedWeights: row length is not a multiple of the block size");
  const size_t panels = (w.rows + kPanelRows - 1) / kPanelRows, panel = panel_bytes(w.type, w.cols);
  data_ = AlignedBuffer(panels * panel, /*zero=*/false);  // every byte is written below
  if (w.type == DType::Q4_K) pack_q4_K(w, panel);
  else if (w.type == DType::Q6_K) pack_q6_K(w, panel);
  else pack_q8_0_q4_0(w, panel);
}

void PackedWeights::pack_q8_0_q4_0(const WeightView& w, size_t panel) {
  const size_t qb = quant_bytes(w.type), nb = w.cols / QK8_0, panels = data_.size() / panel;
  const size_t stride = row_bytes(w.type, w.cols);
  const auto* src = static_cast<const uint8_t*>(w.data);
  const bool q8 = w.type == DType::Q8_0;
  const size_t groups = (q8 ? QK8_0 : QK4_0 / 2) / 4;  // four quant bytes per row each
  const size_t block_bytes = q8 ? sizeof(block_q8_0) : sizeof(block_q4_0);
  // Q8_0 quants become unsigned (w + 128); a row past the matrix is zero weights.
  const uint32_t flip = q8 ? 0x80808080u : 0u, zero = q8 ? 0x80808080u : 0x88888888u;
  for (size_t p = 0; p < panels; ++p) {
    uint8_t* q = data_.data() + p * panel;
    auto* scales = reinterpret_cast<uint16_t*>(q + nb * qb);
    std::memset(scales + nb * kPanelRows, 0, panel - nb * (qb + kPanelRows * sizeof(uint16_t)));
    for (size_t r = 0; r < kPanelRows; ++r) {
      const size_t row = p * kPanelRows + r;
      const uint8_t* blk = row < w.rows ? src + row * stride : nullptr;
      for (size_t b = 0; b < nb; ++b) {
        uint16_t d = 0;
        if (blk) std::memcpy(&d, blk + b * block_bytes, sizeof d);  // both block types start with it
        scales[b * kPanelRows + r] = d;
        uint8_t* dst = q + b * qb + r * 4;
        for (size_t g = 0; g < groups; ++g) {
          uint32_t v = zero;
          if (blk) {
            std::memcpy(&v, blk + b * block_bytes + sizeof d + 4 * g, 4);
            v ^= flip;
          }
          std::memcpy(dst + g * 64, &v, 4);
        }
      }
    }
  }
}

void PackedWeights::pack_q4_K(const WeightView& w, size_t panel) {
  const size_t nsb = w.cols / QK_K, panels = data_.size() / panel;
  const auto* rows = static_cast<const block_q4_K*>(w.data);
  for (size_t p = 0; p < panels; ++p) {
    for (size_t sb = 0; sb < nsb; ++sb) {
      uint8_t* const base = data_.data() + p * panel + sb * kQ4KBytes;
      auto* d = reinterpret_cast<uint16_t*>(base);
      uint8_t* sc = base + packed::kKQuantScales;
      uint8_t* dst = base + packed::kKQuantQuants;
      for (size_t r = 0; r < kPanelRows; ++r) {
        const size_t row = p * kPanelRows + r;
        if (row >= w.rows) {  // zero weights: quants, scales and mins 0
          for (size_t k = 0; k < 2048 / 64; ++k) std::memset(dst + k * 64 + r * 4, 0, 4);
          d[r] = d[kPanelRows + r] = 0;
          for (int s = 0; s < 8; ++s) sc[16 * s + r] = sc[128 + 16 * s + r] = 0;
          continue;
        }
        const block_q4_K& b = rows[row * nsb + sb];
        for (size_t c = 0; c < 4; ++c)
          for (size_t g = 0; g < 8; ++g) std::memcpy(dst + c * 512 + g * 64 + r * 4, b.qs + 32 * c + 4 * g, 4);
        d[r] = b.d;
        d[kPanelRows + r] = b.dmin;
        for (int s = 0; s < 8; ++s) q4_K_scale_min(b.scales, s, sc[16 * s + r], sc[128 + 16 * s + r]);
      }
    }
  }
}

void PackedWeights::pack_q6_K(const WeightView& w, size_t panel) {
  const size_t nsb = w.cols / QK_K, panels = data_.size() / panel;
  const auto* rows = static_cast<const block_q6_K*>(w.data);
  for (size_t p = 0; p < panels; ++p) {
    for (size_t sb = 0; sb < nsb; ++sb) {
      uint8_t* const base = data_.data() + p * panel + sb * kQ6KBytes;
      auto* d = reinterpret_cast<uint16_t*>(base);
      auto* sc = reinterpret_cast<int8_t*>(base + packed::kKQuantScales);
      uint8_t* dst = base + packed::kKQuantQuants;
      std::memset(d, 0, 64);
      for (size_t r = 0; r < kPanelRows; ++r) {
        const size_t row = p * kPanelRows + r;
        const block_q6_K* b = row < w.rows ? &rows[row * nsb + sb] : nullptr;  // past the end: zeros
        uint8_t quants[QK_K] = {};
        if (b) q6_K_quants(*b, quants);
        // Element e's 4-byte group (e % 32) / 4 of block e / 32.
        for (int e = 0; e < QK_K; e += 4) std::memcpy(dst + (e / 32) * 512 + ((e % 32) / 4) * 64 + r * 4, quants + e, 4);
        d[r] = b ? b->d : 0;
        for (int s = 0; s < QK_K / 16; ++s) sc[16 * s + r] = b ? b->scales[s] : 0;
      }
    }
  }
}

}  // namespace specmesh
