// A read-only memory map of a whole file; weights are used in place, never copied.
// Bytes already in memory (tests, fuzzing) go through the same readers as a copy_of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace specmesh {

// A model or data file that cannot be used; what() names the file and what is wrong.
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);  // throws FormatError
  // A heap copy of `bytes` that readers take for a file called `name` (in their errors). The
  // buffer is exactly bytes.size() long, so reading past the end is caught by the address
  // sanitizer rather than hidden in a mapping's last page; it is 64-byte aligned.
  static MappedFile copy_of(std::span<const uint8_t> bytes, std::string name);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;  // data_ is a mapping (munmap), else a copy_of buffer (delete)

  void release() noexcept;
};

}  // namespace specmesh
