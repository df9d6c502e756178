// GGUF (v2/v3) reader over a memory map: metadata, tensor table, tensor data in place.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "specmesh/formats/mapped_file.hpp"
#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

// gguf_type: the value types of metadata entries.
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
std::string_view gguf_type_name(GgufType t);

// One metadata value. Scalars use the field matching their type family; arrays keep
// their element type and fill exactly one of ints / floats / strings.
struct GgufValue {
  GgufType type = GgufType::U32;
  GgufType elem_type = GgufType::U32;  // arrays only
  int64_t i = 0;        // every integer type and BOOL (u64 values are stored bit-cast)
  double f = 0;         // F32, F64
  std::string s;        // STRING
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;

  bool is_array() const { return type == GgufType::ARRAY; }
  size_t array_size() const { return ints.size() + floats.size() + strings.size(); }
};

struct GgufKV {
  std::string key;
  GgufValue value;
};

struct GgufTensorInfo {
  std::string name;
  uint32_t n_dims = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  DType type = DType::F32;
  uint64_t offset = 0;       // relative to the data blob
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

// Whether the file starts with the GGUF magic (false when it cannot be read).
bool is_gguf_file(const std::string& path);
bool is_gguf_file(const MappedFile& file);

class GgufFile {
 public:
  // Parses and validates the whole file; throws FormatError naming the file and the defect.
  explicit GgufFile(const std::string& path);
  // The same over a file already mapped, or bytes in memory (MappedFile::copy_of).
  explicit GgufFile(MappedFile file);

  const std::string& path() const { return map_.path(); }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  size_t data_offset() const { return data_offset_; }
  size_t file_size() const { return map_.size(); }

  const std::vector<GgufKV>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;
  // Typed lookups: nullopt when absent, FormatError when present with the wrong type.
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;  // accepts integers too
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* tensor(std::string_view name) const;

 private:
  MappedFile map_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t data_offset_ = 0;
  std::vector<GgufKV> kv_;
  std::vector<GgufTensorInfo> tensors_;
};

}  // namespace specmesh
