// GGUF v3 writer: metadata of every value type, tensors packed and aligned the way
// llama.cpp's reader demands, data streamed to disk (never the whole model in memory).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

class GgufWriter {
 public:
  // Fills the stored bytes of rows [row_begin, row_end) at dst, row_bytes(type, ne[0]) per row.
  // A row is ne[0] values; a tensor has ne[1]*ne[2]*ne[3] rows. Called from worker threads,
  // possibly concurrently for disjoint ranges, so it must not touch shared mutable state.
  using RowBytesFn = std::function<void(int64_t row_begin, int64_t row_end, uint8_t* dst)>;
  // Writes the ne[0] F32 values of one row; the writer encodes them into the tensor's type.
  // Same threading rules as RowBytesFn.
  using RowF32Fn = std::function<void(int64_t row, float* dst)>;

  GgufWriter() = default;

  // --- metadata ---------------------------------------------------------------------------
  // Keys keep the order of their first setting; setting a key again replaces its value, so
  // keys are always unique. Misuse (empty key, out-of-range value) throws std::invalid_argument.
  void set_u8(std::string_view key, uint8_t v);
  void set_i8(std::string_view key, int8_t v);
  void set_u16(std::string_view key, uint16_t v);
  void set_i16(std::string_view key, int16_t v);
  void set_u32(std::string_view key, uint32_t v);
  void set_i32(std::string_view key, int32_t v);
  void set_u64(std::string_view key, uint64_t v);
  void set_i64(std::string_view key, int64_t v);
  void set_f32(std::string_view key, float v);
  void set_f64(std::string_view key, double v);
  void set_bool(std::string_view key, bool v);
  void set_string(std::string_view key, std::string_view v);

  // Arrays. elem must be an integer type or BOOL for set_array_ints (u64 values bit-cast
  // into int64, as GgufValue stores them), F32/F64 for set_array_floats.
  void set_array_ints(std::string_view key, GgufType elem, std::span<const int64_t> v);
  void set_array_floats(std::string_view key, GgufType elem, std::span<const double> v);
  void set_array_i32(std::string_view key, std::span<const int32_t> v);
  void set_array_u32(std::string_view key, std::span<const uint32_t> v);
  void set_array_f32(std::string_view key, std::span<const float> v);
  void set_array_strings(std::string_view key, std::span<const std::string> v);

  // Any value, e.g. one copied from a GgufFile; validated like the typed setters
  // (no nested arrays, the container matching the element type, values in range).
  void set(std::string_view key, const GgufValue& v);

  const GgufValue* find(std::string_view key) const;
  bool remove(std::string_view key);
  const std::vector<GgufKV>& metadata() const { return kv_; }

  // general.alignment (stored as u32, which llama.cpp requires): a power of two, at least 32
  // (llama.cpp asserts 32-byte aligned tensor pointers when it maps a file).
  void set_alignment(uint32_t alignment);
  size_t alignment() const;

  // Threads that produce tensor data during write(); 0 = all hardware threads.
  void set_threads(int n) { threads_ = n; }

  // --- tensors ----------------------------------------------------------------------------
  // Written in the order added. ne has 1 to 4 dims, each >= 1, ne[0] a multiple of the type's
  // block size; names are unique and at most 63 bytes. Violations throw std::invalid_argument.
  void add_tensor(std::string_view name, DType type, const std::vector<int64_t>& ne,
                  std::vector<uint8_t> bytes);
  // Not copied: data must stay valid until write() returns (e.g. a mapped GgufFile tensor).
  void add_tensor_view(std::string_view name, DType type, const std::vector<int64_t>& ne,
                       const void* data);
  // F32 values (n_elements of them), encoded into type with quantize_row at write time.
  void add_tensor_f32(std::string_view name, DType type, const std::vector<int64_t>& ne,
                      std::vector<float> values);
  // Data produced at write time, chunk by chunk.
  void add_tensor_rows(std::string_view name, DType type, const std::vector<int64_t>& ne,
                       RowBytesFn fn);
  void add_tensor_rows_f32(std::string_view name, DType type, const std::vector<int64_t>& ne,
                           RowF32Fn fn);

  size_t n_tensors() const { return tensors_.size(); }
  // Offset of the data blob and size of the whole file write() will produce.
  uint64_t data_offset() const;
  uint64_t file_size() const;

  // Writes the file (to path + ".tmp", renamed on success so a failed write never leaves a
  // plausible-looking model behind). I/O errors throw std::runtime_error; an exception
  // thrown by a data callback is rethrown after the workers have stopped.
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    DType type;
    uint32_t n_dims;
    int64_t ne[4];
    uint64_t row_bytes;
    int64_t n_rows;
    uint64_t nbytes;
    std::vector<uint8_t> owned;
    const uint8_t* view = nullptr;
    std::vector<float> f32;
    RowBytesFn rows;
    RowF32Fn rows_f32;
  };

  Tensor& new_tensor(std::string_view name, DType type, const std::vector<int64_t>& ne);
  void put(std::string_view key, GgufValue v);
  std::string header() const;

  std::vector<GgufKV> kv_;
  std::vector<Tensor> tensors_;
  int threads_ = 0;
};

}  // namespace specmesh
