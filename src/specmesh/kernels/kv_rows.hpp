// How a layer's cached keys and values are stored, and the view the attention kernels read.
//
// Rows are stored as F32, F16 (the default: half the bytes of F32, and every F16 value is
// exact in F32, so reading a row back gives what was stored) or Q8_0 (blocks of 32 values,
// one F16 scale each: about a quarter of F32's bytes). A row is converted when it is written
// (rounding to nearest) and widened to F32 when it is read; a kernel's result depends on the
// stored values only, never on which path widened them. One exception: the AVX-512 attention
// scores Q8_0 keys with 8-bit dot products against the query quantised per 32 values the same
// way (flash_decode_avx512.cpp; llama.cpp does the same for a quantised K cache), so there the
// scores also carry the query's rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

// What a KV cache stores when nothing says otherwise (RunSpec::kv_type in the public
// topology.hpp spells it "f16" too, as that header stands apart from the kernels).
constexpr DType kDefaultKvType = DType::F16;

// Whether `type` can hold KV rows: F32, F16 or Q8_0.
bool kv_type_supported(DType type);
// "f32", "f16", "q8_0" (any case) -> the type; throws std::invalid_argument naming the choices.
DType parse_kv_type(std::string_view name);
// The name parse_kv_type reads ("f16").
std::string kv_type_name(DType type);
// Bytes of one row of n values (n a multiple of 32 for Q8_0).
size_t kv_row_bytes(DType type, size_t n);

// Writes the n values of `in` as one row at `row` (kv_row_bytes(type, n) bytes).
void kv_store(DType type, const float* in, size_t n, void* row);
// Reads values [x, x + n) of the row at `row` into out. For Q8_0 any x and n within the row.
void kv_load(DType type, const void* row, size_t x, size_t n, float* out);

// Keys and values of one layer: row c holds cell c, row_stride values (n_kv_heads * head_dim)
// of `type`. A view of some KV heads starts `offset` values into each row.
struct KvRows {
  const void* k;
  const void* v;
  size_t row_stride;        // values per row
  DType type = DType::F32;
  size_t offset = 0;        // values before this view's first one, in every row

  size_t row_bytes() const { return kv_row_bytes(type, row_stride); }
  const uint8_t* k_row(int32_t cell) const { return static_cast<const uint8_t*>(k) + size_t(cell) * row_bytes(); }
  const uint8_t* v_row(int32_t cell) const { return static_cast<const uint8_t*>(v) + size_t(cell) * row_bytes(); }
  // The same rows from `values` further on.
  KvRows shifted(size_t values) const { return KvRows{k, v, row_stride, type, offset + values}; }
};

}  // namespace specmesh
