// Memory for the kernels' whole-register loads: 64-byte aligned, and for buffers of 2 MiB or
// more on a 2 MiB boundary with transparent huge pages requested (a 1 GB matrix or KV cache
// then faults in 500 pages instead of 250 000, and long scans miss the TLB less).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace specmesh {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // `bytes` bytes, zeroed when `zero` (otherwise only the padding past them is); throws
  // std::bad_alloc.
  explicit AlignedBuffer(size_t bytes, bool zero = true);

  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return bytes_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t bytes_ = 0;
};

}  // namespace specmesh
