// Q8_0, Q4_0, Q4_K and Q6_K weights rearranged for the AVX-512 integer kernels (and all but
// Q8_0 for the AVX2 ones, matmul_packed_avx2.cpp).
//
// The file layout keeps a row's blocks together, so an integer dot product fills each SIMD
// lane with part of one output and needs a float scale-and-add per block pair per output,
// plus a horizontal sum at the end. In the packed layout 16 consecutive rows form a panel,
// and the panel's quant bytes are interleaved by four (row 0's bytes 0..3, row 1's bytes
// 0..3, ... row 15's, then bytes 4..7 of each): one 64-byte load then feeds one vpdpbusd
// that adds four products to each of 16 outputs, with a token's four activation bytes
// broadcast. Each lane is one output for the whole row, so the float work per 32 weights is
// one convert, multiply and fused add per 16 outputs, and no horizontal sum is left.
//
// A Q8_0 / Q4_0 panel of a matrix with nb blocks per row:
//   nb x kQuantBytes   the interleaved quants of each block, 64-byte aligned: Q8_0 as
//                      unsigned bytes w + 128 (8 loads of 64 bytes), Q4_0 as its stored
//                      bytes (4 loads; low nibbles are elements 4m.., high ones 16 + 4m..);
//   nb x 32            each block's 16 row scales, f16 as in the file;
//   padding to a multiple of 64 bytes.
// A Q4_K panel, per super-block of 256 (kQ4KBytes, a multiple of 64), its scales first: the
// kernel reads them before the quants, and reading a super-block front to back keeps the
// hardware prefetcher ahead (with the scales after the quants, decode was about 10 % slower):
//   32 + 32            the 16 rows' d, then dmin (f16);
//   128 + 128          the 6-bit scales, then mins, of sub-block s for the 16 rows at 16 s;
//   2048               4 chunks of 64 elements, each 8 groups of 64 bytes: the stored bytes
//                      4g..4g+3 of the chunk's 32 (low nibbles: sub-block 2c, elements
//                      4g..; high nibbles: sub-block 2c + 1).
// A Q6_K panel, per super-block of 256 (kQ6KBytes), scales first as well:
//   32 + 32            the 16 rows' d (f16), then padding;
//   256                the signed 8-bit scale of sub-block s (16 elements) for the 16 rows
//                      at 16 s;
//   4096               8 blocks of 32 elements laid out as Q8_0's, each quant one unsigned
//                      byte 0..63 (its 6 bits unpacked: Q6_K's bit planes cost more to
//                      split in the kernel than the extra bytes cost to read).
// Rows past the matrix in the last panel are zero weights with scale 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/kernels/packed_layout.hpp"

namespace specmesh {

struct WeightView;

class PackedWeights {
 public:
  static constexpr size_t kPanelRows = 16;

  static constexpr size_t kQ4KBytes = packed::kQ4KBytes;  // one super-block of a panel
  static constexpr size_t kQ6KBytes = packed::kQ6KBytes;

  // Whether the type has a packed form: Q8_0, Q4_0, Q4_K and Q6_K.
  static bool packable(DType type);
  // Whether matrices of this type are packed while `matmul_isa()` is the path that reads
  // them (matmul_reads_packed): the packable types on the AVX-512 path, all but Q8_0 on AVX2.
  static bool wanted(DType type);
  // Interleaved quant bytes per 32-block of one panel (512 for Q8_0 and Q6_K, 256 for Q4_0
  // and Q4_K).
  static size_t quant_bytes(DType type);
  // Bytes of one panel of a row of `cols` values (a multiple of 64).
  static size_t panel_bytes(DType type, size_t cols);

  // Packs `w` (Q8_0, Q4_0, Q4_K or Q6_K; std::invalid_argument otherwise).
  explicit PackedWeights(const WeightView& w);

  // 64-byte aligned (2 MiB for large ones); lives as long as this object (moves keep the
  // address).
  const void* data() const { return data_.data(); }
  size_t bytes() const { return data_.size(); }

 private:
  void pack_q8_0_q4_0(const WeightView& w, size_t panel);
  void pack_q4_K(const WeightView& w, size_t panel);
  void pack_q6_K(const WeightView& w, size_t panel);

  AlignedBuffer data_;
};

}  // namespace specmesh
