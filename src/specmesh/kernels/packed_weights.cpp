#include "specmesh/kernels/packed_weights.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "specmesh/kernels/matmul.hpp"

namespace specmesh {

bool PackedWeights::wanted(DType type) {
  return (type == DType::Q8_0 || type == DType::Q4_0) && std::strcmp(matmul_isa(), "avx512") == 0;
}

size_t PackedWeights::quant_bytes(DType type) {
  switch (type) {
    case DType::Q8_0: return kPanelRows * QK8_0;
    case DType::Q4_0: return kPanelRows * QK4_0 / 2;
    default: throw std::invalid_argument("PackedWeights: " + std::string(dtype_name(type)) + " has no packed form");
  }
}

size_t PackedWeights::panel_bytes(DType type, size_t cols) {
  const size_t bytes = cols / QK8_0 * (quant_bytes(type) + kPanelRows * sizeof(uint16_t));
  return (bytes + 63) / 64 * 64;  // every panel starts 64-byte aligned
}

void PackedWeights::Free::operator()(uint8_t* p) const { std::free(p); }

PackedWeights::PackedWeights(const WeightView& w) {
  const size_t qb = quant_bytes(w.type);
  if (w.cols % QK8_0 != 0) throw std::invalid_argument("PackedWeights: row length is not a multiple of 32");
  const size_t nb = w.cols / QK8_0, panels = (w.rows + kPanelRows - 1) / kPanelRows;
  const size_t panel = panel_bytes(w.type, w.cols);
  bytes_ = panels * panel;
  // Large copies start on a 2 MiB boundary and ask for huge pages: a 1 GB model faults in
  // 500 pages instead of 250 000.
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes_ >= kHuge ? kHuge : 64;
  const size_t data_bytes = (bytes_ + align - 1) / align * align;
  data_.reset(static_cast<uint8_t*>(std::aligned_alloc(align, data_bytes)));
  if (!data_) throw std::bad_alloc();
  if (align == kHuge) madvise(data_.get(), data_bytes, MADV_HUGEPAGE);  // a hint; fine to fail
  const size_t stride = row_bytes(w.type, w.cols);
  const auto* src = static_cast<const uint8_t*>(w.data);
  const bool q8 = w.type == DType::Q8_0;
  const size_t groups = (q8 ? QK8_0 : QK4_0 / 2) / 4;  // four quant bytes per row each
  const size_t block_bytes = q8 ? sizeof(block_q8_0) : sizeof(block_q4_0);
  // Q8_0 quants become unsigned (w + 128); a row past the matrix is zero weights.
  const uint32_t flip = q8 ? 0x80808080u : 0u, zero = q8 ? 0x80808080u : 0x88888888u;
  for (size_t p = 0; p < panels; ++p) {
    uint8_t* q = data_.get() + p * panel;
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
  const size_t tail = data_bytes - bytes_;
  if (tail) std::memset(data_.get() + bytes_, 0, tail);
}

}  // namespace specmesh
