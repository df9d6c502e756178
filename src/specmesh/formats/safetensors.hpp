// safetensors reader over a memory map (the format of Hugging Face checkpoints, and of DFlash
// drafters): tensor table from the JSON header, tensor data used in place.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// into the data buffer); the optional "__metadata__" entry maps strings to strings. As the
// reference implementation requires, the tensors tile the data buffer exactly: no two overlap,
// no byte lies between or after them.
//
// Only the float types a drafter is stored in are read: F32, F16 and BF16. The header is parsed
// with nlohmann-json (a well-kept JSON library); the framing around it is small enough to check
// here, byte by byte, with the GGUF reader's error style.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "specmesh/formats/mapped_file.hpp"
#include "specmesh/kernels/ggml_types.hpp"

namespace specmesh {

struct SafetensorsTensor {
  std::string name;
  DType type = DType::F32;      // F32, F16 or BF16
  std::vector<int64_t> shape;   // outermost first, as in the header (PyTorch order)
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t n_elements() const;
};

// "F32", "F16", "BF16": the header's dtype names.
std::string_view safetensors_dtype_name(DType t);

class SafetensorsFile {
 public:
  // Parses and validates the whole file; throws FormatError naming the file and the defect.
  explicit SafetensorsFile(const std::string& path);
  // The same over a file already mapped, or bytes in memory (MappedFile::copy_of).
  explicit SafetensorsFile(MappedFile file);

  const std::string& path() const { return map_.path(); }
  size_t file_size() const { return map_.size(); }
  size_t data_offset() const { return data_offset_; }

  // In the order of their data offsets.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* tensor(std::string_view name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  MappedFile map_;
  size_t data_offset_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: F32 values stored as `type` (F32, F16 or BF16, rounded to nearest even).
struct SafetensorsEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> values;
  DType type = DType::F32;
};

// The bytes of a safetensors file holding `entries` in the given order (and `metadata`);
// throws std::invalid_argument when a shape does not match its value count or a name repeats.
std::vector<uint8_t> safetensors_bytes(const std::vector<SafetensorsEntry>& entries,
                                       const std::map<std::string, std::string>& metadata = {});
// Writes them to `path`; throws FormatError when the file cannot be written.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace specmesh
