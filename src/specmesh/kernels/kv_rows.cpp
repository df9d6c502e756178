#include "specmesh/kernels/kv_rows.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/quant.hpp"

namespace specmesh {

bool kv_type_supported(DType type) { return type == DType::F32 || type == DType::F16 || type == DType::Q8_0; }

DType parse_kv_type(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (lower == "f32") return DType::F32;
  if (lower == "f16") return DType::F16;
  if (lower == "q8_0") return DType::Q8_0;
  throw std::invalid_argument("unknown KV cache type '" + std::string(name) + "' (expected f16, q8_0 or f32)");
}

std::string kv_type_name(DType type) {
  std::string name(dtype_name(type));
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return name;
}

size_t kv_row_bytes(DType type, size_t n) {
  switch (type) {
    case DType::F32: return n * sizeof(float);
    case DType::F16: return n * sizeof(uint16_t);
    case DType::Q8_0: return n / QK8_0 * sizeof(block_q8_0);
    default: throw std::invalid_argument("KV rows cannot be stored as " + std::string(dtype_name(type)));
  }
}

void kv_store(DType type, const float* in, size_t n, void* row) {
  switch (type) {
    case DType::F32: std::memcpy(row, in, n * sizeof(float)); return;
    case DType::F16: {
      auto* out = static_cast<uint16_t*>(row);
      for (size_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(in[i]);
      return;
    }
    case DType::Q8_0: quantize_row(DType::Q8_0, in, row, n); return;
    default: throw std::invalid_argument("KV rows cannot be stored as " + std::string(dtype_name(type)));
  }
}

void kv_load(DType type, const void* row, size_t x, size_t n, float* out) {
  switch (type) {
    case DType::F32: std::memcpy(out, static_cast<const float*>(row) + x, n * sizeof(float)); return;
    case DType::F16: {
      const auto* in = static_cast<const uint16_t*>(row) + x;
      for (size_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(in[i]);
      return;
    }
    case DType::Q8_0: {
      // The value is d * q, one rounding, as the kernels that widen in registers compute it.
      // Block by block, so the scale is widened once per 32 values and the inner loop
      // vectorises.
      const auto* blocks = static_cast<const block_q8_0*>(row);
      for (size_t i = 0; i < n;) {
        const block_q8_0& b = blocks[(x + i) / QK8_0];
        const size_t first = (x + i) % QK8_0, len = std::min(size_t(QK8_0) - first, n - i);
        const float d = fp16_to_fp32(b.d);
        const int8_t* q = b.qs + first;
        float* o = out + i;
        for (size_t e = 0; e < len; ++e) o[e] = d * float(q[e]);
        i += len;
      }
      return;
    }
    default: throw std::invalid_argument("KV rows cannot be stored as " + std::string(dtype_name(type)));
  }
}

}  // namespace specmesh
