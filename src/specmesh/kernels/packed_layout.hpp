// Byte offsets inside one packed K-quant super-block (the layout packed_weights.hpp describes),
// shared by the packer and the AVX-512 kernels that read it. No other include: the kernels'
// translation units instantiate no standard-library template (matmul_avx512.cpp).
#pragma once

#include <cstddef>

namespace specmesh::packed {

constexpr size_t kKQuantScales = 64;        // after the 16 rows' d (and dmin), f16
constexpr size_t kKQuantQuants = 64 + 256;  // after the scales (and mins)
constexpr size_t kQ4KBytes = kKQuantQuants + 2048;  // one Q4_K super-block of a panel
constexpr size_t kQ6KBytes = kKQuantQuants + 4096;  // one Q6_K super-block of a panel

}  // namespace specmesh::packed
